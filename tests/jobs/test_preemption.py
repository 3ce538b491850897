"""A whole-job preemption keeps what memory held (issue 42, item 5): real torchrun agents,
SIGTERM to every node's agent mid-training (torchrun forwards it to its ranks and SIGKILLs
them 30 s later), memory wiped, a restart on "new machines" (tests/workers/preempt_job.py).

Before the flush: the ranks died at once and the restart resumed persistent step 10, losing
every step saved since.
"""

from __future__ import annotations

import glob
import os
import signal
import time
import warnings

import pytest
import torch.distributed.checkpoint as dcp
from cluster import Cluster
from states import differences, make_state, zeros_like_state
from torch.distributed.checkpoint import FileSystemReader

from mlcheckpoint import PersistentStorage
from mlcheckpoint.manager.flush import ABANDONED_AFTER_S

pytestmark = pytest.mark.slow

SIGKILLED = "forcefully exiting via"  # torchrun's words when the grace period ran out


def train_until(c: Cluster, step: int, timeout: float = 180) -> dict[int, dict]:
    """Wait until every rank saved ``step`` and persistent step 10 is complete; the ranks'
    last progress reports."""
    deadline = time.monotonic() + timeout
    storage = PersistentStorage(c.persistent_dir)
    while time.monotonic() < deadline:
        progress = c.results("progress")
        if (len(progress) == c.nnodes * c.nproc and min(p["step"] for p in progress.values()) >= step
                and 10 in storage.complete_steps()):
            return progress
        assert c.running() == list(range(c.nnodes)), c.logs()
        time.sleep(0.1)
    raise AssertionError(f"the job did not reach step {step}:\n{c.logs()}")


def preempt(c: Cluster, timeout: float = 60) -> float:
    """SIGTERM to every node's torchrun agent, as a scheduler's notice; the seconds until
    every agent had ended."""
    t0 = time.monotonic()
    for node in c.nodes:
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
    c.wait(timeout)
    return time.monotonic() - t0


def expected_state(step: int, ranks: int) -> dict:
    """Every rank's state of ``step`` in one dict (the shared entries are equal on all)."""
    sd: dict = {}
    for r in range(ranks):
        sd.update(make_state(step, r))
    return sd


def load_plain(path: str, step: int, ranks: int) -> list[str]:
    """Load a persistent step as any DCP user would (no process group, no mlcheckpoint):
    where it differs from what the ranks saved."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        assert b"mlcheckpoint" not in f.read()  # nothing of ours needed to read it
    want = expected_state(step, ranks)
    got = zeros_like_state(want)
    with warnings.catch_warnings():  # DCP says it loads in one process: it does
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(got, storage_reader=FileSystemReader(path), no_dist=True)
    return differences(want, got)


def test_sigterm_to_every_agent_flushes_the_newest_step_and_a_restart_resumes_it():
    """2 nodes x 2 ranks, a RAM save every step and a persistent one every 10. SIGTERM to both
    agents past step 14: every rank writes its part of the newest step memory held whole, the
    step is complete (at least the newest protected one at the notice), loads with plain
    ``dcp.load``, and a restart with every node's memory wiped resumes it exactly. Rank 1's own
    SIGTERM handler ran after the flush; the others died of SIGTERM's default action; all
    within torchrun's grace period."""
    with Cluster(nnodes=2, nproc=2) as c:
        c.start("preempt_job.py", "train", env={"TEST_USER_HANDLER": "1"})
        progress = train_until(c, 14)
        protected = min((p["protected"] for p in progress.values() if p["protected"] is not None),
                        default=-1)
        seconds = preempt(c)
        log = "".join(n.log() for n in c.nodes)
        assert SIGKILLED not in log, log[-6000:]  # every rank ended within the grace period
        steps = PersistentStorage(c.persistent_dir).complete_steps()
        flushed = steps[-1]
        assert flushed > 10 and flushed >= max(protected, 14), (steps, protected, c.logs())
        assert c.results("user_handler") == {1: {"rank": 1, "signal": signal.SIGTERM}}
        assert seconds < 25, seconds
        path = PersistentStorage(c.persistent_dir).path(flushed)
        assert sorted(glob.glob(f"{path}/__*_flush-*.distcp")), os.listdir(path)
        assert load_plain(path, flushed, 4) == []

        for node in c.nodes:  # new machines: nothing in memory
            node.wipe()
        c.clear_results()
        c.run("preempt_job.py", "resume", timeout=180)
        res = c.results("resume")
        assert sorted(res) == [0, 1, 2, 3], c.logs()
        for r in res.values():
            assert (r["step"], r["source"], r["mismatch"]) == (flushed, "persistent", []), r


