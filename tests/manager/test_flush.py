"""The preemption flush's parts in one process (issue 42, item 5): what a rank writes from
tmpfs, how ranks with no collective between them finish a step in the persistent folder, and
how a SIGTERM becomes a flush followed by the handler that was there before. Whole jobs
(torchrun, SIGTERM to every agent, a restart on wiped nodes): tests/jobs/test_preemption.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed.checkpoint as dcp
from helpers import damage_shard, wait_for
from states import differences, make_state, zeros_like_state
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from mlcheckpoint import CheckpointManager, MemoryStorageWriter
from mlcheckpoint.history import read as read_history
from mlcheckpoint.manager.flush import ABANDONED_AFTER_S, Flusher, FlushResult
from mlcheckpoint.manager.preemption import Preemption
from mlcheckpoint.persistent import PersistentStorage
from mlcheckpoint.store import LocalStore
from mlcheckpoint.store.pins import Pins

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
JOB = "job-flush"


def load_plain(path: str, want: dict) -> list[str]:
    """Where a plain ``dcp.load`` of ``path`` differs from ``want``."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        assert b"mlcheckpoint" not in f.read()  # loadable without mlcheckpoint
    got = zeros_like_state(want)
    dcp.load(got, storage_reader=FileSystemReader(path), no_dist=True)
    return differences(want, got)


def test_flush_to_persistent_writes_the_newest_step_as_a_plain_dcp_checkpoint(store_dir):
    """Every kind of entry (dtypes, empty and strided tensors, non-tensors) comes back from a
    plain FileSystemReader; the step is complete; a second flush has nothing newer to write."""
    folder = os.path.join(store_dir, "persistent")
    with CheckpointManager(folder, job_id=JOB, local_dir=os.path.join(store_dir, "shm"),
                           replication="none") as ckpt:
        for step in range(4):
            ckpt.save(make_state(step), step, persistent=step == 0)
        result = ckpt.flush_to_persistent()
        assert (result.step, result.complete, result.parts) == (3, True, [3]), result
        assert result.bytes > 0
        storage = PersistentStorage(folder)
        assert storage.complete_steps() == [0, 3]
        assert load_plain(storage.path(3), make_state(3)) == []
        again = ckpt.flush_to_persistent()
        assert again.step is None and "no step newer" in again.reason
        events = [e for e in read_history(os.path.join(store_dir, "shm", JOB)) if e["event"] == "flush"]
        assert [(e["step"], e["complete"]) for e in events] == [(3, True)]


def save_two_ranks(step: int, stores: list[LocalStore]) -> None:
    """DCP's save protocol for ranks 0 and 1 (rank r on ``stores[r]``), run by hand in one
    process: plans, the coordinator's global plan, each rank's write, the coordinator's
    finish. The metadata lands on rank 0's node only, as before the publish sends it on."""
    planners, writers, plans = [], [], []
    for r, store in enumerate(stores):
        planner, writer = DefaultSavePlanner(), MemoryStorageWriter(step, store, rank=r, world_size=2)
        planner.set_up_planner(make_state(step, r), writer.storage_meta(), is_coordinator=r == 0)
        writer.set_up_storage_writer(r == 0, rank=r)
        plans.append(writer.prepare_local_plan(planner.create_local_plan()))
        planners.append(planner)
        writers.append(writer)
    global_plans, metadata = planners[0].create_global_plan(plans)
    global_plans = writers[0].prepare_global_plan(global_plans)
    results = [writers[r].write_data(planners[r].finish_plan(global_plans[r]), planners[r]).wait()
               for r in range(2)]
    writers[0].finish(metadata, results)


def both_ranks(step: int) -> dict:
    return {**make_state(step, 0), **make_state(step, 1)}


