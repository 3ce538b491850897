"""The claim on a job directory (store/claim.py): the ranks of one run share it, another live
run is refused and told who holds it, a refused take changes nothing, a dead holder (SIGKILL,
also with a forked child still running) blocks nobody, and the record says whose steps these
are. A whole job's claim, agreed by every rank: tests/test_claiming.py, tests/jobs/test_job_claim.py."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import put_step, snapshot

from mlcheckpoint.store.claim import Claimant, JobClaim, Refusal, holder, unclaimed

JOB = "job-claim"


def claimant(run: str, persistent: str | None = "/p/a", pid: int = 1000) -> Claimant:
    return Claimant(run, "host-x", (pid,), time.time(), persistent)


def take(store, run: str, persistent: str | None = "/p/a", pid: int = 1000, **kw) -> JobClaim | Refusal:
    return JobClaim.take(store.paths, claimant(run, persistent, pid), **kw)


def test_the_ranks_of_one_run_share_the_claim_and_another_run_is_refused_naming_it(store):
    a0, a1 = take(store, "run-a", pid=11), take(store, "run-a", pid=12)
    assert isinstance(a0, JobClaim) and isinstance(a1, JobClaim)
    refused = take(store, "run-b", "/p/b", pid=21)
    assert isinstance(refused, Refusal) and refused.reason == "live"
    assert refused.holder is not None and refused.job_dir == store.job_dir
    assert (refused.holder.run_id, refused.holder.pids, refused.holder.persistent_dir) == \
        ("run-a", (11, 12), "/p/a")
    said = refused.holder.describe()
    for words in ("run run-a", "host host-x", "pids 11, 12", "started ", "persistent_dir /p/a"):
        assert words in said, said
    a0.release()
    assert isinstance(take(store, "run-b", "/p/b"), Refusal)  # one rank of run-a is enough
    a1.release()
    a1.release()  # idempotent
    b = take(store, "run-b", "/p/b")  # nothing saved here: another persistent folder is fine
    assert isinstance(b, JobClaim) and b.moved_from is None
    b.release()


def test_a_refused_take_changes_nothing_in_the_directory(store):
    put_step(store, 3)
    a = take(store, "run-a")
    assert isinstance(a, JobClaim)
    before = snapshot(store.job_dir)
    assert isinstance(take(store, "run-b"), Refusal)
    assert isinstance(take(store, "run-b", "/p/b"), Refusal)
    assert snapshot(store.job_dir) == before
    a.release()
    before = snapshot(store.job_dir)
    moved = take(store, "run-b", "/p/b")  # no run is live, but the steps are run-a's
    assert isinstance(moved, Refusal) and moved.reason == "moved"
    assert snapshot(store.job_dir) == before


def test_steps_saved_with_another_persistent_folder_are_refused_unless_accepted(store):
    a = take(store, "run-a")
    assert isinstance(a, JobClaim)
    put_step(store, 3)
    put_step(store, 4)
    a.release()
    moved = take(store, "run-b", "/p/b")
    assert isinstance(moved, Refusal) and moved.reason == "moved"
    assert moved.steps == (3, 4) and moved.holder is not None
    assert (moved.holder.run_id, moved.holder.persistent_dir) == ("run-a", "/p/a")
    again = take(store, "run-a2")  # the same folder: a restart of the job, accepted
    assert isinstance(again, JobClaim) and again.moved_from is None
    again.release()
    accepted = take(store, "run-b", "/p/b", accept_moved=True)
    assert isinstance(accepted, JobClaim)
    assert accepted.moved_from is not None and accepted.moved_from.persistent_dir == "/p/a"
    accepted.release()
    later = take(store, "run-c", "/p/b")  # the record now names the folder the job moved to
    assert isinstance(later, JobClaim)
    later.release()


def test_a_run_that_withdraws_leaves_the_record_of_the_run_before_it(store):
    put_step(store, 3)
    a = take(store, "run-a")
    assert isinstance(a, JobClaim)
    a.release()
    b0, b1 = take(store, "run-b", pid=21), take(store, "run-b", pid=22)
    assert isinstance(b0, JobClaim) and isinstance(b1, JobClaim)
    b0.withdraw()
    assert holder(store.paths)[0].run_id == "run-b"  # its other rank still holds it
    b1.withdraw()
    named, live = holder(store.paths)
    assert not live and named is not None and named.run_id == "run-a"


def test_the_listing_says_who_holds_the_directory_and_creates_nothing(store):
    assert holder(store.paths) == (None, False)
    assert not os.path.exists(store.paths.claim) and not os.path.exists(store.paths.claim_lock)
    a = take(store, "run-a", pid=11)
    assert isinstance(a, JobClaim)
    named, live = holder(store.paths)
    assert live and named is not None and named.pids == (11,)
    assert isinstance(take(store, "run-a", pid=12), JobClaim)  # a listing blocks no join
    a.release()
    gc.collect()  # the second share was never kept: collected, it is released too
    named, live = holder(store.paths)
    assert not live and named is not None and named.pids == (11, 12)


def test_a_claim_whose_record_cannot_be_read_still_refuses_another_run(store):
    a = take(store, "run-a")
    assert isinstance(a, JobClaim)
    with open(store.paths.claim, "w") as f:
        f.write('{"run_id": "run-a", "pi')  # torn
    refused = take(store, "run-a")  # not even its own run can tell it is one of them
    assert isinstance(refused, Refusal) and refused.reason == "live" and refused.holder is None
    a.release()
    assert isinstance(take(store, "run-b"), JobClaim)  # a torn record of a dead run: no check
    assert Claimant.from_json({"run_id": "x"}) is None and Claimant.from_json([1]) is None


def test_a_record_of_bytes_that_are_no_text_reads_as_unreadable_not_a_crash(store):
    # A damaged claim.json (bytes that are no UTF-8) made every listing and every take raise
    # UnicodeDecodeError: ls, gc and a restarting job's start all read it.
    a = take(store, "run-a")
    assert isinstance(a, JobClaim)
    a.release()
    with open(store.paths.claim, "wb") as f:
        f.write(bytes([0xA7, 0xFB, 0x00, 0x9C]) * 16)
    assert holder(store.paths) == (None, False)
    b = take(store, "run-b")
    assert isinstance(b, JobClaim)  # no live run holds it: the next run takes it, and rewrites it
    named, live = holder(store.paths)
    assert live and named is not None and named.run_id == "run-b"
    b.release()


# ---------------------------------------------------------------- dead holders (processes)

HOLDER = textwrap.dedent("""
    import os, sys, time
    from mlcheckpoint.store.claim import Claimant, JobClaim
    from mlcheckpoint.store.layout import JobPaths
    claim = JobClaim.take(JobPaths(sys.argv[1]), Claimant("run-a", "h", (os.getpid(),), time.time(), "/p/a"))
    assert isinstance(claim, JobClaim), claim
    child = os.fork() if sys.argv[2] == "fork" else 0
    if sys.argv[2] == "fork" and child == 0:
        time.sleep(120)  # a data-loader worker, still running when its parent is killed
        os._exit(0)
    print("held", child, flush=True)
    time.sleep(120)
