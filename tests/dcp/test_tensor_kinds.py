"""The DCP contract, row by row: every kind of state (tests/workers/tensor_kinds.py) saved and
loaded with DCP's FileSystemWriter/Reader and with ours, on every save path, must load the
same values: tensor subclasses (torchao's float8 FSDP weight, int8/int4/float8 weight-only and
NF4 tensors, a wrapper subclass of our own), every dtype torch has, views, tied and expanded
tensors, channels_last, quantized tensors and nested non-tensor values.

Where DCP loads a row exactly, ours must load exactly the same; where DCP itself cannot
round-trip a row, ours must either load it exactly or fail, never load something else. The
asynchronous paths change every tensor right after the call returns (as training does): the
checkpoint must hold the state at the call, or under ``guard``, at the optimizer step.
Rows whose library is missing (or whose torchao config this CPU build cannot run) are skipped
with the reason. The same rows under FSDP2 on several ranks: tests/jobs/test_subclass_fsdp.py.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import damage_shard
from states import differences
from tensor_kinds import (
    ROWS,
    SUBCLASS_ROWS,
    Mutating,
    ScaledTensor,
    Unavailable,
    build,
    contents,
    mutate,
)
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from mlcheckpoint import (
    CheckpointManager,
    CorruptShardError,
    MemoryStorageReader,
    MemoryStorageWriter,
    MLCheckpointError,
)

JOB = "job-kinds"
PATHS = ["save", "async_save", "guard_async_save", "dcp_save", "dcp_async_save"]

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled",
                                        "ignore:ComplexHalf support is experimental")


def source_or_skip(row: str, seed: int = 0, template: bool = False) -> dict:
    try:
        return build(row, seed, template)
    except Unavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def dcp_results():
    """What DCP's FileSystemWriter/Reader load for each row (computed once per row):
    ``contents`` of the loaded template, or the error DCP raised."""
    root = tempfile.mkdtemp(prefix="mlckpt-test-fs-", dir="/dev/shm")
    done: dict[str, tuple[str, object]] = {}

    def result(row: str) -> tuple[str, object]:
        if row not in done:
            path = os.path.join(root, row)
            try:
                dcp.save(build(row, 0), storage_writer=FileSystemWriter(path), no_dist=True)
                out = build(row, 1, template=True)
                dcp.load(out, storage_reader=FileSystemReader(path), no_dist=True)
                done[row] = ("loaded", contents(out))
            except (Exception, CheckpointException) as e:  # noqa: BLE001 (DCP's verdict, kept)
                done[row] = ("error", repr(e)[-500:])
        return done[row]

    try:
        yield result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _plain_leaves(sd) -> list[torch.Tensor]:
    out, seen = [], set()
    for t in _tensors(sd):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    return [t for v in x for t in _tensors(v)] if isinstance(x, (list, tuple)) else []


def _not_plain(t: torch.Tensor) -> bool:
    return type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_quantized


def save_with_ours(path: str, sd: dict, ckpt: CheckpointManager) -> None:
    """Step 1 of ``sd`` through one of our save paths; the asynchronous ones change every
    tensor of ``sd`` once the call returned."""
    if path == "save":
        ckpt.save(sd, 1)
    elif path == "async_save":
        ckpt.async_save(sd, 1)
        mutate(sd)
        ckpt.wait()
    elif path == "guard_async_save":
        # Every tensor is the optimizer's: plain ones may be copied until its step; the others
        # are taken at the call, so changing them right away must not reach the checkpoint.
        opt = Mutating(_plain_leaves(sd)) if _tensors(sd) else None
        with ckpt.guard(opt) if opt is not None else _nothing():
            ckpt.async_save(sd, 1)
            mutate([t for t in _tensors(sd) if _not_plain(t)])
            if opt is not None:
                opt.step()
            ckpt.wait()
    elif path == "dcp_save":
        dcp.save(sd, storage_writer=ckpt.storage_writer(1))
    elif path == "dcp_async_save":
        fut = dcp.async_save(sd, storage_writer=ckpt.storage_writer(1))
        mutate(sd)
        fut.result()
    else:
        raise AssertionError(path)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def ours(row: str, path: str, local_dir: str) -> tuple[str, object]:
    """What a restarted job resumes after saving ``row`` through ``path``."""
    sd = build(row, 0)
    try:
        ckpt = CheckpointManager(job_id=JOB, local_dir=local_dir, replication="none")
        try:
            save_with_ours(path, sd, ckpt)
        finally:
            ckpt.close()
        out = build(row, 1, template=True)
        ckpt = CheckpointManager(job_id=JOB, local_dir=local_dir, replication="none")
        try:
            info = ckpt.resume(out)
        finally:
            ckpt.close()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 (compared with DCP's verdict)
        return "error", repr(e)[-800:]
    if info.step is None:  # the save failed (its future said so)
        return "error", f"nothing to resume: {info.reason}"
    assert info.step == 1, info
    return "loaded", contents(out)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("row", list(ROWS))
def test_round_trip_as_dcp_does(row, path, store_dir, dcp_results):
    expected = contents(source_or_skip(row, 0))
    verdict, theirs = dcp_results(row)
    got, mine = ours(row, path, store_dir)
    if verdict == "loaded":
        assert got == "loaded", f"DCP loads {row}, ours failed: {mine}"
        assert mine == theirs, differences(theirs, mine)
    else:  # DCP cannot: ours fails too, or loads exactly what was saved
        assert got == "error" or mine == expected, (theirs, differences(expected, mine))


@pytest.mark.parametrize("row", SUBCLASS_ROWS)
def test_dcp_loads_the_subclass_rows_exactly(row, dcp_results):
    """The subclass rows are ones DCP round-trips exactly (so the table holds ours to it)."""
    expected = contents(source_or_skip(row, 0))
    verdict, theirs = dcp_results(row)
    assert verdict == "loaded" and theirs == expected, theirs


def test_subclass_is_stored_as_dcp_stores_it_and_checksummed(store):
    """A subclass's item holds the bytes DCP's FileSystemWriter writes (torch.save of it) and a
    flipped byte in them fails the load, like any other item."""
    sd = {"w": build("own_wrapper_subclass", 0)["w"]}
    dcp.save(sd, storage_writer=MemoryStorageWriter(1, store))
    item = next(it for it in store.shards.read_manifest(1, 0).items if it.key.split("@")[0] == "w")
    with open(store.paths.data(1, 0), "rb") as f:
        f.seek(item.offset)
        stored = f.read(item.nbytes)
    loaded = torch.load(io.BytesIO(stored), weights_only=True)
    assert isinstance(loaded, ScaledTensor) and contents(loaded) == contents(sd["w"])
    damage_shard(store, 1, 0, item=item.key)
    out = {"w": build("own_wrapper_subclass", 1)["w"]}
    before = contents(out)
    with pytest.raises(CheckpointException) as ei:
        dcp.load(out, storage_reader=MemoryStorageReader(1, store))
    assert all(isinstance(f[0] if isinstance(f, tuple) else f, CorruptShardError)
               for f in ei.value.failures.values())
    assert contents(out) == before  # nothing loaded from the bad bytes


class Unpicklable(ScaledTensor):
    """A subclass torch.save cannot serialize (a local function in its state): DCP cannot
    save it either."""

    def __init__(self, data, scale, tag="scaled"):
        super().__init__(data, scale, tag)
        self.hook = lambda: None


@pytest.mark.parametrize("path", PATHS)
def test_tensor_dcp_cannot_save_gets_a_clear_error(path, store_dir):
    """The error names the key and the type and says what to do; the step is not committed
    and the one before is still resumed."""
    ckpt = CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none")
    try:
        ckpt.save({"model": {"w": torch.ones(3)}}, 1)
        bad = {"model": {"w": Unpicklable(torch.ones(3), torch.tensor(2.0))}}
        with pytest.raises((MLCheckpointError, CheckpointException)) as ei:
            if path == "dcp_save":
                dcp.save(bad, storage_writer=ckpt.storage_writer(2))
            elif path == "dcp_async_save":
                dcp.async_save(bad, storage_writer=ckpt.storage_writer(2)).result()
            else:
                _save_step(path, bad, ckpt)
        text = str(ei.value) + "".join(repr(f) for f in getattr(ei.value, "failures", {}).values())
        assert "model.w" in text and "Unpicklable" in text and "torch.save" in text, text
        assert [c.step for c in ckpt.checkpoints()] == [1]
    finally:
        ckpt.close()
    out = {"model": {"w": torch.zeros(3)}}
    resumer = CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none")
    try:
        assert resumer.resume(out).step == 1 and torch.equal(out["model"]["w"], torch.ones(3))
    finally:
        resumer.close()


def _save_step(path: str, sd: dict, ckpt: CheckpointManager) -> None:
    if path == "save":
        ckpt.save(sd, 2)
    elif path == "async_save":
        ckpt.async_save(sd, 2).result()
    else:
        with ckpt.guard(Mutating([torch.zeros(1)])):
            ckpt.async_save(sd, 2).result()