@pytest.mark.parametrize("first", [0, 1])
def test_ranks_finish_a_step_in_the_folder_whichever_comes_last(store_dir, first):
    """Two nodes, one rank each; node 1 has not received step 2's metadata. Each rank writes
    its part alone (rank 1 also its part of step 2 without knowing it is whole, and of step 1,
    the newest it holds whole); the step is complete only once both parts are there, and then
    plain DCP loads it. Until then the older persistent step stays the newest."""
    stores = [LocalStore(os.path.join(store_dir, f"node{n}"), JOB) for n in range(2)]
    for step in (1, 2):
        save_two_ranks(step, stores)
    stores[1].metadata.write_file(1, stores[0].metadata.read_file(1))  # step 1 published
    storage = PersistentStorage(os.path.join(store_dir, "persistent"))
    os.makedirs(storage.path(0))
    with open(os.path.join(storage.path(0), ".metadata"), "wb"):
        pass  # an older persistent step (complete, as far as listing goes)
    flushers = [Flusher(stores[r], storage, r, Pins()) for r in range(2)]
    assert [c.step for c in flushers[1].candidates()] == [2, 1]
    assert [c.step for c in flushers[0].candidates()] == [2]

    one = flushers[first].flush(time.monotonic() + 60)
    assert not one.complete and one.step == 2, one
    assert storage.complete_steps() == [0]  # unfinished: the older step is still the newest
    other = flushers[1 - first].flush(time.monotonic() + 60)
    assert (other.step, other.complete) == (2, True), other
    assert storage.complete_steps() == [0, 2]
    assert load_plain(storage.path(2), both_ranks(2)) == []


def test_a_rank_removes_its_part_of_an_older_step_once_a_newer_one_is_complete(store_dir):
    """Rank 1's node lacks step 2's metadata: it writes its part of step 2 and, not knowing
    step 2 will complete, of step 1. Once rank 0's part completes step 2, rank 1 (staying for
    the other parts) removes its part of step 1, and step 1's folder goes with it: no rank's
    part is left there. Before, the folder (a rank's whole shard) stayed in the persistent tier
    for good, beside the complete step 2 (a Lightning job's folder showed two
    ``preempted-step=`` checkpoints)."""
    stores = [LocalStore(os.path.join(store_dir, f"node{n}"), JOB) for n in range(2)]
    for step in (1, 2):
        save_two_ranks(step, stores)
    stores[1].metadata.write_file(1, stores[0].metadata.read_file(1))
    storage = PersistentStorage(os.path.join(store_dir, "persistent"))
    flushers = [Flusher(stores[r], storage, r, Pins(), wait_for_parts=20) for r in range(2)]
    results: dict[int, FlushResult] = {}
    rank1 = threading.Thread(target=lambda: results.update({1: flushers[1].flush_and_stay(
        time.monotonic() + 30)}))
    rank1.start()
    wait_for(lambda: os.path.isdir(os.path.join(storage.path(1), ".mlcheckpoint-flush")),
             "rank 1's part of step 1")
    results[0] = flushers[0].flush(time.monotonic() + 30)
    rank1.join()
    assert (results[0].parts, results[0].complete) == ([2], True), results
    assert (results[1].parts, results[1].step, results[1].complete, results[1].removed) == \
        ([2, 1], 2, True, [1]), results
    assert storage.complete_steps() == [2]
    assert not os.path.exists(storage.path(1))
    assert load_plain(storage.path(2), both_ranks(2)) == []


