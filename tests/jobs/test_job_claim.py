"""One live run per job directory, with real torchrun jobs of 2 ranks per node (replication
off): a second job launched with the same job id and local_dir while the first runs is refused
on every rank, also on its nodes the first does not use, naming the first run; the first's
files are untouched and it goes on saving. A SIGKILLed run's restart is accepted and resumes
its step, and a restart with another persistent folder is refused on every rank unless the
move is accepted. In one process: tests/test_claiming.py; the claim: tests/store/test_claim.py."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
from cluster import Cluster
from helpers import snapshot, wait_for

from mlcheckpoint.store.claim import holder
from mlcheckpoint.store.layout import JobPaths

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TIMEOUT = 240


def held(c: Cluster, tag: str, ranks: int) -> dict[int, dict]:
    """Wait until every rank of ``c`` reported "held-<tag>" (it saved and waits)."""
    def ready():
        if not c.running():
            pytest.fail(f"the run ended before it held:\n{c.logs()}")
        got = c.results(f"held-{tag}")
        return len(got) == ranks and got
    return wait_for(ready, f"{ranks} ranks holding", timeout=TIMEOUT, diag=c.logs)


def go(c: Cluster, tag: str) -> None:
    with open(os.path.join(c.out_dir, f"go-{tag}"), "w"):
        pass


def test_a_second_job_in_a_live_runs_directory_is_refused_on_every_rank_and_the_first_goes_on():
    """A second job started in a live run's job directory is refused on every rank, naming
    the holder; the first run's files are untouched and it finishes."""
    with Cluster(1, 2) as first:
        first.start("claim_job.py", "train", "a", "7", "3")  # steps 0-3, then holds
        a, b = (r["pid"] for r in held(first, "a", 2).values())
        job_dir = os.path.join(first.nodes[0].local_dir, first.job_id)
        before = snapshot(job_dir)
        with Cluster(2, 2, job_id=first.job_id) as second:
            second.nodes[0].local_dir = first.nodes[0].local_dir  # the first job's node
            # A job of one node, that node; then one of two nodes whose node 1 the first job
            # does not use: its ranks there get in, and must still fail with the others.
            second.run("claim_job.py", "second", "one", nodes=[0], nnodes=1, timeout=TIMEOUT)
            second.run("claim_job.py", "second", "two", timeout=TIMEOUT)
            for tag, ranks in (("one", 2), ("two", 4)):
                res = second.results(f"second-{tag}")
                assert sorted(res) == list(range(ranks)), second.logs()
                for rank, r in res.items():
                    assert r["error"] == "JobDirInUseError", (tag, rank, r)
                    said = r["message"]
                    assert re.search(rf"pids ({a}, {b}|{b}, {a})", said), (tag, rank, said)
                    for words in (f"job directory {job_dir} on node 0",
                                  f"host {socket.gethostname()}", "started ",
                                  f"persistent_dir {first.persistent_dir}",
                                  "MLCHECKPOINT_JOB_ID", "MLCHECKPOINT_LOCAL_DIR"):
                        assert words in said, (tag, rank, words, said)
                print(f"{tag}: refused in {max(r['seconds'] for r in res.values()):.2f} s")
            # Node 1 of the second job holds no claim and names no run: it withdrew.
            node1 = JobPaths(os.path.join(second.nodes[1].local_dir, second.job_id))
            assert holder(node1) == (None, False)
        assert snapshot(job_dir) == before  # nothing of the first run's was touched
        go(first, "a")
        assert first.wait(TIMEOUT) == [0], first.logs()
        for rank, r in first.results("done-a").items():  # it saved on, and set nothing aside
            assert (r["memory"][-2:], r["orphans"]) == ([6, 7], []), (rank, r)


def test_a_sigkilled_run_never_blocks_its_restart_which_resumes_its_step():
    """A SIGKILLed run leaves no claim that blocks its restart: the restart resumes step 4
    from local memory and saves on."""
    with Cluster(1, 2) as c:
        c.start("claim_job.py", "train", "killed", "9", "4")  # steps 0-4, then holds
        held(c, "killed", 2)
        c.nodes[0].kill()  # SIGKILL: the agent and both ranks; their flocks go with them
        c.run("claim_job.py", "train", "again", "6", "-1", timeout=TIMEOUT)
        for rank, r in c.results("resumed-again").items():
            assert (r["step"], r["source"], r["match"]) == (4, "local", True), (rank, r)
        for rank, r in c.results("done-again").items():
            assert r["memory"][-2:] == [5, 6], (rank, r)


def test_a_restart_with_another_persistent_folder_is_refused_on_every_rank_unless_accepted():
    """A restart naming another persistent folder is refused on every rank, saying how to
    accept it; accepted, it resumes from memory and warns once per node."""
    with Cluster(1, 2) as c:
        c.run("claim_job.py", "train", "a", "3", "-1", timeout=TIMEOUT)
        moved = os.path.join(c.root, "moved")
        env = {"TEST_PERSISTENT_DIR": moved}
        c.run("claim_job.py", "second", "moved", env=env, timeout=TIMEOUT)
        res = c.results("second-moved")
        assert sorted(res) == [0, 1], c.logs()
        for rank, r in res.items():
            assert r["error"] == "ConfigError", (rank, r)
            for words in ("holds steps 2, 3", f"persistent_dir was {c.persistent_dir}",
                          f"this run's persistent_dir is {moved}",
                          "MLCHECKPOINT_PERSISTENT_DIR_MOVED=1"):
                assert words in r["message"], (rank, words, r["message"])
        c.run("claim_job.py", "train", "b", "5", "-1", timeout=TIMEOUT,
              env={**env, "MLCHECKPOINT_PERSISTENT_DIR_MOVED": "1"})
        for rank, r in c.results("resumed-b").items():
            assert (r["step"], r["source"], r["match"]) == (3, "local", True), (rank, r)
        warned = [line for line in c.nodes[0].log().splitlines()
                  if "MLCHECKPOINT_PERSISTENT_DIR_MOVED=1)" in line]
        # Once per node: from the rank that took the claim over from the earlier run.
        assert len(warned) == 1 and moved in warned[0] and c.persistent_dir in warned[0], warned


def test_gc_remove_refuses_a_live_runs_directory_naming_it_and_proceeds_once_it_died():
    """Issue 42: ``gc --remove`` under a live run printed "removed" and deleted its files.
    Now it exits 4 naming the run (its pids, from the claim's record) and leaves every file;
    once the run is SIGKILLed, the same command removes the directory."""
    with Cluster(1, 2) as c:
        c.start("claim_job.py", "train", "gc", "9", "2")  # steps 0-2, then holds
        a, b = (r["pid"] for r in held(c, "gc", 2).values())
        local = c.nodes[0].local_dir
        job_dir = os.path.join(local, c.job_id)
        before = snapshot(job_dir)
        argv = [sys.executable, "-m", "mlcheckpoint.cli", "--local-dir", local, "gc", "--job",
                c.job_id, "--remove"]
        refused = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert refused.returncode == 4, (refused.stdout, refused.stderr)
        assert "removed" not in refused.stdout, refused.stdout
        said = refused.stderr
        assert f"job {c.job_id}: not touched: {job_dir} is in use by run " in said, said
        assert re.search(rf"pids ({a}, {b}|{b}, {a})", said), said
        assert snapshot(job_dir) == before  # nothing of the live run's was touched
        c.nodes[0].kill()  # SIGKILL: the agent and both ranks; their flocks go with them
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert (done.returncode, done.stdout.strip()) == (0, f"job {c.job_id}: removed"), done
        assert not os.path.exists(job_dir)
