"""LocalStore: commit protocol, verification, gc, the buffer pool, job isolation (retention
passes only as what pools buffers and removes set-aside steps; the rest in
tests/test_retention.py)."""

from __future__ import annotations

import gc
import json
import os
import pickle
import stat

import pytest
import torch
from helpers import (
    begin,
    flip_byte,
    payload,
    pool_files,
    put_metadata,
    put_shard,
    put_step,
)

from mlcheckpoint import CorruptShardError, ShardNotFoundError
from mlcheckpoint.integrity.checksum import checksum
from mlcheckpoint.manager.retention import apply_retention
from mlcheckpoint.store import LocalStore, layout
from mlcheckpoint.store.identity import Lineage
from mlcheckpoint.store.manifest import Manifest, ManifestItem

JOB = "job-store"


def read_data(store: LocalStore, step: int, rank: int) -> bytes:
    with open(store.paths.data(step, rank), "rb") as f:
        return f.read()


def step_files(store: LocalStore, step: int) -> set[str]:
    return set(os.listdir(store.paths.step_dir(step)))


# ---------------------------------------------------------------- commit protocol

def test_uncommitted_shard_is_invisible_until_commit(store):
    data = payload(7, 0)
    sw = begin(store, 7, 0, data)
    put_metadata(store, 7)  # even with the step's metadata present
    st = store.inventory.all()[7]
    assert st.committed_ranks == set()
    assert not st.complete
    assert store.inventory.complete_steps() == []
    with pytest.raises(ShardNotFoundError):
        store.shards.read_manifest(7, 0)
    assert os.path.exists(store.paths.data(7, 0) + layout.INFLIGHT)
    assert not os.path.exists(store.paths.data(7, 0))

    committed = sw.commit()
    st = store.inventory.all()[7]
    assert st.committed_ranks == {0}
    assert st.complete and st.required_ranks == (0,) and st.world_size == 1
    assert store.inventory.complete_steps() == [7]
    assert step_files(store, 7) == {"metadata", "rank-00000.data", "rank-00000.manifest"}
    assert read_data(store, 7, 0) == data
    # manifest round trip
    assert store.shards.read_manifest(7, 0) == committed
    assert committed.items[0] == ManifestItem("first", 0, 2048, checksum(data[:2048]),
                                              dtype="uint8", shape=[2048])
    assert store.verify_shard(7, 0) == committed


def test_step_needs_metadata_and_every_required_rank(store):
    put_shard(store, 3, 0)
    assert store.inventory.complete_steps() == []  # shard but no metadata
    put_metadata(store, 3, ranks=(0, 1))
    assert store.inventory.all()[3].required_ranks == (0, 1)
    assert store.inventory.complete_steps() == []  # rank 1 still missing
    put_shard(store, 3, 1)
    assert store.inventory.complete_steps() == [3]


def test_a_listing_gathered_at_resume_holds_nothing_the_garbage_collector_walks_per_rank(store):
    # A resume gathers every node's listing; the planner of a 16k-rank job holds thousands of
    # them. Held as lists, their rank lists made every full collection walk tens of millions of
    # references (the planner benchmark at 16k ranks went from 0.3 s to 1 s): the listing
    # keeps what grows with the job in tuples of ints, which the collector stops tracking.
    put_shard(store, 3, 0)
    put_metadata(store, 3, ranks=range(300))
    st = pickle.loads(pickle.dumps(store.inventory.all()[3]))  # as the all_gather hands it over
    gc.collect()
    assert st.required_ranks == tuple(range(300)) and not gc.is_tracked(st.required_ranks)
    assert st.has_metadata and not gc.is_tracked(st.ancestors)


def _rewrite_json(path: str, change, *, header_line: bool) -> None:
    """Rewrite the JSON of a manifest (the whole file) or of a metadata header (its first
    line, which the payload's checksum does not cover) with ``change`` applied."""
    with open(path, "rb") as f:
        raw = f.read()
    end = raw.index(b"\n") if header_line else len(raw)
    fields = json.loads(raw[:end])
    change(fields)
    with open(path, "wb") as f:
        f.write(json.dumps(fields).encode() + raw[end:])


@pytest.mark.parametrize("field, value", [
    ("ranks", 5), ("ranks", ["a"]), ("ranks", [True]), ("ranks", [-1]), ("ranks", [1]),
    ("ranks", {"0": 0}), ("world_size", "1"), ("world_size", 0), ("step", None),
    ("total_bytes", 1.5), ("created", "yesterday"), ("job_id", 7)])