def test_a_part_whose_step_completed_meanwhile_stays(store_dir):
    """The race between a rank removing its part of an older step and another rank finishing
    that step, from both sides. Where the step completed before the marker went, the remover
    puts its marker back and keeps its file: the step stays complete and loads. Where the
    marker went while the finisher wrote DCP's ``.metadata`` (after it had read the markers),
    the finisher takes ``.metadata`` back: the step never stands complete with a part gone."""
    stores = [LocalStore(os.path.join(store_dir, f"node{n}"), JOB) for n in range(2)]
    save_two_ranks(1, stores)
    stores[1].metadata.write_file(1, stores[0].metadata.read_file(1))
    storage = PersistentStorage(os.path.join(store_dir, "persistent"))
    flushers = [Flusher(stores[r], storage, r, Pins()) for r in range(2)]
    (c0,), (c1,) = flushers[0].candidates(), flushers[1].candidates()
    for flusher, c in ((flushers[0], c0), (flushers[1], c1)):
        flusher._write_part(c, time.monotonic() + 30)
    marker = os.path.join(storage.path(1), ".mlcheckpoint-flush", c1.save_id, "part-00001.json")

    flush_files = storage.flush_files

    def marker_goes_meanwhile(read_item):
        os.unlink(marker)  # rank 1's removal, between the finisher's reads and its .metadata
        return flush_files(read_item)

    storage.flush_files = marker_goes_meanwhile  # type: ignore[method-assign]
    assert flushers[0].finish(1, c0.save_id) is False
    assert storage.complete_steps() == [] and not flushers[0].complete(1)
    storage.flush_files = flush_files  # type: ignore[method-assign]

    flushers[1]._write_part(c1, time.monotonic() + 30)  # rank 1's part again
    assert flushers[0].finish(1, c0.save_id) is True
    assert flushers[1]._remove_part(1, c1.save_id) is False  # completed first: it stays
    assert os.path.exists(marker) and storage.complete_steps() == [1]
    assert load_plain(storage.path(1), both_ranks(1)) == []


def age(folder: str, seconds: float) -> None:
    """Everything in ``folder`` last changed ``seconds`` ago."""
    then = time.time() - seconds
    for root, dirs, files in os.walk(folder):
        for entry in [root, *(os.path.join(root, n) for n in files + dirs)]:
            os.utime(entry, (then, then))


def abandoned_and_complete(store_dir: str) -> tuple[list[LocalStore], PersistentStorage]:
    """Step 1's flush never completed (rank 1 wrote its part, rank 0 never came: an elastic
    restart after rank 0 failed); step 2's did."""
    stores = [LocalStore(os.path.join(store_dir, f"node{n}"), JOB) for n in range(2)]
    save_two_ranks(1, stores)
    storage = PersistentStorage(os.path.join(store_dir, "persistent"))
    assert Flusher(stores[1], storage, 1, Pins()).flush(time.monotonic() + 30).complete is False
    save_two_ranks(2, stores)
    for r in (0, 1):
        Flusher(stores[r], storage, r, Pins()).flush(time.monotonic() + 30)
    assert storage.complete_steps() == [2] and os.path.isdir(storage.path(1))
    return stores, storage


def test_the_next_start_removes_a_flush_that_never_completed(store_dir):
    """A flush folder no rank can finish any more (no ``.metadata``; only the flush's own
    files; unchanged for longer than a flush may run) is removed; a complete step, a folder
    holding a file no flush writes, and an unfinished flush changed within the last
    ``ABANDONED_AFTER_S`` (one may still be writing it) stay. Before, each elastic restart
    after a rank failure left such a folder behind (the survivors flush at their SIGTERM, the
    failed rank writes no part): most of a checkpoint, on shared storage, for good."""
    stores, storage = abandoned_and_complete(store_dir)
    foreign = os.path.join(storage.location, "step-000000000007")
    os.makedirs(os.path.join(foreign, ".mlcheckpoint-flush"))
    with open(os.path.join(foreign, "notes.txt"), "w") as f:
        f.write("the user's")
    flusher = Flusher(stores[0], storage, 0, Pins())
    age(storage.location, ABANDONED_AFTER_S - 30)
    assert flusher.remove_abandoned(deadline_s=25) == []  # a flush may still be writing it
    age(storage.location, ABANDONED_AFTER_S + 30)
    assert flusher.remove_abandoned(deadline_s=25) == [storage.path(1)]
    assert not os.path.exists(storage.path(1))
    assert os.path.exists(os.path.join(foreign, "notes.txt"))
    assert storage.complete_steps() == [2] and load_plain(storage.path(2), both_ranks(2)) == []
    # A long flush deadline waits longer: two deadlines, past ABANDONED_AFTER_S.
    stores2, storage2 = abandoned_and_complete(os.path.join(store_dir, "again"))
    age(storage2.location, ABANDONED_AFTER_S + 30)
    assert Flusher(stores2[0], storage2, 0, Pins()).remove_abandoned(deadline_s=ABANDONED_AFTER_S) == []


