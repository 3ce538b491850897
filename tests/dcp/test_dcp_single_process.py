"""DCP adapters and CheckpointManager in one process (no process group)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import damage_shard, wait_for
from states import assert_same, clone_state, make_state, raw_bytes, zeros_like_state
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from mlcheckpoint import (
    CheckpointManager,
    CorruptShardError,
    MemoryStorageReader,
    MemoryStorageWriter,
    MLCheckpointError,
    ResumeInfo,
)
from mlcheckpoint.store import LocalStore
from mlcheckpoint.testing import internals

JOB = "job-dcp"

# DCP warns that it assumes a single process when no process group is initialised.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def dirs(store_dir):
    """(local_dir, persistent_dir), both removed with store_dir."""
    return os.path.join(store_dir, "local"), os.path.join(store_dir, "persistent")


def load(step: int, store: LocalStore, template=None):
    out = zeros_like_state(template if template is not None else make_state())
    dcp.load(out, storage_reader=MemoryStorageReader(step, store))
    return out


def failures(e: CheckpointException) -> list[BaseException]:
    return [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]


def item_of(store: LocalStore, step: int, key: str):
    m = store.shards.read_manifest(step, 0)
    return next(it for it in m.items if it.key == key or it.key.startswith(key + "@"))


# ---------------------------------------------------------------- save / load

def test_save_load_round_trip_bit_exact(store):
    sd = make_state(1)
    expected = clone_state(sd)
    dcp.save(sd, storage_writer=MemoryStorageWriter(5, store))
    assert store.inventory.complete_steps() == [5]
    out = load(5, store, sd)
    assert_same(expected, out)
    assert_same(expected, sd)  # saving left the source alone


def test_load_into_non_contiguous_destinations(store):
    sd = {"t": torch.randn(6, 4).t(), "s": torch.arange(40, dtype=torch.float32)[::4]}
    dcp.save(sd, storage_writer=MemoryStorageWriter(1, store))
    base_t, base_s = torch.zeros(6, 4), torch.zeros(40)
    out = {"t": base_t.t(), "s": base_s[::4]}
    dcp.load(out, storage_reader=MemoryStorageReader(1, store))
    assert torch.equal(base_t.t(), sd["t"])
    assert torch.equal(base_s[::4], sd["s"])
    assert base_s[1::4].abs().sum() == 0  # only the strided elements were written


def test_async_save_round_trip_and_snapshot_semantics(store):
    sd = make_state(2)
    expected = clone_state(sd)
    fut = dcp.async_save(sd, storage_writer=MemoryStorageWriter(8, store))
    # training goes on right away: none of this may reach the checkpoint
    for t in (sd["model"]["f32"], sd["model"]["bf16"], sd["i64"], sd["c64"], sd["transposed"]):
        t.fill_(0)
    sd["mask"].logical_not_()
    sd["extra"]["hist"].append("later")
    sd["extra"]["nested"]["deep"]["k"][0] = -1
    fut.result(timeout=60)
    assert store.inventory.complete_steps() == [8]
    out = load(8, store, expected)
    assert_same(expected, out)


def test_async_save_snapshots_mutable_non_tensor_leaves(store):
    sd = {"w": torch.ones(3), "buf": bytearray(b"abc"), "ids": {1, 2}}
    fut = dcp.async_save(sd, storage_writer=MemoryStorageWriter(1, store))
    sd["buf"][0] = ord("z")
    sd["ids"].add(3)
    fut.result(timeout=60)
    out = {"w": torch.zeros(3), "buf": None, "ids": None}
    dcp.load(out, storage_reader=MemoryStorageReader(1, store))
    assert out["buf"] == bytearray(b"abc") and out["ids"] == {1, 2}


def test_sync_and_async_save_store_identical_tensor_bytes(store):
    sd = make_state(3)
    dcp.save(sd, storage_writer=MemoryStorageWriter(1, store))
    dcp.async_save(sd, storage_writer=MemoryStorageWriter(2, store)).result(timeout=60)
    a, b = load(1, store, sd), load(2, store, sd)
    assert_same(a, b)
    assert_same(sd, b)


def test_staging_checksums_the_source_and_the_commit_trusts_it(store, monkeypatch):
    """``stage`` takes each contiguous tensor's checksum while copying it, so the commit in
    the background reads none of the staged bytes again; and because the checksum is the
    source's, a staged byte that changes before the commit is caught by the next load."""
    from mlcheckpoint.integrity import copier
    sd = {"w": torch.randn(300, 300), "b": torch.randn(1000).to(torch.bfloat16), "step": 4}
    w = MemoryStorageWriter(6, store)
    staged = w.stage(sd)
    hashed = []
    real = copier.process
    monkeypatch.setattr(copier, "process", lambda spans, *a, **k: hashed.extend(spans) or real(spans, *a, **k))
    staged["w"][7, 7] += 1.0  # a stray write into the staged buffer before the commit
    dcp.save(staged, storage_writer=w)
    assert sum(s.nbytes for s in hashed) == 0
    out = {"w": torch.zeros(300, 300), "b": torch.zeros(1000, dtype=torch.bfloat16), "step": 0}
    with pytest.raises(CheckpointException) as ei:
        dcp.load(out, storage_reader=MemoryStorageReader(6, store))
    assert "'w'" in str(ei.value)