def test_a_metadata_header_with_malformed_fields_on_disk_is_corrupt_not_a_crash(store, field, value):
    # The header line is outside the payload's checksum: a damaged or rewritten one must be
    # refused where every reader parses it (the listing the replicator polls, ls, a resume),
    # as a peer's is on the wire, not crash the listing (ranks=5 raised TypeError there) nor
    # be counted with ranks that are not ranks.
    put_shard(store, 3, 0)
    put_metadata(store, 3, ranks=(0,))
    _rewrite_json(store.paths.metadata(3), lambda h: h.update({field: value}), header_line=True)
    fresh = LocalStore(store.local_dir, store.job_id)  # (no header cached from before)
    st = fresh.inventory.step_state(3)
    assert not st.has_metadata and st.required_ranks is None and st.committed_ranks == {0}
    with pytest.raises(CorruptShardError, match="metadata of step 3 is corrupt"):
        fresh.metadata.read(3)
    assert fresh.inventory.complete_steps() == []


@pytest.mark.parametrize("where, field, value", [
    ("item", "checksum", "beef"), ("item", "offset", 0.0), ("item", "key", 5),
    ("item", "shape", "2048"), ("item", "shape", [1.5]), ("item", "dtype", 3),
    ("shard", "data_bytes", "4096"), ("shard", "world_size", None), ("shard", "created", [])])
def test_a_manifest_with_malformed_fields_on_disk_is_a_damaged_copy(store, where, field, value):
    # One check of a manifest's fields for a file and for a peer's: a committed shard whose
    # manifest is malformed is listed as damaged (the planner refuses that copy and reads
    # another), never as a shard whose items a reader would then trust.
    put_shard(store, 3, 0)
    put_metadata(store, 3, ranks=(0,))

    def change(m: dict) -> None:
        (m["items"][0] if where == "item" else m)[field] = value

    _rewrite_json(store.paths.manifest(3, 0), change, header_line=False)
    st = store.inventory.step_state(3)
    assert st.committed_ranks == set() and 0 in st.damaged and not st.complete
    with pytest.raises(CorruptShardError, match="unreadable manifest"):
        store.shards.read_manifest(3, 0)


def test_crash_between_data_and_manifest_rename_is_invisible(store):
    """What a crash at 'mid_commit' leaves: data renamed, manifest still .tmp."""
    put_step(store, 1)
    data = payload(1, 1)
    m = Manifest(job_id=JOB, step=1, rank=1, data_bytes=len(data),
                 items=[ManifestItem("x", 0, len(data), checksum(data))])
    with open(store.paths.data(1, 1), "wb") as f:
        f.write(data)
    with open(store.paths.manifest(1, 1) + layout.TMP, "wb") as f:
        f.write(m.to_bytes())
    assert store.inventory.all()[1].committed_ranks == {0}
    with pytest.raises(ShardNotFoundError):
        store.verify_shard(1, 1)


def test_manifest_bytes_round_trip():
    m = Manifest(job_id="j", step=12, rank=3, data_bytes=256, world_size=8, items=[
        ManifestItem("a@0,0", 0, 128, 2**64 - 1, "tensor", "bfloat16", [8, 8]),
        ManifestItem("b", 128, 100, 0, "bytes")])
    back = Manifest.from_bytes(m.to_bytes())
    assert back == m
    assert back.items[0].checksum == 2**64 - 1


def test_aborted_shard_leaves_no_visible_trace(store):
    sw = begin(store, 2, 0, payload(2, 0))
    sw.abort()
    assert not os.path.exists(sw.inflight_path)
    assert 2 not in store.inventory.all()  # not even an empty step folder is left
    assert len(pool_files(store)) == 1  # the buffer is kept for reuse


# ---------------------------------------------------------------- verification

def test_verify_shard_passes_on_good_data(store):
    put_step(store, 1)
    m = store.verify_shard(1, 0)
    assert [it.key for it in m.items] == ["first", "second"]
    # a second store instance (fresh mappings) agrees
    other = LocalStore(store.local_dir, JOB)
    try:
        assert other.verify_shard(1, 0) == m
    finally:
        other.close()