def test_a_resume_on_rank_0_removes_the_abandoned_flushes(store_dir, monkeypatch):
    """Wired where it runs: ``CheckpointManager.resume`` (rank 0, before the resume's first
    collective) removes an earlier run's abandoned flush and records it in the history."""
    monkeypatch.delenv("MLCHECKPOINT_FLUSH_DEADLINE", raising=False)  # the default's 25 s
    _, storage = abandoned_and_complete(store_dir)
    age(storage.location, ABANDONED_AFTER_S + 30)
    with CheckpointManager(storage.location, job_id=JOB, local_dir=os.path.join(store_dir, "shm"),
                           replication="none") as ckpt:
        assert ckpt.resume(zeros_like_state(both_ranks(2))).step == 2  # the complete flush
    assert not os.path.exists(storage.path(1)) and storage.complete_steps() == [2]
    events = read_history(os.path.join(store_dir, "shm", JOB))
    assert [e["folders"] for e in events if e["event"] == "flush_abandoned_removed"] == [[storage.path(1)]]


def test_a_preemption_flush_stays_for_the_other_parts_a_bounded_time(store_dir):
    """Rank 0 writes its part of step 1 while rank 1's is missing. Its preemption flush stays
    for the other parts ``wait_for_parts`` seconds after the notice: rank 1's part, written a
    second on (a notice that reached it later), completes the step; with none coming it
    leaves, the step incomplete, once those seconds are over (``0``: at once), not at the
    deadline: a rank that failed (an elastic restart stops the others) writes no part."""
    stores = [LocalStore(os.path.join(store_dir, f"node{n}"), JOB) for n in range(2)]
    save_two_ranks(1, stores)
    storage = PersistentStorage(os.path.join(store_dir, "persistent"))
    rank1 = Flusher(stores[1], storage, 1, Pins())

    def rank0(wait_for_parts: float) -> Flusher:
        return Flusher(stores[0], storage, 0, Pins(), wait_for_parts=wait_for_parts)

    t0 = time.monotonic()
    at_once = rank0(0).flush_and_stay(t0 + 30)
    assert (at_once.step, at_once.complete) == (1, False) and time.monotonic() - t0 < 1.5, at_once
    t0 = time.monotonic()
    bounded = rank0(1.5).flush_and_stay(t0 + 30)
    assert (bounded.step, bounded.complete) == (1, False), bounded
    assert 1.5 <= time.monotonic() - t0 < 10, time.monotonic() - t0

    other = threading.Timer(1.0, rank1.flush, args=(time.monotonic() + 30,))
    other.start()
    stayed = rank0(10).flush_and_stay(time.monotonic() + 30)  # rank 1's part comes 1 s on
    other.join()
    assert (stayed.step, stayed.complete) == (1, True), stayed
    assert storage.complete_steps() == [1]