def test_tensor_bytes_are_stored_raw(store):
    w = torch.randn(64, 32)
    h = torch.arange(100, dtype=torch.int16).reshape(10, 10).t()  # non-contiguous source
    dcp.save({"w": w, "h": h, "step": 3}, storage_writer=MemoryStorageWriter(1, store))
    with open(store.paths.data(1, 0), "rb") as f:
        data = f.read()
    _, payload = store.metadata.read(1)
    locations = {idx.fqn: loc for idx, loc in pickle.loads(payload).storage_data.items()}
    for fqn, t in (("w", w), ("h", h)):
        it = item_of(store, 1, fqn)
        want = raw_bytes(t)
        assert it.kind == "tensor" and it.nbytes == len(want)
        assert data[it.offset:it.offset + it.nbytes] == want
        assert data.find(want) == it.offset
        assert it.dtype == str(t.dtype).removeprefix("torch.") and it.shape == list(t.shape)
        loc = locations[fqn]
        assert (loc.rank, loc.offset, loc.nbytes, loc.checksum) == (0, it.offset, it.nbytes, it.checksum)
    assert item_of(store, 1, "step").kind == "bytes"


@pytest.mark.parametrize("mode", ["save", "async_save"])
@pytest.mark.parametrize("target", ["tensor", "after_empty", "bytes"])
def test_flipped_byte_fails_load(store, mode, target):
    sd = {"empty": torch.empty(0), "w": torch.randn(1000), "meta": {"note": "x" * 50}}
    writer = MemoryStorageWriter(1, store)
    if mode == "save":
        dcp.save(sd, storage_writer=writer)
    else:
        dcp.async_save(sd, storage_writer=writer).result(timeout=60)
    damage_shard(store, 1, 0, item="meta.note" if target == "bytes" else "w")
    out = {"empty": torch.empty(0), "w": torch.zeros(1000), "meta": {"note": None}}
    with pytest.raises(CheckpointException) as ei:
        dcp.load(out, storage_reader=MemoryStorageReader(1, store))
    errs = failures(ei.value)
    assert errs and all(isinstance(e, CorruptShardError) for e in errs), errs
    assert "checksum mismatch" in str(errs[0])
    # loading is not transactional (good items may have landed), but a bad value never does
    assert out["meta"]["note"] in (None, "x" * 50)
    if target == "bytes":
        assert out["meta"]["note"] is None


@pytest.mark.parametrize("dest", ["transposed", "other_dtype"])
def test_flipped_byte_fails_load_into_any_destination(store, dest):
    """Destinations that take the copy path (not the fused hash-and-copy) are verified too."""
    m = torch.randn(30, 40)
    dcp.save({"m": m}, storage_writer=MemoryStorageWriter(1, store))
    damage_shard(store, 1, 0, item="m", at=7)
    target = torch.zeros(40, 30).t() if dest == "transposed" else torch.zeros(30, 40, dtype=torch.float64)
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"m": target}, storage_reader=MemoryStorageReader(1, store))
    assert all(isinstance(e, CorruptShardError) for e in failures(ei.value))
    assert target.abs().sum() == 0  # nothing was copied from the bad chunk


def test_truncated_shard_fails_load(store):
    dcp.save({"w": torch.randn(1000)}, storage_writer=MemoryStorageWriter(1, store))
    os.truncate(store.paths.data(1, 0), 100)
    fresh = LocalStore(store.local_dir, JOB)
    try:
        with pytest.raises(CheckpointException) as ei:
            dcp.load({"w": torch.zeros(1000)}, storage_reader=MemoryStorageReader(1, fresh))
        assert any(isinstance(e, CorruptShardError) for e in failures(ei.value))
    finally:
        fresh.close()


def test_load_of_missing_step_fails(store):
    with pytest.raises(BaseException) as ei:
        dcp.load({"w": torch.zeros(3)}, storage_reader=MemoryStorageReader(4, store))
    assert "step 4" in str(ei.value)


