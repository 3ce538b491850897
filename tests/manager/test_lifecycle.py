"""manager/lifecycle.py: a received replica is an event the lifecycle subscribes to (not a call into
the manager); pins keep a step from retention."""

from __future__ import annotations

import os
import shutil

from helpers import pool_files, put_metadata, put_shard, put_step, wait_for

from mlcheckpoint import CheckpointManager
from mlcheckpoint.manager.lifecycle import BufferWarmer, Lifecycle
from mlcheckpoint.replication import ReceiveSink, ReplicaReceived
from mlcheckpoint.store import layout

JOB = "job-lifecycle"


def test_the_sink_publishes_each_received_replica_to_every_subscriber(store):
    m = put_shard(store, 1, 3)
    seen: list[tuple[str, ReplicaReceived]] = []
    sink = ReceiveSink(store, subscribers=[lambda e: seen.append(("a", e)),
                                           lambda e: seen.append(("b", e))])
    sink.received(m)
    event = ReplicaReceived(step=1, owner=3, nbytes=m.data_bytes)
    assert seen == [("a", event), ("b", event)]


def test_a_received_replica_retires_that_owners_old_replicas_and_warms_its_buffers(store):
    lifecycle = Lifecycle(store, rank=0, keep=1)
    sink = ReceiveSink(store, pins=lifecycle.pins, subscribers=[lifecycle.replica_received])
    for step in (1, 2):
        put_step(store, step, ranks=(0, 3))
    m = put_shard(store, 3, 3)  # a newer replica of rank 3 arrives (its step is not whole yet)
    put_metadata(store, 3, ranks=(0, 3))
    try:
        sink.received(m)
        # Rank 3's old replicas beyond keep=1 went, except in step 2, the newest step held
        # whole here; this rank's own shards are the saver's to retire.
        assert store.inventory.step_state(1).committed_ranks == {0}
        assert store.inventory.step_state(2).committed_ranks == {0, 3}
        assert 3 in store.inventory.step_state(3).committed_ranks
        wait_for(lambda: lifecycle.warmer.thread is not None and not lifecycle.warmer.thread.is_alive(),
                 "the buffers of rank 3's next replicas")
    finally:
        assert lifecycle.warmer.close(wait=True)


def test_a_pinned_step_outlives_retention_until_unpinned(store):
    lifecycle = Lifecycle(store, rank=0, keep=1)
    pins = lifecycle.pins
    for step in (1, 2, 3):
        put_step(store, step)
    with pins.pinned(1):
        assert lifecycle.retention.apply() == [2]
        assert pins.steps() == {1}
    assert pins.steps() == set()
    assert lifecycle.retention.apply() == [1]
    lifecycle.warmer.close(wait=True)


def test_a_failing_close_leaves_no_buffer_preparation_writing_into_the_directory(store_dir):
    """close(failed=True) does not wait for saves or peers, but it waits for a preparation of
    buffers in flight: after close the claim is released, and a thread still writing the pool
    would write into the next run's directory (or make one again after it was removed: a test
    of gc left such a directory behind under load)."""
    ckpt = CheckpointManager(job_id=JOB, local_dir=store_dir, replication="none", keep=1)
    warmer = ckpt._lifecycle.warmer
    warmer.prepare(0, 256 << 20)  # two buffers of 256 MiB: long enough to be in flight
    assert warmer.thread is not None and warmer.thread.is_alive()
    ckpt.close(failed=True)
    assert not warmer.thread.is_alive()
    shutil.rmtree(store_dir)
    assert not os.path.exists(store_dir)  # nothing made it again


def test_a_buffer_asked_for_while_another_owners_are_made_is_made_after_them(store):
    """A partner's replica arriving first starts the preparation of its owner's buffers; the
    rank's own save asks for its buffers meanwhile. That request was dropped, and a rank
    saving from device memory page-locked each of its next saves' buffers on the training
    thread (seen on an H200)."""
    put_step(store, 1, ranks=(0,))
    warmer = BufferWarmer(store, keep=1)
    try:
        warmer.prepare(3, 64 << 20)  # a replica's owner: long enough to be in flight
        first = warmer.thread
        assert first is not None and first.is_alive()
        warmer.prepare(0, 4096)  # the rank's own save, meanwhile
        def owners() -> list[int]:  # of the buffers made (not those still being made)
            ranks = (layout.parse_pool_name(os.path.basename(p)) for p in pool_files(store))
            return sorted(r for r in ranks if r is not None)

        # keep + 1 each, less rank 0's shard in use
        wait_for(lambda: owners() == [0, 3, 3], "both owners' buffers", timeout=30, diag=lambda: str(owners()))
        assert warmer.thread is first  # one thread worked through both
    finally:
        assert warmer.close(wait=True)
