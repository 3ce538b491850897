"""Buffers prepared ahead of the first saves: made off the save path, taken by the next saves
warm (already mapped), never more than a steady state holds, never past capacity."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import payload, pool_files, put_metadata, put_shard, put_step

from mlcheckpoint import CheckpointManager
from mlcheckpoint.store import LocalStore, buffers, layout
from mlcheckpoint.testing import internals

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

JOB = "job-prewarm"
N = 4096  # put_step's shard size


def mapped_inodes(store: LocalStore) -> set[int]:
    return {ino for _dev, ino in store.mappings._by_key}


def populated_by(store: LocalStore, paths: list[str]) -> set[str]:
    """How the pages of the mappings of ``paths`` were faulted in ("madvise": without the GIL)."""
    keys = [(os.stat(p).st_dev, os.stat(p).st_ino) for p in paths]
    return {store.mappings._by_key[k].populated_by for k in keys}


def test_prewarm_prepares_what_the_next_saves_need(store):
    put_step(store, 1)  # one committed shard of rank 0
    assert store.pool.prewarm(0, N, keep=2) == 2  # keep=2: two more before recycling starts
    pooled = pool_files(store)
    assert len(pooled) == 2
    inodes = {os.stat(p).st_ino for p in pooled}
    assert inodes <= mapped_inodes(store)  # pages populated and mapped in this process
    assert populated_by(store, pooled) == {"madvise"}  # off the GIL: saves go on meanwhile
    assert all(os.stat(p).st_size == N for p in pooled)
    assert store.pool.prewarm(0, N, keep=2) == 0  # nothing more to do

    sw = store.begin_shard(2, 0, N)  # the next save takes a prepared buffer: same inode
    assert os.stat(sw.inflight_path).st_ino in inodes
    assert sw.buffer is store.mappings._by_key[(os.stat(sw.inflight_path).st_dev,
                                               os.stat(sw.inflight_path).st_ino)]
    sw.buffer.array[:] = 7
    sw.commit()
    put_metadata(store, 2)
    assert store.pool.prewarm(0, N, keep=2) == 0  # 2 in use + 1 ready = keep + 1
    assert store.pool.prewarm(1, N, keep=2) == 2  # other owners (replicas) are counted apart


def test_prewarm_counts_a_save_in_flight(store):
    put_step(store, 1)
    sw = store.begin_shard(2, 0, N)  # a save running while we prepare
    assert store.pool.prewarm(0, N, keep=2) == 1
    sw.abort()


def test_prewarm_stops_at_capacity_and_saves_still_work(store_dir):
    big = 1 << 20
    store = LocalStore(store_dir, JOB)
    try:
        put_shard(store, 1, 0, payload(1, 0, big))
        put_metadata(store, 1)
        # room for one more shard, not for a prepared buffer plus a save's worth of headroom
        store.memory_limit_bytes = store.capacity.usage_bytes() + big + big // 2
        assert store.pool.prewarm(0, big, keep=2) == 0
        assert pool_files(store) == []
        put_shard(store, 2, 0, payload(2, 0, big))  # the save itself is unaffected
        put_metadata(store, 2)
        assert store.inventory.complete_steps() == [1, 2]
    finally:
        store.close()


def test_gc_removes_a_buffer_cut_short_while_being_prepared(store):
    os.makedirs(store.pool_dir, exist_ok=True)
    debris = os.path.join(store.pool_dir, layout.pool_name(0, "ab" * 8) + layout.INFLIGHT)
    with open(debris, "wb") as f:
        f.write(b"\0" * N)
    assert layout.parse_pool_name(os.path.basename(debris)) is None  # never taken for a buffer
    assert store.gc(ranks=[1]) == []  # another rank's sweep leaves it
    assert store.gc() == [debris]
    assert not os.path.exists(debris)


def test_mapping_populates_without_mmap_populate():
    """Fresh buffers are faulted in with madvise through ctypes, which releases the GIL
    (mmap(MAP_POPULATE) holds it for seconds on a large fresh file here)."""
    path = "/dev/shm/mlckpt-test-populate-" + os.urandom(4).hex()
    try:
        with open(path, "wb") as f:
            f.truncate(8 << 20)
        mf = buffers.MappedFile(path, 8 << 20)
        try:
            assert mf.populated_by == "madvise"
            assert os.stat(path).st_blocks * 512 >= 8 << 20  # every page is there
            mf.array[:] = 3
        finally:
            mf.release()
    finally:
        os.unlink(path)


def test_manager_prepares_buffers_after_the_first_save(store_dir):
    sd = {"w": torch.randn(256, 256), "b": torch.randn(300)}
    with CheckpointManager(job_id=JOB, local_dir=store_dir, keep=2, replication="none") as ckpt:
        ckpt.save(sd, 1)
        warmer = internals(ckpt).warmer.thread
        assert warmer is not None
        warmer.join(timeout=60)
        store = internals(ckpt).store
        prepared = {os.stat(p).st_ino for p in pool_files(store)}
        assert len(prepared) == 2
        assert populated_by(store, pool_files(store)) == {"madvise"}
        ckpt.save(sd, 2)
        ckpt.save(sd, 3)
        used = {os.stat(store.paths.data(s, 0)).st_ino for s in (2, 3)}
        assert used == prepared  # saves 2 and 3 wrote into the prepared buffers
        out = {"w": torch.zeros(256, 256), "b": torch.zeros(300)}
        assert ckpt.resume(out).step == 3
        assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])


def test_a_whole_file_reader_keeps_the_writers_mapping_of_a_recycled_buffer(store):
    """A committed shard whose byte items were appended past the staged region is read whole
    (the replication sender, ``verify_shard``): its wider mapping goes beside the writer's,
    which stays cached (page-locked, where the rank saves from device memory), so the next
    save of the recycled buffer finds that one, not a mapping it must page-lock again."""
    sw = store.begin_shard(1, 0, N)
    writer_mapping = sw.buffer
    sw.buffer.array[:] = 3
    offset, _ = sw.append_bytes(b"x" * 1000)  # past the staged region, as DCP's byte items
    assert offset >= N
    sw.commit()
    put_metadata(store, 1)
    m, whole = store.shards.map(1, 0)  # a whole-file reader
    assert whole.size == m.data_bytes > writer_mapping.size
    data = store.shards.paths.data(1, 0)
    st = os.stat(data)
    assert store.mappings.lookup(st) is writer_mapping, "the reader replaced the writer's mapping"
    assert writer_mapping.array is not None  # still mapped: never released
    assert store.shards.map(1, 0)[1] is whole  # the wider one is kept too: read again, not remapped
    store.shards.retire(1, 0)  # recycled: the next save of rank 0 takes it back
    sw = store.begin_shard(2, 0, N)
    assert os.stat(sw.inflight_path).st_ino == st.st_ino
    assert sw.buffer is writer_mapping
    sw.abort()


def test_a_replica_leaves_a_device_ranks_page_locked_buffers_to_its_saves(store_dir, standin_page_locking):
    """Rank 0 saves from device memory; rank 1's replicas land on this node. A replica taking
    one of rank 0's page-locked buffers left rank 0's next save a buffer to page-lock on the
    training thread (on an H200: every save of a pg-replicated job until the pool settled)."""
    store = LocalStore(store_dir, JOB)
    try:
        first = store.begin_shard(1, 0, N)
        first.page_lock(None)  # rank 0's first save from device memory
        assert store.pool.prewarm(0, N, keep=2) == 2
        locked = {os.stat(p).st_ino for p in pool_files(store)}
        assert all(store.mappings.page_locked(os.stat(p)) for p in pool_files(store))

        replica = store.begin_shard(1, 1, N)  # rank 1's replica: a fresh buffer
        assert os.stat(replica.inflight_path).st_ino not in locked
        assert not replica.buffer._cuda_registered
        own = store.begin_shard(2, 0, N)  # rank 0's next save: a page-locked one
        assert os.stat(own.inflight_path).st_ino in locked and own.buffer._cuda_registered

        # When only a page-locked buffer gives a replica room, it takes one.
        store.memory_limit_bytes = store.capacity.usage_bytes() + N // 2
        squeezed = store.begin_shard(3, 1, N)
        assert os.stat(squeezed.inflight_path).st_ino in locked
        for writer in (first, replica, own, squeezed):
            writer.abort()
    finally:
        store.close()


def test_a_squeezed_replica_takes_the_page_locked_buffer_that_fits_not_a_short_one(store_dir, standin_page_locking):
    """With no room for a fresh buffer, a replica is offered every pooled buffer in the usual
    order (fitting first), page-locked or not: a short unlocked buffer beside a fitting
    page-locked one must not make it fail."""
    store = LocalStore(store_dir, JOB)
    try:
        first = store.begin_shard(1, 0, N)
        first.page_lock(None)
        assert store.pool.prewarm(0, N, keep=2) == 2
        locked = {os.stat(p).st_ino for p in pool_files(store)}
        store.begin_shard(1, 2, N // 2).abort()  # a short, unlocked buffer of rank 2 in the pool
        assert len(pool_files(store)) == 3
        store.memory_limit_bytes = store.capacity.usage_bytes() + N // 4  # neither a fresh one nor it
        replica = store.begin_shard(2, 1, N)
        assert os.stat(replica.inflight_path).st_ino in locked
        for writer in (first, replica):
            writer.abort()
    finally:
        store.close()