def test_ranks_stuck_in_a_collective_flush_and_end_as_sigterm_would():
    """2 nodes x 1 rank; rank 1 goes quiet, so rank 0's main thread waits in the training
    ``all_reduce`` (in C++, where Python runs no signal handler). SIGTERM: rank 0's flush starts
    from the wakeup fd on a thread of its own, and once it is written that thread ends the
    process as SIGTERM would have (rank 1's own handler takes 8 s, so the collective does not
    fail before); the step is complete and loads."""
    with Cluster(nnodes=2, nproc=1) as c:
        stall = os.path.join(c.root, "stall")
        c.start("preempt_job.py", "train", env={"TEST_STALL_FILE": stall, "TEST_USER_HANDLER": "1",
                                                "TEST_HANDLER_SECONDS": "8"})
        train_until(c, 12)
        open(stall, "w").close()
        time.sleep(1.0)  # rank 1 is quiet, rank 0 inside all_reduce
        last = max(p["step"] for p in c.results("progress").values())
        t0 = time.monotonic()
        for node in c.nodes:
            assert node.proc is not None
            node.proc.send_signal(signal.SIGTERM)
        assert c.wait(60, nodes=[0]) is not None
        assert time.monotonic() - t0 < 6, c.logs()  # rank 0 ended well before rank 1's handler did
        c.wait(60)
        log = c.nodes[0].log()
        assert "the main thread did not take SIGTERM" in log, log[-6000:]
        assert SIGKILLED not in log + c.nodes[1].log(), c.logs()
        assert c.results("user_handler") == {1: {"rank": 1, "signal": signal.SIGTERM}}
        flushed = PersistentStorage(c.persistent_dir).complete_steps()[-1]
        assert flushed >= last - 1 and flushed > 10, (flushed, last)
        assert load_plain(PersistentStorage(c.persistent_dir).path(flushed), flushed, 2) == []


def test_a_flush_cut_off_by_sigkill_leaves_the_older_persistent_step_chosen():
    """2 nodes x 1 rank. Rank 1's flush is held before its part is marked whole, rank 0's
    (notified once rank 1 is held) finishes; then SIGKILL (the grace period ran out). The new step's folder is there but not
    complete: the restart, with memory wiped, resumes persistent step 10, which plain
    ``dcp.load`` still reads. The unfinished folder stays through that restart (a flush may
    still be writing it) and goes at a start once it has been still for long enough."""
    with Cluster(nnodes=2, nproc=1) as c:
        hold = os.path.join(c.root, "hold")
        c.start("preempt_job.py", "train", env={"MLCHECKPOINT_PAUSE_AT": f"flush_part#1={hold}"})
        train_until(c, 12)
        # Node 1's notice first, node 0's once rank 1 is held: had rank 0 flushed and ended
        # before node 1's agent took its SIGTERM (a loaded machine delays it), rank 1's
        # collective would have failed first and it would never flush.
        agents = [node.proc for node in c.nodes]
        assert agents[0] is not None and agents[1] is not None
        agents[1].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{hold}.reached"):
            assert time.monotonic() < deadline, c.logs()
            time.sleep(0.05)
        agents[0].send_signal(signal.SIGTERM)
        storage = PersistentStorage(c.persistent_dir)
        markers = glob.glob(f"{c.persistent_dir}/step-*/.mlcheckpoint-flush/*/part-00000.json")
        deadline = time.monotonic() + 30
        while not markers:  # rank 0's part is whole
            assert time.monotonic() < deadline, c.logs()
            time.sleep(0.05)
            markers = glob.glob(f"{c.persistent_dir}/step-*/.mlcheckpoint-flush/*/part-00000.json")
        c.kill_all()  # SIGKILL, mid-flush
        assert storage.complete_steps()[-1] == 10, os.listdir(c.persistent_dir)
        assert max(int(n.removeprefix("step-")) for n in os.listdir(c.persistent_dir)) > 10

        for node in c.nodes:
            node.wipe()
        c.run("preempt_job.py", "resume", timeout=180)
        res = c.results("resume")
        for r in res.values():
            assert (r["step"], r["source"], r["mismatch"]) == (10, "persistent", []), r
        assert load_plain(storage.path(10), 10, 2) == []

        # The unfinished folder stays while a flush might still write it; a start once it has
        # been still for ABANDONED_AFTER_S removes it, and only it.
        unfinished = [p for p in glob.glob(f"{c.persistent_dir}/step-*")
                      if not os.path.exists(os.path.join(p, ".metadata"))]
        assert unfinished, os.listdir(c.persistent_dir)
        then = time.time() - ABANDONED_AFTER_S - 60
        for root, dirs, files in os.walk(c.persistent_dir):
            for entry in [root, *(os.path.join(root, n) for n in files + dirs)]:
                os.utime(entry, (then, then))
        c.run("preempt_job.py", "resume", timeout=180, env={"MLCHECKPOINT_FLUSH_DEADLINE": "25"})
        assert not [p for p in unfinished if os.path.exists(p)], (
            [(os.path.relpath(os.path.join(root, n), c.persistent_dir),
              round(time.time() - os.lstat(os.path.join(root, n)).st_mtime))
             for root, dirs, files in os.walk(c.persistent_dir) for n in files + dirs], c.logs())
        assert storage.complete_steps()[-1] == 10 and load_plain(storage.path(10), 10, 2) == []