def test_ranks_that_chose_different_steps_meet_in_one_while_they_stay(store_dir):
    """The ranks choose their step alone. Rank 1's node holds step 2 whole with its metadata,
    so rank 1 writes its part of step 2; rank 0's own shard of step 2 is not here (its save was
    still in flight at its notice) and it writes step 1. Staying for the other parts, each
    also writes its part of a step another rank wrote, where it holds its shard of that save:
    rank 1 joins step 1, which completes and loads. Before, neither step ever completed."""
    stores = [LocalStore(os.path.join(store_dir, f"node{n}"), JOB) for n in range(2)]
    save_two_ranks(1, stores)
    save_two_ranks(2, stores)
    stores[1].metadata.write_file(2, stores[0].metadata.read_file(2))
    stores[0].shards.retire(2, 0, keep_metadata=True)
    storage = PersistentStorage(os.path.join(store_dir, "persistent"))
    flushers = [Flusher(stores[r], storage, r, Pins(), wait_for_parts=20) for r in range(2)]
    results: dict[int, FlushResult] = {}
    rank0 = threading.Thread(target=lambda: results.update({0: flushers[0].flush_and_stay(
        time.monotonic() + 30)}))
    rank0.start()
    results[1] = flushers[1].flush_and_stay(time.monotonic() + 30)
    rank0.join()
    assert (results[0].parts, results[0].step, results[0].complete) == ([1], 1, True), results
    assert (results[1].parts, results[1].step, results[1].complete) == ([2, 1], 1, True), results
    assert storage.complete_steps() == [1]
    assert load_plain(storage.path(1), both_ranks(1)) == []


@pytest.mark.slow
@pytest.mark.parametrize("blind", [False, True])
def test_a_rank_stays_no_longer_for_the_part_of_a_rank_that_is_gone(store_dir, make_job, blind):
    """One rank wrote its part of step 1; the other rank's is missing. While the other rank's
    process lives (a notice that has not reached it yet), the first stays ``wait_for_parts``.
    Once it is SIGKILLed (its node lost: the demo's case, and an elastic restart's failed
    rank), the first asks its replication listener, finds nothing there, and leaves at once
    with the step incomplete, saying why, instead of staying out the 30 s it was given for a
    part that can never come. ``blind``: the flushing rank is rank 1, whose node lacks step 2's
    metadata, so it also wrote a part of step 2 not knowing its ranks: the ranks step 1's
    staged metadata names stand for them."""
    stores = [LocalStore(os.path.join(store_dir, f"node{n}"), JOB) for n in range(2)]
    steps = (1, 2) if blind else (1,)
    for step in steps:
        save_two_ranks(step, stores)
    mine, other = (1, 0) if blind else (0, 1)
    if blind:
        stores[1].metadata.write_file(1, stores[0].metadata.read_file(1))
    storage = PersistentStorage(os.path.join(store_dir, "persistent"))
    job = make_job(2)
    peers = job.endpoint(mine)
    proc = job.spawn(other, "serve")
    job.status(f"{other}.ready", proc)
    peers.rdzv.lookup("tcp", other)  # its address, known as a partner's is (only those are asked)

    def flush(wait_for_parts: float) -> FlushResult:
        return Flusher(stores[mine], storage, mine, Pins(), wait_for_parts=wait_for_parts,
                       peers=peers).flush_and_stay(time.monotonic() + 60)

    t0 = time.monotonic()
    alive = flush(1.5)
    assert (alive.parts, alive.complete) == (sorted(steps, reverse=True), False), alive
    assert "gone" not in alive.reason and time.monotonic() - t0 >= 1.5, alive  # it stayed

    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    gone = flush(30)
    assert (gone.parts, gone.complete) == (sorted(steps, reverse=True), False), gone
    for step in steps:
        assert f"step {step} lacks the part of rank {other}, gone" in gone.reason, gone
    assert time.monotonic() - t0 < 20, time.monotonic() - t0  # not the 30 s stay
    assert storage.complete_steps() == []


