"""A new user's restart mistakes on two real nodes (torchrun agents, 2 ranks each, TCP
replication), with no logging set up in the workers: a restart that forgot the job id, and a
restart that saves before resuming. One process, no process group: tests/recovery/test_first_week.py."""

from __future__ import annotations

import re

import pytest
from cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TIMEOUT = 240
QUIET = {"TEST_NO_LOGGING_SETUP": "1"}  # the workers never set logging up


def lines_with(c: Cluster, words: str) -> list[str]:
    return [line for node in c.nodes for line in node.log().splitlines() if words in line]


@pytest.fixture(scope="module")
def first_run():
    """Steps 0-5 saved under MLCHECKPOINT_JOB_ID=<the cluster's id> (persistent step 3);
    steps 4 and 5 stay in memory on both nodes, each node's own shards and its partner's."""
    with Cluster(2, 2) as c:
        c.run("restart_mixups.py", "first", timeout=TIMEOUT, env=QUIET)
        yield c


def test_a_restart_that_forgot_the_job_id_is_told_once(first_run):
    """A restart without the job id loads the persistent step and is told once, naming the
    job memory holds and the setting to use."""
    c = first_run
    c.clear_results()
    c.run("restart_mixups.py", "forgot", timeout=TIMEOUT, env={**QUIET, "MLCHECKPOINT_JOB_ID": ""})
    res = c.results("forgot")
    assert sorted(res) == [0, 1, 2, 3], c.logs()
    for rank, r in res.items():
        assert r["job_id"].startswith("dir-") and (r["step"], r["source"]) == (3, "persistent"), r
        assert r["match"], r
        for words in ("memory holds no checkpoint of this job", "loading persistent step 3",
                      f"{c.job_id} (newest step 5, on nodes 0, 1)", "MLCHECKPOINT_JOB_ID"):
            assert words in r["reason"], (rank, words, r["reason"])
    # One warning for the job (rank 0's), printed with no logging set up.
    warned = lines_with(c, f"but other jobs under local_dir do: {c.job_id}")
    assert len(warned) == 1, c.logs()
    assert "job_id=" in warned[0] and "This run loads persistent step 3" in warned[0]


def test_saving_before_resume_keeps_the_new_run_and_sets_the_earlier_one_aside(first_run):
    """A restart that saves before resume() keeps its own steps, sets the earlier run's
    aside on every node with one warning, and later resumes its own step."""
    c = first_run
    c.clear_results()
    c.run("restart_mixups.py", "skip", timeout=TIMEOUT, env=QUIET)
    res = c.results("skip")
    assert sorted(res) == [0, 1, 2, 3], c.logs()
    for rank, r in res.items():
        # Steps 0 and 1 of this run are kept; the earlier run's 4 and 5 (own shards and
        # replicas) are set aside on every node, not deleted, with whatever else of it a node
        # still held (e.g. an older step's metadata).
        assert r["memory"] == [0, 1] and {4, 5} <= set(r["orphans"]), (rank, r)
    warned = lines_with(c, "did not call resume()")
    assert len(warned) == 1, c.logs()
    assert re.search(r"node 0: steps [0-9, ]*4, 5; node 1: steps [0-9, ]*4, 5\)", warned[0]), warned

    c.clear_results()
    c.run("restart_mixups.py", "resume", timeout=TIMEOUT, env=QUIET)
    res = c.results("resume")
    assert sorted(res) == [0, 1, 2, 3], c.logs()
    for rank, r in res.items():  # this run's step 1, never the earlier run's step 5
        assert (r["step"], r["source"], r["match"]) == (1, "local", True), (rank, r)