""")


@pytest.mark.slow
@pytest.mark.parametrize("fork", ["no fork", "fork"])
def test_a_sigkilled_holder_never_blocks_the_next_run(store, fork):
    """The kernel drops the flock with the holder; a child forked from it (a data-loader
    worker outliving its parent for a moment) does not keep the claim alive."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, store.job_dir, fork],
                            stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["held"], line
        child = int(line[1])
        refused = take(store, "run-b")
        assert isinstance(refused, Refusal) and refused.holder.pids == (proc.pid,)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if child:
            os.kill(child, 0)  # the forked child is still alive
        b = take(store, "run-b")
        assert isinstance(b, JobClaim), b
        b.release()
    finally:
        for pid in (proc.pid, child):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait(timeout=30)
        if child:
            for _ in range(200):  # the orphaned child is reaped by init
                try:
                    os.kill(child, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)


def test_what_deletes_looks_at_the_claim_first_a_live_run_is_named_a_dead_one_is_not(store):
    """``unclaimed``, what ``mlcheckpoint gc`` asks before it deletes (issue 42): the refusal
    naming the live run, through the same look as ``holder``; nothing once it released."""
    with unclaimed(store.paths) as nobody:  # never claimed
        assert nobody is None
    a = take(store, "run-a", pid=11)
    assert isinstance(a, JobClaim)
    with unclaimed(store.paths) as live:
        assert isinstance(live, Refusal) and live.reason == "live" and live.job_dir == store.job_dir
        assert live.holder is not None and (live.holder.run_id, live.holder.pids) == ("run-a", (11,))
    a.release()
    with unclaimed(store.paths) as gone:
        assert gone is None
    assert holder(store.paths)[1] is False