def test_a_flush_stays_until_the_deadline_for_a_step_a_rank_is_still_bringing_back(store_dir):
    """After a resume that left rank 1 bringing its shard of step 1 back (from rank 0's node,
    maybe), rank 0's flush stays until step 1 is complete, past ``wait_for_parts``: rank 1's
    part comes once its shard is back."""
    stores = [LocalStore(os.path.join(store_dir, f"node{n}"), JOB) for n in range(2)]
    save_two_ranks(1, stores)
    storage = PersistentStorage(os.path.join(store_dir, "persistent"))
    flushers = [Flusher(stores[r], storage, r, Pins(), wait_for_parts=0.5) for r in range(2)]
    flushers[0].after_resume(None, rebuilt_step=1)
    other = threading.Timer(1.5, flushers[1].flush, args=(time.monotonic() + 30,))
    other.start()
    stayed = flushers[0].flush_and_stay(time.monotonic() + 30)
    other.join()
    assert (stayed.step, stayed.complete) == (1, True), stayed
    assert storage.complete_steps() == [1]


def test_a_damaged_item_is_never_marked_whole(store_dir):
    """A byte flipped in memory after the save: the flush writes the file but its check fails,
    so no marker, no ``.metadata``, and the failure is in the result."""
    stores = [LocalStore(os.path.join(store_dir, f"node{n}"), JOB) for n in range(2)]
    save_two_ranks(1, stores)
    damage_shard(stores[0], 1, 0)
    storage = PersistentStorage(os.path.join(store_dir, "persistent"))
    result = Flusher(stores[0], storage, 0, Pins()).flush(time.monotonic() + 60)
    assert result.step is None and "checksum mismatch" in result.reason, result
    assert Flusher(stores[1], storage, 1, Pins()).flush(time.monotonic() + 60).complete is False
    assert storage.complete_steps() == []
    assert not any(n.startswith("part-00000") for _, _, files in os.walk(storage.path(1))
                   for n in files)


def test_sigterm_flushes_on_a_thread_then_runs_the_handler_that_was_there(store_dir):
    """SIGTERM to this process: the flush runs on ``mlckpt-flush`` and the previous handler
    (a user's) runs after it, on the main thread; ``close`` puts that handler back and the
    wakeup fd as it was."""
    calls: list[tuple[str, str]] = []

    def flush(deadline: float) -> FlushResult:
        time.sleep(0.2)
        calls.append(("flush", threading.current_thread().name))
        return FlushResult(step=7, complete=True)

    def user(signum, frame):
        calls.append(("user", threading.current_thread().name))

    before = signal.signal(signal.SIGTERM, user)
    wakeup = signal.set_wakeup_fd(-1)  # another test's manager may have left one
    signal.set_wakeup_fd(wakeup)
    try:
        p = Preemption(flush, deadline_s=10, on_sigterm=True, notice_file=None)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs at the next bytecode
        assert calls == [("flush", "mlckpt-flush"), ("user", "MainThread")], calls
        assert p.last is not None and p.last.step == 7
        p.close()
        assert signal.getsignal(signal.SIGTERM) is user
        assert signal.set_wakeup_fd(wakeup) == wakeup  # ours was taken back out
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_flush_during_a_resume_waits_for_the_step_it_loads(store_dir):
    """A flush that starts while a resume runs (``Flusher.resuming``) writes nothing until the
    resume is over: the step the resume is loading is what it is to write. Here step 1 lands
    in memory while the flush waits (as a load brings it), and the flush writes it."""
    stores = [LocalStore(os.path.join(store_dir, f"node{n}"), JOB) for n in range(2)]
    storage = PersistentStorage(os.path.join(store_dir, "persistent"))
    flusher = Flusher(stores[0], storage, 0, Pins())
    results: list[FlushResult] = []
    with flusher.resuming():
        waiting = threading.Thread(target=lambda: results.append(
            flusher.flush(time.monotonic() + 30)))
        waiting.start()
        time.sleep(0.5)
        assert waiting.is_alive() and not results
        save_two_ranks(1, stores)
    waiting.join(10)
    assert results and results[0].parts == [1], results