def test_resaving_a_step_replaces_it(store):
    dcp.save(make_state(1), storage_writer=MemoryStorageWriter(4, store))
    dcp.async_save(make_state(2), storage_writer=MemoryStorageWriter(4, store)).result(timeout=60)
    assert_same(make_state(2), load(4, store))
    assert sorted(os.listdir(store.paths.step_dir(4))) == ["metadata", "rank-00000.data",
                                                     "rank-00000.manifest"]
    dcp.save(make_state(3), storage_writer=MemoryStorageWriter(4, store))
    assert_same(make_state(3), load(4, store))
    assert store.inventory.complete_steps() == [4]


def test_writer_and_reader_from_job_id_and_local_dir(store):
    sd = {"a": torch.arange(6, dtype=torch.int16)}
    dcp.save(sd, storage_writer=MemoryStorageWriter(2, job_id=JOB, local_dir=store.local_dir))
    assert store.inventory.complete_steps() == [2]
    out = {"a": torch.zeros(6, dtype=torch.int16)}
    dcp.load(out, storage_reader=MemoryStorageReader("mlcheckpoint://job-dcp/2", job_id=JOB,
                                                     local_dir=store.local_dir))
    assert torch.equal(out["a"], sd["a"])


def test_writer_and_reader_pickle(store):
    w = MemoryStorageWriter(12, store)
    w2 = pickle.loads(pickle.dumps(w))
    assert w2.step == 12 and w2.store.job_dir == store.job_dir
    assert w2.checkpoint_id == w.checkpoint_id
    sd = {"a": torch.arange(10.0), "n": 1}
    dcp.save(sd, storage_writer=w2)
    r2 = pickle.loads(pickle.dumps(MemoryStorageReader(12, store)))
    out = {"a": torch.zeros(10), "n": 0}
    dcp.load(out, storage_reader=r2)
    assert torch.equal(out["a"], sd["a"]) and out["n"] == 1


def test_staged_writer_survives_pickling(store):
    """PROCESS mode: stage() in the trainer, the pickled writer finishes in another process."""
    sd = make_state(4)
    expected = clone_state(sd)
    w = MemoryStorageWriter(3, store)
    staged = w.stage(sd)
    w2 = pickle.loads(pickle.dumps(w))
    dcp.save(staged, storage_writer=w2)
    assert store.inventory.complete_steps() == [3]
    assert_same(expected, load(3, store, sd))
    assert store.gc() == []


def _as_sent_to_another_process(staged, buffer: torch.Tensor):
    """What DCP's PROCESS mode hands its checkpoint process: the staged views, re-pointed at
    one copy of their whole storage (torch multiprocessing moves it into its own shared
    memory), each at its old offset."""
    copy = buffer.clone()

    def repoint(t):
        if isinstance(t, torch.Tensor):
            off = t.storage_offset() * t.element_size()
            n = t.numel() * t.element_size()
            return copy[off:off + n].view(t.dtype).view(t.shape)
        if isinstance(t, dict):
            return {k: repoint(v) for k, v in t.items()}
        return t

    return repoint(staged), copy


@pytest.mark.parametrize("diverge", [False, True])
def test_process_mode_writes_each_tensor_once(store, caplog, diverge):
    """The checkpoint process recognises the staged views' copies and only hashes the staged
    bytes (no second copy of every tensor in the shard); a copy whose bytes differ from the
    staged ones is written from what was sent, with a warning."""
    sd = {"w": torch.randn(64, 64), "b": torch.randn(100).to(torch.bfloat16), "note": "hi"}
    w = MemoryStorageWriter(5, store)
    staged = w.stage(sd)
    assert w.staged is not None and w.staged.shard is not None
    staged_bytes = w.staged.nbytes
    sent, _ = _as_sent_to_another_process(staged, w.staged.shard.buffer.tensor)
    if diverge:
        sent["w"][0, 0] += 1.0  # the copy no longer matches the staged region
    w2 = pickle.loads(pickle.dumps(w))
    with caplog.at_level("WARNING", logger="mlcheckpoint.dcp.writer"):
        dcp.save(sent, storage_writer=w2)
    m = store.shards.read_manifest(5, 0)
    tensors = {i.key.split("@")[0]: i for i in m.items if i.kind == "tensor"}
    assert tensors["b"].offset + tensors["b"].nbytes <= staged_bytes  # stored once, in place
    if diverge:  # written anew after the staged region, which is left as it was
        assert tensors["w"].offset >= staged_bytes
        assert m.data_bytes < staged_bytes + tensors["w"].nbytes + 4096
    else:
        assert tensors["w"].offset + tensors["w"].nbytes <= staged_bytes
        assert m.data_bytes < staged_bytes + 4096  # only the byte item follows
    out = {"w": torch.zeros(64, 64), "b": torch.zeros(100, dtype=torch.bfloat16), "note": None}
    dcp.load(out, storage_reader=MemoryStorageReader(5, store))
    assert torch.equal(out["w"], sent["w"]) and torch.equal(out["b"], sent["b"])
    assert out["note"] == "hi"
    assert ("differ from the tensor DCP sent" in caplog.text) == diverge