@pytest.mark.parametrize("offset,item", [(0, "first"), (2047, "first"), (2048, "second"), (4095, "second")])
def test_verify_shard_detects_flipped_byte(store, offset, item):
    put_step(store, 1)
    store.verify_shard(1, 0)  # mapped now: the flip must be seen through the cached mapping too
    flip_byte(store.paths.data(1, 0), offset)
    with pytest.raises(CorruptShardError, match=repr(item)):
        store.verify_shard(1, 0)
    fresh = LocalStore(store.local_dir, JOB)
    try:
        with pytest.raises(CorruptShardError):
            fresh.verify_shard(1, 0)
    finally:
        fresh.close()


def test_verify_shard_detects_truncated_data(store):
    put_step(store, 1)
    os.truncate(store.paths.data(1, 0), 1000)
    with pytest.raises(CorruptShardError, match="truncated"):
        store.verify_shard(1, 0)
    with pytest.raises(CorruptShardError):
        store.shards.map(1, 0)


def test_verify_shard_detects_missing_data(store):
    put_step(store, 1)
    os.unlink(store.paths.data(1, 0))
    with pytest.raises(CorruptShardError, match="missing"):
        store.verify_shard(1, 0)


@pytest.mark.parametrize("garble", [
    lambda raw: raw[: len(raw) // 2],                       # truncated JSON
    lambda raw: b"\xff\xfe" + raw[2:],                      # not UTF-8
    lambda raw: b"",                                        # empty file
    lambda raw: b"[]",                                      # JSON, but not an object
    lambda raw: b"null",
    lambda raw: b'"manifest"',
    lambda raw: raw.replace(b'"format":1', b'"format":99'),  # unknown format
    lambda raw: raw.replace(b'"items":[', b'"items":[{"bogus":1},'),
    lambda raw: raw.replace(b'"offset":2048', b'"offset":4000'),  # item outside the data
    lambda raw: raw.replace(b'"offset":2048', b'"offset":"x"'),
    lambda raw: raw.replace(b'"data_bytes":4096', b'"data_bytes":-1'),
], ids=["truncated", "utf8", "empty", "list", "null", "string", "format", "item", "range",
        "type", "negative"])
def test_garbled_manifest_raises_corrupt_shard(store, garble):
    put_step(store, 1)
    path = store.paths.manifest(1, 0)
    with open(path, "rb") as f:
        raw = f.read()
    bad = garble(raw)
    assert bad != raw
    with open(path, "wb") as f:
        f.write(bad)
    with pytest.raises(CorruptShardError):
        store.shards.read_manifest(1, 0)
    with pytest.raises(CorruptShardError):
        store.verify_shard(1, 0)


def test_manifest_of_another_step_is_refused(store):
    put_step(store, 1)
    put_step(store, 2)
    os.replace(store.paths.manifest(1, 0), store.paths.manifest(2, 0))
    with pytest.raises(CorruptShardError, match="names"):
        store.verify_shard(2, 0)


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "garbage", "empty"])
def test_corrupt_metadata_is_detected(store, damage):
    put_step(store, 4)
    put_step(store, 5)
    path = store.paths.metadata(5)
    size = os.path.getsize(path)
    if damage == "flip_payload":
        flip_byte(path, size - 2)
    elif damage == "flip_header":
        flip_byte(path, 2)
    elif damage == "truncate":
        os.truncate(path, size - 3)
    else:
        with open(path, "wb") as f:
            f.write(b"" if damage == "empty" else b"\x00garbage\nmore")
    with pytest.raises(CorruptShardError):
        store.metadata.read(5)
    st = store.inventory.step_state(5)
    assert not st.has_metadata and st.required_ranks is None and not st.complete
    assert st.committed_ranks == {0}
    assert store.inventory.complete_steps() == [4]
    _, good = store.metadata.read(4)
    assert good == b"meta-of-4"


def test_missing_metadata_is_not_found(store):
    put_shard(store, 1, 0)
    with pytest.raises(ShardNotFoundError):
        store.metadata.read(1)
    assert not store.inventory.step_state(1).has_metadata


def test_write_metadata_file_refuses_foreign_or_bad_content(store):
    put_step(store, 1)
    raw = store.metadata.read_file(1)
    with pytest.raises(CorruptShardError):
        store.metadata.write_file(2, raw)  # header names step 1
    with pytest.raises(CorruptShardError):
        store.metadata.write_file(1, raw[:-1])
    assert not os.path.exists(store.paths.metadata(2))
    store.metadata.write_file(1, raw)  # idempotent
    assert store.metadata.read_file(1) == raw