def test_a_sigterm_during_a_resume_runs_its_handler_once_the_resume_is_over(store_dir):
    """SIGTERM inside ``handler_after`` (where a resume runs): the flush starts at once, on its
    thread, but the handler that was there before (a user's) runs only when the block ends,
    after the flush, on the main thread. Before, the handler ran at once, inside the resume,
    and the process ended before it loaded what the flush was to write."""
    calls: list[tuple[str, str]] = []
    started, resumed = threading.Event(), threading.Event()

    def flush(deadline: float) -> FlushResult:  # as Flusher.resuming has it wait
        started.set()
        resumed.wait(max(0.0, deadline - time.monotonic()))
        calls.append(("flush", threading.current_thread().name))
        return FlushResult(step=7, complete=True)

    def user(signum, frame):
        calls.append(("user", threading.current_thread().name))

    before = signal.signal(signal.SIGTERM, user)
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    try:
        p = Preemption(flush, deadline_s=10, on_sigterm=True, notice_file=None)
        with p.handler_after():
            os.kill(os.getpid(), signal.SIGTERM)
            assert started.wait(5)
            time.sleep(0.2)  # bytecodes enough for the handler to have run, had it not waited
            calls.append(("resume", threading.current_thread().name))
            resumed.set()
        assert calls == [("resume", "MainThread"), ("flush", "mlckpt-flush"),
                         ("user", "MainThread")], calls
        p.close()

        # A resume that outlasts the deadline: the handler runs at it, inside the block.
        calls.clear()
        started.clear()
        resumed.clear()
        p = Preemption(flush, deadline_s=0.5, on_sigterm=True, notice_file=None)
        with p.handler_after():
            os.kill(os.getpid(), signal.SIGTERM)
            assert started.wait(5)
            t0 = time.monotonic()
            while not calls.count(("user", "MainThread")) and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            calls.append(("resume", threading.current_thread().name))
        assert calls == [("flush", "mlckpt-flush"), ("user", "MainThread"),
                         ("resume", "MainThread")], calls
        assert p.wait(time.monotonic()) is not None and p._served == p._requested == 1  # one flush
        p.close()
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_notice_file_starts_a_flush_and_training_goes_on(store_dir):
    notice = os.path.join(store_dir, "notice")
    ran = threading.Event()

    def flush(deadline: float) -> FlushResult:
        ran.set()
        return FlushResult()

    p = Preemption(flush, deadline_s=10, on_sigterm=False, notice_file=notice)
    try:
        assert not ran.wait(0.7)
        open(notice, "w").close()
        assert ran.wait(5)
    finally:
        p.close()


# A process whose main thread takes a second SIGTERM while its handler of the first one starts
# the flush (the demo's scheduler signals the whole process tree and torchrun forwards its own
# copy). Only the main thread's handler acts here (the notice thread is left out), so the
# second handler runs inside the first one, where it used to wait for the lock the first
# one held: the process hung until torchrun's SIGKILL, 30 s later.
SECOND_SIGTERM = r"""
import os, signal, threading, time
from mlcheckpoint.manager.flush import FlushResult
from mlcheckpoint.manager.preemption import Preemption

def flush(deadline):
    print("flushed", flush=True)
    return FlushResult(step=1, complete=True, parts=[1])

Preemption._watch = lambda self: self._closed.wait()
start = threading.Thread.start

def start_after_a_second_sigterm(self):
    if self.name == "mlckpt-flush":
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
        time.sleep(0.5)  # Python runs the second handler here, inside the first one
    start(self)

threading.Thread.start = start_after_a_second_sigterm
Preemption(flush, deadline_s=20, on_sigterm=True, notice_file=None)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(60)
print("SIGTERM did not end the process", flush=True)
"""


@pytest.mark.slow
def test_a_second_sigterm_during_the_handler_of_the_first_is_absorbed():
    """Two SIGTERMs at once: one flush, then the process ends by SIGTERM, within seconds."""
    proc = subprocess.run([sys.executable, "-c", SECOND_SIGTERM], capture_output=True, text=True,
                          timeout=30, check=False)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout.count("flushed") == 1, proc.stdout