def test_writer_says_what_it_committed(store):
    """What the manager's publish path reads after a DCP-native save: this rank's manifest
    and save id, and on the coordinator the metadata it committed."""
    w = MemoryStorageWriter(2, store)
    returned = dcp.save({"a": torch.ones(3)}, storage_writer=w)
    assert w.committed is not None and w.committed.step == 2
    assert [i.nbytes for i in w.committed.items] == [12]
    assert w.save_id and w.committed.save_id == w.save_id
    assert w.metadata is returned


def test_closing_unused_staged_writer_leaves_nothing_visible(store):
    w = MemoryStorageWriter(1, store)
    w.stage({"a": torch.ones(100)})
    w.close()
    assert 1 not in store.inventory.all()  # no trace, not even an empty step folder
    assert store.gc() == []


# ---------------------------------------------------------------- CheckpointManager

def manager(dirs, persistent=False, **kw) -> CheckpointManager:
    local, pers = dirs
    return CheckpointManager(pers if persistent else None, job_id=JOB, local_dir=local,
                             replication="none", **kw)


def test_manager_save_list_resume(dirs):
    with manager(dirs, keep=3) as ckpt:
        states = {s: make_state(s) for s in (1, 2, 3)}
        r = ckpt.save(states[1], 1)
        assert r.step == 1 and r.bytes > 0 and not r.persistent
        r = ckpt.async_save(states[2], 2).result(timeout=60)
        assert r.step == 2 and r.bytes > 0
        fut = ckpt.async_save(states[3], 3)
        ckpt.wait()
        assert fut.done() and fut.result().step == 3
        entries = ckpt.checkpoints()
        assert [(e.step, e.location, e.state) for e in entries] == \
            [(s, "memory", "complete") for s in (1, 2, 3)]
        assert all(e.ranks == [0] and e.bytes for e in entries)

    with manager(dirs, keep=3) as ckpt:  # a restarted job
        out = zeros_like_state(states[3])
        info = ckpt.resume(out)
        assert isinstance(info, ResumeInfo)
        assert (info.step, info.source, info.reason) == (3, "local", None)
        assert info.sources == {0: "local"}
        assert_same(states[3], out)


def test_manager_resume_falls_back_past_corrupt_step(dirs):
    with manager(dirs, keep=3) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(make_state(s), s)
        damage_shard(internals(ckpt).store, 3, 0, item="model.f32", at=5)
        out = zeros_like_state(make_state())
        info = ckpt.resume(out)
        assert (info.step, info.source) == (2, "local")
        assert "step 3" in info.reason and "checksum" in info.reason
        assert_same(make_state(2), out)


def test_manager_resume_fresh_start(dirs):
    with manager(dirs, persistent=True) as ckpt:
        out = zeros_like_state(make_state())
        info = ckpt.resume(out)
        assert info.step is None and info.source is None
        assert out["model"]["f32"].abs().sum() == 0
        assert ckpt.checkpoints() == []


def test_manager_persistent_save_is_stock_dcp(dirs):
    _, pers = dirs
    sd = make_state(7)
    with manager(dirs, persistent=True) as ckpt:
        r = ckpt.save(sd, 7, persistent=True)
        assert r.persistent
        path = os.path.join(pers, f"step-{7:012d}")
        assert os.path.exists(os.path.join(path, ".metadata"))
        assert ("persistent", 7) in {(e.location, e.step) for e in ckpt.checkpoints()}
    out = zeros_like_state(sd)
    dcp.load(out, storage_reader=FileSystemReader(path))
    assert_same(sd, out)


def test_manager_async_persistent_save(dirs):
    _, pers = dirs
    sd = make_state(8)
    expected = clone_state(sd)
    with manager(dirs, persistent=True) as ckpt:
        ckpt.async_save(sd, 8, persistent=True)
        sd["model"]["f32"].fill_(1)  # after staging: must not reach either copy
        ckpt.wait()
    out = zeros_like_state(expected)
    dcp.load(out, storage_reader=FileSystemReader(os.path.join(pers, f"step-{8:012d}")))
    assert_same(expected, out)