# ---------------------------------------------------------------- gc

def test_gc_removes_debris_and_keeps_committed(store):
    put_step(store, 1, ranks=(0, 1))
    put_step(store, 2, ranks=(0, 1))
    good = {r: read_data(store, 2, r) for r in (0, 1)}
    d2 = store.paths.step_dir(2)
    begin(store, 3, 0, payload(3, 0))  # in-flight shard: .data.inflight
    debris = [
        store.paths.data(3, 0) + layout.INFLIGHT,
        os.path.join(d2, "rank-00002.manifest" + layout.TMP),  # manifest never renamed
        os.path.join(d2, "metadata.0123abcd" + layout.TMP),     # metadata never renamed
        os.path.join(d2, "rank-00003.data"),                     # data without a manifest
    ]
    for p in debris[1:]:
        with open(p, "wb") as f:
            f.write(b"x" * 100)
    removed = store.gc()
    assert sorted(removed) == sorted(debris)
    for p in debris:
        assert not os.path.exists(p)
    assert step_files(store, 2) == {"metadata", "rank-00000.data", "rank-00000.manifest",
                                    "rank-00001.data", "rank-00001.manifest"}
    assert store.inventory.complete_steps() == [1, 2]
    for r in (0, 1):
        store.verify_shard(1, r)
        store.verify_shard(2, r)
        assert read_data(store, 2, r) == good[r]
    # data buffers went to the pool for reuse, the others were deleted
    owners = sorted(layout.parse_pool_name(os.path.basename(p)) for p in pool_files(store))
    assert owners == [0, 3]
    assert store.gc() == []  # nothing left


def test_gc_removes_in_flight_leftovers_named_as_earlier_versions_did(store):
    """In earlier versions a file in flight ended in ``.partial`` (the word now names a partial replica
    alone): what a crash left then is still in-flight debris to gc, in a step (a
    shard's buffer: pooled) and in the pool (a buffer being prepared: deleted)."""
    put_step(store, 1)
    legacy = [store.paths.data(1, 4) + layout.LEGACY_INFLIGHT,
              os.path.join(store.paths.step_dir(1), "rank-00004.manifest" + layout.LEGACY_INFLIGHT),
              store.paths.pool_buffer(5, "ab" * 8) + layout.LEGACY_INFLIGHT]
    for p in legacy:
        with open(p, "wb") as f:
            f.write(b"x" * 4096)
    assert sorted(store.gc()) == sorted(legacy)
    assert not any(os.path.exists(p) for p in legacy)
    assert [layout.parse_pool_name(os.path.basename(p)) for p in pool_files(store)] == [4]
    assert store.inventory.complete_steps() == [1] and store.gc() == []


def test_gc_limited_to_ranks_and_spares_young_files(store):
    put_step(store, 1, ranks=(0, 1))
    begin(store, 2, 0, payload(2, 0))
    begin(store, 2, 1, payload(2, 1))
    p0 = store.paths.data(2, 0) + layout.INFLIGHT
    p1 = store.paths.data(2, 1) + layout.INFLIGHT
    assert store.gc(min_age_s=3600) == []  # both too young
    assert store.gc(ranks=[1]) == [p1]
    assert os.path.exists(p0) and not os.path.exists(p1)
    assert store.inventory.complete_steps() == [1]


def test_gc_removes_orphan_metadata_of_old_incomplete_steps(store):
    put_metadata(store, 1)  # a step whose shards never got committed
    put_step(store, 2)
    put_metadata(store, 3)  # newer than the newest complete step: maybe in flight, kept
    store.gc()
    assert store.inventory.steps() == [2, 3]
    assert store.inventory.complete_steps() == [2]


# ---------------------------------------------------------------- retention and pool

def test_begin_shard_reuses_pooled_buffer(store):
    put_step(store, 1)
    put_step(store, 2)
    ino1 = os.stat(store.paths.data(1, 0)).st_ino
    apply_retention(store, [0], keep=1)
    assert [os.stat(p).st_ino for p in pool_files(store)] == [ino1]

    data = payload(3, 0)
    sw = begin(store, 3, 0, data)
    assert os.stat(sw.inflight_path).st_ino == ino1
    assert pool_files(store) == []
    sw.commit()
    put_metadata(store, 3)
    assert os.stat(store.paths.data(3, 0)).st_ino == ino1
    assert read_data(store, 3, 0) == data
    store.verify_shard(3, 0)
    assert store.inventory.complete_steps() == [2, 3]


