"""The store's parts on their own: file names (layout.classify), item verification, and a
pickled store's shared mapping cache."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from helpers import put_metadata, put_shard, put_step

from mlcheckpoint import CorruptShardError
from mlcheckpoint.errors import CopyId
from mlcheckpoint.integrity import copier
from mlcheckpoint.integrity.checksum import checksum
from mlcheckpoint.integrity.verify import region_digests, verify_digests
from mlcheckpoint.store import buffers, layout
from mlcheckpoint.store.layout import JobPaths, Kind, classify
from mlcheckpoint.store.manifest import ManifestItem

JOB = "job-parts"


# ---------------------------------------------------------------- layout.classify

def test_classify_names_every_path_the_layout_builds():
    paths = JobPaths("/x/job")
    token8, token16 = "ab" * 4, "cd" * 8
    built = {
        paths.data(3, 1): (Kind.DATA, 1, None),
        paths.inflight(3, 1): (Kind.INFLIGHT, 1, None),
        paths.manifest(3, 1): (Kind.MANIFEST, 1, None),
        paths.manifest_tmp(3, 1): (Kind.TEMP, 1, None),
        paths.metadata(3): (Kind.METADATA, None, None),
        paths.metadata_tmp(3, token8): (Kind.TEMP, None, None),
        paths.pool_buffer(2, token16): (Kind.POOL_BUFFER, 2, None),
        paths.pool_inflight(2, token16): (Kind.POOL_INFLIGHT, 2, None),
        paths.step_dir(3): (Kind.STEP, None, 3),
        paths.orphan(4, token8): (Kind.ORPHAN, None, 4),
        paths.fetch_lock(70): (Kind.LOCK, None, None),
        paths.bandwidth: (Kind.LOCK, None, None),
        paths.lock: (Kind.LOCK, None, None),
        paths.history: (Kind.HISTORY, None, None),
        paths.claim_lock: (Kind.CLAIM, None, None),
        paths.claim: (Kind.CLAIM, None, None),
        paths.steps_dir: (Kind.FOLDER, None, None),
        paths.pool_dir: (Kind.FOLDER, None, None),
    }
    for path, (kind, rank, step) in built.items():
        e = classify(os.path.basename(path))
        assert (e.kind, e.rank, e.step) == (kind, rank, step), path
    in_flight = {p for p, (k, _, _) in built.items() if classify(os.path.basename(p)).in_flight}
    assert in_flight == {paths.inflight(3, 1), paths.manifest_tmp(3, 1),
                         paths.metadata_tmp(3, token8), paths.pool_inflight(2, token16)}
    # Only a shard's data file, committed or not, is a buffer worth pooling.
    assert {p for p in built if classify(os.path.basename(p)).is_buffer} == \
        {paths.data(3, 1), paths.inflight(3, 1)}


def test_classify_knows_in_flight_files_named_as_earlier_versions_did():
    """Files in flight ended in ``.partial`` in earlier versions: what they left classify
    as the in-flight files they are (gc removes them), never as anything committed."""
    old = layout.LEGACY_INFLIGHT
    assert old != layout.INFLIGHT
    for name, kind, rank in [(f"rank-00003.data{old}", Kind.INFLIGHT, 3),
                             (f"rank-00002-{'cd' * 8}.buf{old}", Kind.POOL_INFLIGHT, 2),
                             (f"rank-00003.manifest{old}", Kind.TEMP, 3)]:
        e = classify(name)
        assert (e.kind, e.rank, e.in_flight) == (kind, rank, True), name


@pytest.mark.parametrize("name", ["rank-1.data", "rank-00001.data.bak", "123", "foo",
                                  "rank-00001-xyz.buf", "0000000000003-zz"])
def test_classify_names_it_does_not_know_as_unknown(name):
    assert classify(name).kind is Kind.UNKNOWN


def test_job_paths_list_only_step_folders(store):
    put_step(store, 2)
    put_step(store, 11)
    os.makedirs(os.path.join(store.steps_dir, "not-a-step"))
    assert store.paths.step_numbers() == [2, 11] == store.inventory.steps()


# ---------------------------------------------------------------- verify_digests

def test_verify_digests_names_the_first_bad_item_and_the_copy():
    data = np.arange(64, dtype=np.uint8)
    items = [ManifestItem("a", 0, 16, checksum(data[:16])), ManifestItem("b", 16, 16, 0),
             ManifestItem("c", 32, 32, 1)]
    digests = region_digests(data, items)
    verify_digests(items[:1], digests[:1], "copy")
    with pytest.raises(CorruptShardError, match="copy: checksum mismatch in 'b'") as e:
        verify_digests(items, digests, "copy", copy=CopyId(3, 0, 1))
    assert e.value.copy == CopyId(3, 0, 1)
    with pytest.raises(ValueError):  # one digest per item, always
        verify_digests(items[:1], [], "copy")


def test_replica_verified_on_arrival_names_the_bad_item(store):
    data = np.full(4096, 7, dtype=np.uint8)
    m = put_shard(store, 1, 0, data.tobytes())
    sw = store.begin_shard(1, 1, 4096)
    sw.buffer.array[:] = data
    sw.verify(m)  # the same bytes pass
    sw.buffer.array[3000] ^= 1
    with pytest.raises(CorruptShardError, match="on arrival: checksum mismatch in 'second'"):
        sw.verify(m)
    sw.abort()


# ---------------------------------------------------------------- pickling (PROCESS mode)

def test_pickled_store_parts_share_one_fresh_mapping_cache(store):
    put_shard(store, 1, 0)
    store.shards.map(1, 0)
    assert store.mappings._by_key
    copy = pickle.loads(pickle.dumps(store))
    assert copy.mappings is not store.mappings and not copy.mappings._by_key
    assert copy.pool.mappings is copy.mappings is copy.shards.mappings
    m, _ = copy.shards.map(1, 0)  # maps in the copy's own cache
    assert copy.mappings._by_key and copy.verify_shard(1, 0) == m
    put_metadata(copy, 1)
    assert copy.inventory.complete_steps() == [1] == store.inventory.complete_steps()
    assert layout.classify(os.path.basename(copy.paths.data(1, 0))).kind is Kind.DATA


# ---------------------------------------------------------------- mappings and their holders

def mapped_at(address: int, nbytes: int) -> bool:
    """Whether this process maps ``nbytes`` at ``address`` (read before touching them: an
    unmapped address would be a segfault, not a failed assertion)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address and address + nbytes <= hi:
                return True
    return False


