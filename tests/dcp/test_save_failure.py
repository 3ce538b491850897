"""The one error every rank raises for a save that failed on some ranks (``save_failure``):
DCP hands each rank the same CheckpointException, and each rank makes the same error of it.
The jobs that fail this way for real are in tests/jobs/test_failed_save.py."""

from __future__ import annotations

import pickle
import traceback

from torch.distributed.checkpoint.api import CheckpointException

from mlcheckpoint import CapacityError, MLCheckpointError, StateDictError
from mlcheckpoint.dcp.errors import save_failure


def failed(failures: dict[int, BaseException]) -> CheckpointException:
    """What DCP raises on every rank: each failed rank's error with its stack."""
    return CheckpointException("plan", {r: (e, traceback.StackSummary()) for r, e in failures.items()})


def node_of(rank: int) -> int:
    return rank // 2


def test_ours_comes_out_as_itself_naming_the_rank_and_node():
    cap = CapacityError("checkpoint shard needs 16.0 MiB more", needed=16, available=4)
    err = save_failure(failed({3: cap}), "async save of step 2", node_of)
    assert type(err) is CapacityError and (err.needed, err.available) == (16, 4)
    assert str(err) == "async save of step 2 failed on rank 3 (node 1): checkpoint shard " \
        "needs 16.0 MiB more"
    again = pickle.loads(pickle.dumps(err))  # crosses processes as it is
    assert type(again) is CapacityError and str(again) == str(err) and again.needed == 16
    assert str(cap) == "checkpoint shard needs 16.0 MiB more"  # the rank's own is left alone


def test_every_rank_names_the_same_one_of_several():
    """Ours before anything else, the lowest rank first; the others are named too."""
    entry = StateDictError("cannot save state dict entry 'x'", key="x", type_name="(lock)")
    e = failed({5: RuntimeError("gloo"), 4: entry, 6: CapacityError("full", needed=2, available=1)})
    err = save_failure(e, "save of step 7", node_of)
    assert type(err) is StateDictError and (err.key, err.type_name) == ("x", "(lock)")
    assert str(err).startswith("save of step 7 failed on rank 4 (node 2) (and on ranks 5, 6): "
                               "cannot save state dict entry 'x'"), str(err)


def test_anything_else_names_the_ranks():
    err = save_failure(failed({1: ValueError("bad plan")}), "save of step 3", node_of)
    assert type(err) is MLCheckpointError
    assert "save of step 3 failed on ranks [1]" in str(err) and "bad plan" in str(err)