@pytest.mark.parametrize("nbytes", [1024, 16384])
def test_pooled_buffer_of_other_size_is_reused_correctly(store, nbytes):
    put_step(store, 1)
    ino1 = os.stat(store.paths.data(1, 0)).st_ino
    store.shards.retire(1, 0)
    data = payload(2, 0, nbytes)
    sw = begin(store, 2, 0, data)
    assert os.stat(sw.inflight_path).st_ino == ino1
    sw.commit()
    put_metadata(store, 2)
    assert read_data(store, 2, 0)[:nbytes] == data
    assert os.path.getsize(store.paths.data(2, 0)) >= nbytes
    store.verify_shard(2, 0)
    fresh = LocalStore(store.local_dir, JOB)
    try:
        fresh.verify_shard(2, 0)
    finally:
        fresh.close()


def test_pool_prefers_own_rank(store):
    put_step(store, 1, ranks=(0, 1))
    ino = {r: os.stat(store.paths.data(1, r)).st_ino for r in (0, 1)}
    store.shards.retire(1, 0)
    store.shards.retire(1, 1)
    sw = begin(store, 2, 1, payload(2, 1))
    assert os.stat(sw.inflight_path).st_ino == ino[1]
    sw.abort()


def test_retiring_a_steps_last_shard_keeps_its_metadata_when_asked(store):
    """A shard refused as damaged while other nodes hold its step: the node keeps the metadata
    to load the step from them (issue 38). Retention's retire takes the step with it."""
    put_step(store, 1)
    put_step(store, 2)
    store.shards.retire(1, 0, keep_metadata=True)
    st = store.inventory.step_state(1)
    assert st.has_metadata and not st.committed_ranks
    store.metadata.read(1)  # whole and verified
    store.shards.retire(2, 0)
    assert 2 not in store.inventory.steps()


# ---------------------------------------------------------------- jobs and permissions

def test_two_jobs_in_one_local_dir_are_isolated(store_dir):
    a = LocalStore(store_dir, "job-a")
    b = LocalStore(store_dir, "job-b")
    try:
        for s in (1, 2, 3):
            put_step(a, s)
        for s in (2, 5):
            put_step(b, s)
        begin(b, 6, 0, payload(6, 0))  # b's in-flight shard
        b_inflight = b.paths.data(6, 0) + layout.INFLIGHT
        assert a.inventory.complete_steps() == [1, 2, 3]
        assert b.inventory.complete_steps() == [2, 5]
        assert b.inventory.steps() == [2, 5, 6]

        assert a.gc() == []
        assert os.path.exists(b_inflight)
        apply_retention(a, [0], keep=1)
        assert a.inventory.complete_steps() == [3]
        assert b.inventory.complete_steps() == [2, 5]
        assert os.listdir(b.pool_dir) == []
        a.destroy()
        assert not os.path.exists(a.job_dir)
        assert a.inventory.complete_steps() == []
        assert b.inventory.complete_steps() == [2, 5]
        for s in (2, 5):
            b.verify_shard(s, 0)
        assert os.path.exists(b_inflight)
    finally:
        a.close()
        b.close()


def test_job_dir_permissions(store_dir):
    old = os.umask(0)
    try:
        job_dir = os.path.join(store_dir, "perm-job")
        os.makedirs(job_dir, mode=0o755)
        os.chmod(job_dir, 0o755)  # pre-existing and too open: tightened
        s = LocalStore(store_dir, "perm-job")
        try:
            put_step(s, 1)
            assert stat.S_IMODE(os.stat(s.job_dir).st_mode) == 0o700
            for d in (s.steps_dir, s.pool_dir, s.paths.step_dir(1)):
                assert stat.S_IMODE(os.stat(d).st_mode) & 0o077 == 0, d
            for name in os.listdir(s.paths.step_dir(1)):
                mode = stat.S_IMODE(os.stat(os.path.join(s.paths.step_dir(1), name)).st_mode)
                assert mode & 0o077 == 0, (name, oct(mode))
        finally:
            s.close()
    finally:
        os.umask(old)