def test_notices_seconds_apart_still_flush_every_part():
    """2 nodes x 1 rank; node 0's notice first. Rank 0 writes its part and, the step not being
    complete, stays (``MLCHECKPOINT_FLUSH_WAIT_FOR_PARTS``, 10 s); rank 1, not yet notified,
    waits for it in the training ``all_reduce``. Node 1's notice a second later finds rank 1
    alive: it writes its part, the step is complete and loads with plain ``dcp.load``, and both
    ranks end within the grace period. Before, rank 0 left once its part was written, its exit
    failed rank 1's collective, rank 1 died without a part, and the restart went back to
    persistent step 10."""
    with Cluster(nnodes=2, nproc=1) as c:
        c.start("preempt_job.py", "train")
        train_until(c, 12)
        agents = [node.proc for node in c.nodes]
        assert agents[0] is not None and agents[1] is not None
        agents[0].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not (glob.glob(f"{c.persistent_dir}/step-*/.mlcheckpoint-flush/*/part-00000.json")
                   and "staying up to" in c.nodes[0].log()):
            assert time.monotonic() < deadline, c.logs()
            time.sleep(0.05)
        time.sleep(1.0)  # seconds apart: rank 0's own flush is long over
        assert c.running() == [0, 1], c.logs()
        agents[1].send_signal(signal.SIGTERM)
        c.wait(60)
        assert SIGKILLED not in c.nodes[0].log() + c.nodes[1].log(), c.logs()
        assert "the other ranks' parts came" in c.nodes[0].log(), c.logs()
        storage = PersistentStorage(c.persistent_dir)
        flushed = storage.complete_steps()[-1]
        assert flushed >= 12, (storage.complete_steps(), c.logs())
        assert load_plain(storage.path(flushed), flushed, 2) == []


def protected_then_node_1_lost(c: Cluster) -> int:
    """Train 2 x 1 past step 12 protected on both nodes, then lose node 1 (SIGKILL, memory
    wiped) with the job; the newest step protected then."""
    c.start("preempt_job.py", "train")
    progress = train_until(c, 12)
    while min(p["protected"] or -1 for p in progress.values()) < 12:  # on both nodes
        assert c.running() == [0, 1], c.logs()
        time.sleep(0.05)
        progress = c.results("progress")
    c.kill_all()  # node 1 lost, the job stopped with it
    c.nodes[1].wipe()
    return min(p["protected"] for p in c.results("progress").values())


def resumes_on_new_machines(c: Cluster, step: int) -> None:
    """Every node wiped (new machines): the restart resumes ``step`` from the persistent
    folder, exactly."""
    for node in c.nodes:
        node.wipe()
    c.clear_results()
    c.run("preempt_job.py", "resume", timeout=180)
    for r in c.results("resume").values():
        assert (r["step"], r["source"], r["mismatch"]) == (step, "persistent", []), r


