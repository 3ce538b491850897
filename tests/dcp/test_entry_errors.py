"""A save that fails on one entry of the state dict names that entry (its flattened key, as DCP
flattens it) and its type, on every save path, and leaves the committed steps alone. In one
process (no process group)."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from states import assert_same, make_state, zeros_like_state
from torch.distributed.checkpoint.api import CheckpointException

from mlcheckpoint import CheckpointManager, StateDictError
from mlcheckpoint.testing import internals

# DCP warns that it assumes a single process when no process group is initialised.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def manager(store_dir: str) -> CheckpointManager:
    return CheckpointManager(job_id="job-keys", local_dir=os.path.join(store_dir, "local"),
                             replication="none")


def with_entry(step: int, where: str, value) -> dict:
    """make_state(step) with ``value`` added at the dotted path ``where``; its optimizer
    (an SGD over the model's f32 tensor) makes ``guard`` overlap the copy."""
    sd = make_state(step)
    parent = sd
    *outer, last = where.split(".")
    for k in outer:
        parent = parent.setdefault(k, {})
    parent[last] = value
    return sd


def dcp_async(ckpt, sd, step):
    return dcp.async_save(sd, storage_writer=ckpt.storage_writer(step)).result(timeout=60)


def guarded_async(ckpt, sd, step):
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([param], lr=0.1)
    ckpt.guard(opt)
    sd["optim"] = {"param": param}
    return ckpt.async_save(sd, step).result(timeout=60)


SAVES = {
    "save": lambda ckpt, sd, step: ckpt.save(sd, step),
    "async_save": lambda ckpt, sd, step: ckpt.async_save(sd, step).result(timeout=60),
    "async_save guarded": guarded_async,
    "dcp.save": lambda ckpt, sd, step: dcp.save(sd, storage_writer=ckpt.storage_writer(step)),
    "dcp.async_save": dcp_async,
}
# (the entry, its flattened key, the type named): a lambda fails when pickled (in the commit,
# on the save thread for async saves); a lock already when async_save copies it, at the call.
ENTRIES = {
    "lambda": ("extra.nested.fn", lambda: (lambda x: x), "extra.nested.fn", "(function)"),
    "lock in a list": ("extra.locks", lambda: [1, threading.Lock()], "extra.locks", "(list)"),
}


def failure(e: BaseException) -> BaseException:
    """Ours, out of DCP's CheckpointException (dcp.save/async_save with our writer)."""
    if isinstance(e, CheckpointException):
        found = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        assert len(found) == 1, found
        return found[0]
    return e


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("how", list(SAVES))
def test_a_failing_entry_is_named_and_nothing_committed_is_touched(store_dir, how, entry):
    where, make, key, kind = ENTRIES[entry]
    with manager(store_dir) as ckpt:
        ckpt.save(make_state(1), 1)
        with pytest.raises(BaseException) as raised:  # (DCP's CheckpointException is one)
            SAVES[how](ckpt, with_entry(2, where, make()), 2)
        err = failure(raised.value)
        assert isinstance(err, StateDictError), repr(raised.value)
        assert err.key == key and f"'{key}' {kind}" in str(err), str(err)
        assert "remove this one from the state dict" in str(err)
        if isinstance(raised.value, CheckpointException):  # what a dcp.save user reads
            assert key in str(raised.value)
        assert [e.step for e in ckpt.checkpoints()] == [1]
        assert not os.path.exists(internals(ckpt).store.paths.step_dir(2)) or internals(ckpt).store.inventory.step_state(2).committed_ranks == set()
    with manager(store_dir) as ckpt:
        out = zeros_like_state(make_state())
        assert ckpt.resume(out).step == 1
        assert_same(make_state(1), out)