def test_resaving_committed_step_replaces_it(store):
    put_step(store, 1)
    old = read_data(store, 1, 0)
    new = payload(99, 0)
    sw = begin(store, 1, 0, new)
    # while the new shard is in flight the old one is still committed and valid
    assert store.inventory.complete_steps() == [1]
    assert read_data(store, 1, 0) == old
    store.verify_shard(1, 0)
    sw.commit()
    put_metadata(store, 1)
    assert read_data(store, 1, 0) == new
    m = store.verify_shard(1, 0)
    assert m.items[0].checksum == checksum(new[:2048])
    assert step_files(store, 1) == {"metadata", "rank-00000.data", "rank-00000.manifest"}
    assert store.inventory.complete_steps() == [1]
    assert store.gc() == []


def test_buffer_tensor_points_at_the_mapping_after_torch_moves_its_storage(store_dir):
    """DCP's PROCESS mode hands staged views to its checkpoint process with torch
    multiprocessing, which moves their storage into new shared memory. The next save staged
    into the same (cached, recycled) buffer must still land in the tmpfs file."""
    from mlcheckpoint.store.buffers import MappedFile
    path = os.path.join(store_dir, "buf")
    with open(path, "wb") as f:
        f.truncate(4096)
    mf = MappedFile(path, 4096)
    try:
        mf.tensor[100:200].share_memory_()  # what sending a staged view to a process does
        assert mf.tensor.data_ptr() == mf.base_ptr
        mf.tensor[:4].copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
        with open(path, "rb") as f:
            assert f.read(4) == bytes([1, 2, 3, 4])
    finally:
        mf.release()


# ---------------------------------------------------------------------------- settling after a resume
def put_save(store: LocalStore, step: int, run: str, ranks=(0, 1)) -> None:
    """A step of run ``run``: shards and metadata naming one save id."""
    save = f"{run}-{step}"
    for r in ranks:
        begin(store, step, r, payload(step, r)).commit(save_id=save, run_id=run)
    store.metadata.write(step, f"meta-of-{step}".encode(), world_size=len(ranks), ranks=ranks,
                         total_bytes=4096 * len(ranks), save_id=save, lineage=Lineage(run))


def test_settle_keeps_history_drops_other_runs_and_sets_complete_newer_steps_aside(store):
    put_save(store, 1, "A")
    put_save(store, 2, "A")
    put_save(store, 3, "A")
    put_save(store, 4, "A")
    begin(store, 2, 1, payload(9, 1)).commit(save_id="X-2", run_id="X")  # another run's replica
    # resumed step 2 of run A in run B; step 4 was complete but did not load: set aside
    gone = store.settle(Lineage("B", (("A", 2),)), 2, set_aside=[4])
    assert gone == [3, 4]
    assert store.inventory.steps() == [1, 2]
    assert store.inventory.step_state(2).committed_ranks == {0}  # run X's shard is gone
    assert store.inventory.step_state(1).complete
    assert [s for s, _ in store.orphans()] == [4]
    # the orphan goes once the job has a newer complete step here, not before
    put_save(store, 3, "B")
    apply_retention(store, [0, 1], keep=5)
    assert [s for s, _ in store.orphans()] == [4]
    put_save(store, 5, "B")
    apply_retention(store, [0, 1], keep=5)
    assert store.orphans() == []


def test_settle_drops_another_runs_metadata_but_keeps_a_replaced_nodes_fetched_metadata(store):
    put_save(store, 3, "A", ranks=(0,))
    for r in (0,):
        store.shards.retire(3, r)
    store.metadata.write(3, b"m", world_size=1, ranks=[0], total_bytes=1, save_id="A-3",
                         lineage=Lineage("A"))
    store.settle(Lineage("B", (("A", 3),)), 3)
    assert store.inventory.step_state(3).has_metadata  # fetched before the shard: kept for the heal
    store.settle(Lineage("C"), 3)
    assert 3 not in store.inventory.steps()


def test_inventory_skips_damaged_shards_and_complete_needs_one_save(store):
    put_save(store, 3, "A")
    assert store.inventory.step_state(3).complete
    os.truncate(store.paths.data(3, 1), 10)
    st = store.inventory.step_state(3)
    assert st.committed_ranks == {0} and not st.complete
    begin(store, 3, 1, payload(3, 1)).commit(save_id="A-other", run_id="A")
    st = store.inventory.step_state(3)
    assert st.committed_ranks == {0, 1} and st.ranks_of("A-3") == {0} and not st.complete