def test_a_preemption_while_a_replaced_node_heals_flushes_the_step_it_loaded():
    """2 nodes x 1 rank. Training passes step 12 (persistent step 10), node 1 is lost (SIGKILL,
    memory wiped) and the job restarts: rank 1 loads the newest step from node 0's replica and
    brings its own shard of it back in the background (held here until the test lets it go).
    A whole-job preemption comes before the first step: rank 1's flush waits for its shard and
    rank 0's process stays (within the deadline) while rank 1 reads it from node 0's memory, so
    the loaded step is complete in the persistent folder, and a restart on new machines
    resumes it exactly. Before: rank 1 had no part to write and rank 0's process ended at
    once, so the restart went back to step 10, losing every step since.

    The restart runs with an explicit replication budget of 500 B/s, which paces a heal (the
    shard, about 17 kB, would take 30 s, past the 25 s deadline): node 0 serves it at the
    link's speed once its own notice came (``Budget.hurried``). Before, the heal stayed
    paced, rank 1's flush ran out of time, and the restart went back to step 10."""
    with Cluster(nnodes=2, nproc=1) as c:
        protected_then_node_1_lost(c)
        hold = os.path.join(c.root, "heal")
        c.clear_results()
        c.start("preempt_job.py", "resume_hold", env={"MLCHECKPOINT_PAUSE_AT": f"heal_rebuild#1={hold}",
                                                      "MLCHECKPOINT_REPLICATION_BANDWIDTH": "500"})
        deadline = time.monotonic() + 120
        while len(c.results("resume")) < 2 or not os.path.exists(f"{hold}.reached"):
            assert time.monotonic() < deadline and c.running() == [0, 1], c.logs()
            time.sleep(0.05)
        res = c.results("resume")
        loaded = res[0]["step"]
        assert loaded > 10 and res[1]["step"] == loaded and res[1]["own"] in ("peer", "copies"), res
        for node in c.nodes:
            assert node.proc is not None
            node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        # Rank 0's part is written, and rank 1's flush waits for its shard: only then may it come.
        while not (glob.glob(f"{c.persistent_dir}/step-*/.mlcheckpoint-flush/*/part-00000.json")
                   and "rank 1 waits for its own shard" in c.nodes[1].log()):
            assert time.monotonic() < deadline, c.logs()
            time.sleep(0.05)
        open(hold, "w").close()
        c.wait(60)
        storage = PersistentStorage(c.persistent_dir)
        assert storage.complete_steps()[-1] == loaded, (storage.complete_steps(), c.logs())
        assert load_plain(storage.path(loaded), loaded, 2) == []

        resumes_on_new_machines(c, loaded)


def test_a_preemption_during_the_load_after_a_node_was_replaced_flushes_the_step_loaded():
    """2 nodes x 1 rank. As above, node 1 is lost after step 12 and the job restarts, but the
    whole-job preemption comes while the ranks are still loading (rank 1 held before its
    load). Each rank's flush waits for the resume, SIGTERM's handler waits until the resume is
    over, and rank 1's flush then waits for its own shard to come back: the step loaded is
    complete in the persistent folder, and a restart on new machines resumes it. Before, rank
    1's handler ended it inside the load, with no part written, and the restart went back to
    step 10."""
    with Cluster(nnodes=2, nproc=1) as c:
        protected = protected_then_node_1_lost(c)
        hold = os.path.join(c.root, "load")
        c.clear_results()
        c.start("preempt_job.py", "resume_hold", env={"MLCHECKPOINT_PAUSE_AT": f"resume_load#1={hold}"})
        deadline = time.monotonic() + 120
        while not os.path.exists(f"{hold}.reached"):
            assert time.monotonic() < deadline and c.running() == [0, 1], c.logs()
            time.sleep(0.05)
        for node in c.nodes:
            assert node.proc is not None
            node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        # Both flushes wait for the resume: only then may rank 1 load.
        while not all(f"rank {n.index} waits for the resume in flight" in n.log() for n in c.nodes):
            assert time.monotonic() < deadline and c.running() == [0, 1], c.logs()
            time.sleep(0.05)
        open(hold, "w").close()
        c.wait(60)
        assert "rank 1 waits for its own shard" in c.nodes[1].log(), c.logs()
        storage = PersistentStorage(c.persistent_dir)
        newest = storage.complete_steps()[-1]
        assert newest >= protected, (storage.complete_steps(), protected, c.logs())
        assert load_plain(storage.path(newest), newest, 2) == []

        resumes_on_new_machines(c, newest)


def test_opted_out_no_flush():
    """``MLCHECKPOINT_PREEMPTION_FLUSH=0``: SIGTERM ends the ranks as it always did; nothing
    newer than persistent step 10 is written."""
    with Cluster(nnodes=1, nproc=1) as c:
        c.start("preempt_job.py", "train", env={"MLCHECKPOINT_PREEMPTION_FLUSH": "0"})
        train_until(c, 12)
        preempt(c)
        assert sorted(os.listdir(c.persistent_dir)) == ["step-000000000000", "step-000000000010"]
        assert "preemption notice" not in c.nodes[0].log()
