"""The store's parts on their own: file names (layout.classify), the pure retention plan and
the policy the manager holds, item verification, and a pickled store's shared mapping cache."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from helpers import put_metadata, put_shard, put_step
from hypothesis import given, settings
from hypothesis import strategies as hst

from mlcheckpoint import CorruptShardError
from mlcheckpoint.errors import CopyId
from mlcheckpoint.integrity.checksum import checksum
from mlcheckpoint.integrity.verify import region_digests, verify_digests
from mlcheckpoint.lifecycle import Pins, RetentionPolicy
from mlcheckpoint.store import layout
from mlcheckpoint.store.inventory import StepState
from mlcheckpoint.store.layout import JobPaths, Kind, classify
from mlcheckpoint.store.manifest import ManifestItem, MetadataHeader
from mlcheckpoint.store.retention import plan_retention

JOB = "job-parts"


# ---------------------------------------------------------------- layout.classify

def test_classify_names_every_path_the_layout_builds():
    paths = JobPaths("/x/job")
    token8, token16 = "ab" * 4, "cd" * 8
    built = {
        paths.data(3, 1): (Kind.DATA, 1, None),
        paths.partial(3, 1): (Kind.PARTIAL, 1, None),
        paths.manifest(3, 1): (Kind.MANIFEST, 1, None),
        paths.manifest_tmp(3, 1): (Kind.TEMP, 1, None),
        paths.metadata(3): (Kind.METADATA, None, None),
        paths.metadata_tmp(3, token8): (Kind.TEMP, None, None),
        paths.pool_buffer(2, token16): (Kind.POOL_BUFFER, 2, None),
        paths.pool_partial(2, token16): (Kind.POOL_PARTIAL, 2, None),
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
    assert in_flight == {paths.partial(3, 1), paths.manifest_tmp(3, 1),
                         paths.metadata_tmp(3, token8), paths.pool_partial(2, token16)}
    # Only a shard's data file, committed or not, is a buffer worth pooling.
    assert {p for p in built if classify(os.path.basename(p)).is_buffer} == \
        {paths.data(3, 1), paths.partial(3, 1)}


@pytest.mark.parametrize("name", ["rank-1.data", "rank-00001.data.bak", "123", "foo",
                                  "rank-00001-xyz.buf", "0000000000003-zz"])
def test_classify_names_it_does_not_know_as_unknown(name):
    assert classify(name).kind is Kind.UNKNOWN


def test_job_paths_list_only_step_folders(store):
    put_step(store, 2)
    put_step(store, 11)
    os.makedirs(os.path.join(store.steps_dir, "not-a-step"))
    assert store.paths.step_numbers() == [2, 11] == store.steps()


# ---------------------------------------------------------------- retention plan

def state(step: int, ranks=(0,), *, metadata: bool = True, save: str = "s") -> StepState:
    st = StepState(step, committed_ranks=set(ranks), shard_saves={r: save for r in ranks})
    if metadata:
        st.has_metadata = True
        st.required_ranks = list(ranks)
        st.header = MetadataHeader(job_id=JOB, step=step, world_size=1, ranks=list(ranks),
                                   total_bytes=0, payload_bytes=0, checksum=0, save_id="s")
    return st


def test_plan_keeps_newest_complete_and_what_is_newer_or_protected():
    inv = {1: state(1), 2: state(2), 3: state(3), 4: state(4), 5: state(5, metadata=False)}
    plan = plan_retention(inv, [0], keep=2, protected={1})
    assert plan.shards == ((2, 0),)  # 1 protected, 3-4 kept, 5 in flight (no metadata yet)
    assert plan.steps == [2]
    assert plan_retention(inv, [0], keep=2).steps == [1, 2]


def test_plan_counts_only_shards_of_the_save_the_metadata_names():
    inv = {1: state(1), 2: state(2, save="other"), 3: state(3)}
    # step 2's shard is of another save: not complete for rank 0, so keep=2 keeps 1 and 3
    assert plan_retention(inv, [0], keep=2).shards == ()
    assert plan_retention(inv, [0], keep=1).shards == ((1, 0), (2, 0))


def test_plan_drops_bare_metadata_and_set_aside_steps_past_a_complete_one():
    inv = {1: state(1, ranks=()), 2: state(2), 3: state(3)}
    plan = plan_retention(inv, [0], keep=1, set_aside=[(0, "/o/0"), (5, "/o/5")])
    assert plan.bare_metadata == (1,)
    assert plan.set_aside == ((0, "/o/0"),)  # step 5 is newer than the newest complete (3)
    assert plan.newest_complete == 3


def test_plan_refuses_keep_below_one():
    with pytest.raises(ValueError):
        plan_retention({}, [0], keep=0)


@settings(max_examples=200, deadline=None)
@given(steps=hst.dictionaries(hst.integers(0, 30), hst.tuples(hst.booleans(), hst.booleans()),
                              max_size=12),
       keep=hst.integers(1, 4), protected=hst.sets(hst.integers(0, 30), max_size=3))
def test_plan_never_retires_protected_or_the_newest_complete_steps(steps, keep, protected):
    inv = {s: state(s, ranks=(0,) if held else (), metadata=meta)
           for s, (held, meta) in steps.items()}
    plan = plan_retention(inv, [0], keep=keep, protected=protected)
    retired = {s for s, _ in plan.shards}
    complete = sorted(s for s, st in inv.items() if st.complete)
    assert not retired & protected
    assert not retired & set(complete[-keep:])
    assert all(s < complete[-keep] for s in retired)  # nothing newer than the oldest kept
    assert all(0 in inv[s].committed_ranks for s in retired)


def test_store_retention_carries_out_the_plan(store):
    for s in (1, 2, 3):
        put_step(store, s)
    plan = plan_retention(store.inventory(), [0], keep=1)
    assert store.apply_retention([0], keep=1) == plan.steps == [1, 2]
    assert store.complete_steps() == [3]


class Replicas:
    """Stands in for the replicator's view of job-wide protection (a plain value here)."""

    def __init__(self, newest: int | None, known: int | None, round_step: int | None = None):
        self.newest, self.known, self.asked = newest, known, 0
        self.round = round_step

    def newest_protected(self, candidates: list[int]) -> int | None:
        self.asked += 1
        return self.newest

    def known_protected(self) -> int | None:
        return self.known

    def round_step(self) -> int | None:
        return self.round