def test_manager_wait_raises_a_failed_background_persistent_write(dirs):
    _, pers = dirs
    os.makedirs(pers)
    with open(os.path.join(pers, f"step-{9:012d}"), "w"):  # a file where the step's folder goes
        pass
    with manager(dirs, persistent=True, keep=1) as ckpt:
        assert ckpt.async_save(make_state(9), 9, persistent=True).result(timeout=60).persistent
        with pytest.raises((MLCheckpointError, OSError)):
            ckpt.wait()  # the write of step 9 failed: wait says so
        ckpt.wait()  # raised once
        assert internals(ckpt).pins.steps() == set()  # the failed write gave its step back
        ckpt.save(make_state(10), 10)
        assert [e.step for e in ckpt.checkpoints()] == [10]


def test_a_failing_close_unpins_the_persistent_writes_it_cancels(dirs, monkeypatch, tmp_path):
    """close after an error cancels the queued background persistent writes and gives their
    steps back to retention; the write already running keeps its step until it ends."""
    release = tmp_path / "release"
    monkeypatch.setenv("MLCHECKPOINT_PAUSE_AT", f"persistent_write@1={release}")
    ckpt = manager(dirs, persistent=True, keep=1)
    try:
        for step in (1, 2, 3):
            assert ckpt.async_save(make_state(step), step, persistent=True).result(timeout=60).persistent
        wait_for(lambda: os.path.exists(f"{release}.reached"), "step 1's persistent write to start")
        assert internals(ckpt).pins.steps() == {1, 2, 3}
        ckpt.close(failed=True)
        assert internals(ckpt).pins.steps() == {1}
    finally:
        release.touch()
        ckpt.close(failed=True)  # (idempotent) on a failure above, nothing is left queued
        # The running write ends before the fixture removes the folders it writes into.
        wait_for(lambda: internals(ckpt).pins.steps() == set(), "the running write to end")
    assert os.path.exists(os.path.join(dirs[1], f"step-{1:012d}", ".metadata"))
    assert not os.path.exists(os.path.join(dirs[1], f"step-{2:012d}"))


def test_manager_retention_keeps_newest(dirs):
    with manager(dirs, keep=2) as ckpt:
        for s in range(1, 7):
            if s % 2:
                ckpt.save(make_state(s), s)
            else:
                ckpt.async_save(make_state(s), s)
        ckpt.wait()
        mem = [e.step for e in ckpt.checkpoints() if e.location == "memory"]
        assert mem == [5, 6]
        assert internals(ckpt).store.inventory.complete_steps() == [5, 6]
        pooled = os.listdir(internals(ckpt).store.pool_dir)
        assert 1 <= len(pooled) <= 2


def test_save_result_phases_add_up_to_seconds(dirs):
    """Every kind of save reports its phases: "stage" + "commit" is ``seconds`` (until
    committed on every rank) and "publish" comes after it."""
    with manager(dirs) as ckpt:
        results = [ckpt.save(make_state(1), 1),
                   ckpt.async_save(make_state(2), 2).result(timeout=60),
                   ckpt.async_save(make_state(3), 3, overlap=True).result(timeout=60)]
    assert results[2].overlapped_bytes > 0  # the third one staged on the staging thread
    for r in results:
        assert set(r.phases) == {"stage", "commit", "publish"}, r
        assert all(seconds >= 0 for seconds in r.phases.values()), r
        assert r.phases["stage"] > 0, r  # bytes were copied
        assert r.phases["stage"] + r.phases["commit"] == pytest.approx(r.seconds, abs=1e-6), r
        assert r.blocking_seconds <= r.seconds, r


def test_manager_close_is_idempotent(dirs):
    ckpt = manager(dirs)
    ckpt.save({"a": torch.ones(4)}, 1)
    ckpt.close()
    ckpt.close()
    with pytest.raises(Exception, match="closed"):
        ckpt.save({"a": torch.ones(4)}, 2)
    with manager(dirs) as again:
        assert [e.step for e in again.checkpoints()] == [1]
    again.close()  # after __exit__: still fine


def test_manager_storage_writer_and_reader(dirs):
    sd = make_state(9)
    with manager(dirs) as ckpt:
        dcp.save(sd, storage_writer=ckpt.storage_writer(9))
        out = zeros_like_state(sd)
        dcp.load(out, storage_reader=ckpt.storage_reader(9))
        assert_same(sd, out)