def test_a_mapping_the_cache_lets_go_stays_mapped_while_a_reader_copies_from_it(store):
    """A reader copies through the address of its mapping (the copier's threads): the cache
    dropping that mapping meanwhile (another thread forgot the file, or closed the store's
    mappings) must not unmap it under the copy. It goes when the reader lets go of it."""
    data = np.arange(1 << 16, dtype=np.uint64).view(np.uint8)
    m = put_shard(store, 1, 0, data.tobytes())
    store.mappings.clear()  # as in a restarted process: the reader maps the shard itself
    dst = np.zeros_like(data)
    with store.shards.open(1, 0, m.save_id) as source:
        span = source.span(0, data.nbytes, dst.ctypes.data)
        store.mappings.forget(source.path)
        store.mappings.clear()
        assert mapped_at(span.src, data.nbytes)
        copier.process([span])
    assert np.array_equal(dst, data)


def test_two_threads_mapping_one_shard_at_once_share_one_mapping(store, monkeypatch):
    """Two threads map a shard the cache lacks at once (a resume reading it while serving a
    peer's read of it): the one that finishes second takes the first one's mapping, and the
    first one's stays mapped and whole, instead of being replaced and unmapped under it."""
    data = np.arange(1 << 16, dtype=np.uint64).view(np.uint8)
    put_shard(store, 1, 0, data.tobytes())
    store.mappings.clear()
    path = store.paths.data(1, 0)
    make, theirs = buffers.MappedFile, []

    def mapped_meanwhile(*args, **kwargs):  # the other thread's map() ends while ours maps
        if not theirs:
            theirs.append(None)
            theirs[0] = store.mappings.map(path, data.nbytes, populate=False)
        return make(*args, **kwargs)

    monkeypatch.setattr(buffers, "MappedFile", mapped_meanwhile)
    ours = store.mappings.map(path, data.nbytes, populate=False)
    assert ours is theirs[0]
    assert mapped_at(ours.base_ptr, data.nbytes)
    assert np.array_equal(ours.array, data)