def test_policy_keeps_pinned_and_newest_protected_steps(store):
    for s in range(1, 6):
        put_step(store, s)
    pins = Pins()
    pins.pin(1)
    replicas = Replicas(newest=2, known=3)
    policy = RetentionPolicy(keep=1, pins=pins, replicas=replicas)
    assert policy.protected(store) == {1, 2} and replicas.asked == 1
    # A listener thread does not ask the job-wide counters: the last known step instead.
    assert policy.protected(store, ask=False) == {1, 3} and replicas.asked == 1
    assert policy.apply(store, [0], ask=False) == [2, 4]
    assert store.complete_steps() == [1, 3, 5]
    assert RetentionPolicy(keep=1, pins=Pins()).apply(store, [0]) == [1, 3]


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
    store.map_shard(1, 0)
    assert store.mappings._by_key
    copy = pickle.loads(pickle.dumps(store))
    assert copy.mappings is not store.mappings and not copy.mappings._by_key
    assert copy.pool.mappings is copy.mappings is copy.shards.mappings
    m, _ = copy.map_shard(1, 0)  # maps in the copy's own cache
    assert copy.mappings._by_key and copy.verify_shard(1, 0) == m
    put_metadata(copy, 1)
    assert copy.complete_steps() == [1] == store.complete_steps()
    assert layout.classify(os.path.basename(copy.data_path(1, 0))).kind is Kind.DATA
