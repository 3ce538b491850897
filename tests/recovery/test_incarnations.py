"""Step numbers are not identities: runs of one job that reuse them, and steps saved twice.
Real torchrun jobs on two simulated nodes. (Damaged local copies beside intact replicas:
tests/jobs/test_scenarios.py.)

Launches of tests/workers/incarnation_job.py (each a fresh set of processes, 2 nodes x 1 rank):
  A  run A saves; "resave" saves step 5 twice with different bytes
  -- node 1 of "mixed" is copied aside (run A's memory) and both nodes wiped; node 1 of
     "resave" wiped --
  B  run B of "mixed" starts over and saves steps 1-3 again with other values; the rest resume
  -- node 1 of "mixed" comes back with run A's memory --
  C  "mixed" resumes again
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("whole_replicas")]

def launch(c: Cluster, table: dict[str, dict]) -> None:
    for fn in os.listdir(c.out_dir):
        os.unlink(os.path.join(c.out_dir, fn))
    specs = [dict(spec, job=c.sub_job(name)) for name, spec in table.items()]
    c.run("incarnation_job.py", json.dumps(specs), timeout=240)


def shard_ids(c: Cluster, node: int, name: str) -> dict[tuple[int, int], tuple[str, str, list]]:
    """(step, owner) -> (save id, run id, item checksums) of every committed shard on a node."""
    store = c.sub_job_store(node, name)
    try:
        out = {}
        for step, st in store.inventory.all().items():
            for owner in st.committed_ranks:
                m = store.shards.read_manifest(step, owner)
                out[(step, owner)] = (m.save_id, m.run_id, [it.checksum for it in m.items])
        return out
    finally:
        store.close()


@pytest.fixture(scope="module")
def run():
    with Cluster(2) as c:
        o: dict = {"c": c}
        launch(c, {"mixed": {"saves": [[1, 0], [2, 0], [3, 0]], "wait": True},
                   "resave": {"saves": [[4, 0], [5, 0], [5, 1]], "wait": True},
                   "skipped": {"skip": [6, 7, 8]}})
        o["resave_saves"] = c.sub_job_results("saves", "resave")
        o["skipped"] = c.sub_job_results("saves", "skipped")
        o["resave_ids"] = {n: shard_ids(c, n, "resave") for n in (0, 1)}
        o["mixed_a_ids"] = shard_ids(c, 1, "mixed")
        run_a_node1 = os.path.join(c.root, "run-a-node1")
        shutil.copytree(c.sub_job_dir(1, "mixed"), run_a_node1)
        for n in (0, 1):
            shutil.rmtree(c.sub_job_dir(n, "mixed"))
        shutil.rmtree(c.sub_job_dir(1, "resave"))

        launch(c, {"mixed": {"resume": True, "saves": [[1, 1], [2, 1], [3, 1]], "wait": True},
                   "resave": {"resume": True}})
        o["mixed_b_fresh"] = c.sub_job_results("resume", "mixed")
        o["resave"] = c.sub_job_results("resume", "resave")
        o["mixed_b_ids"] = {n: shard_ids(c, n, "mixed") for n in (0, 1)}
        shutil.rmtree(c.sub_job_dir(1, "mixed"))  # node 1 returns with run A's memory
        shutil.copytree(run_a_node1, c.sub_job_dir(1, "mixed"))

        launch(c, {"mixed": {"resume": True}})
        o["mixed"] = c.sub_job_results("resume", "mixed")
        o["mixed_after"] = {n: shard_ids(c, n, "mixed") for n in (0, 1)}
        yield o


def test_older_run_on_a_returning_node_is_never_mixed_in(run):
    """A node returning with an older run's copy of the same step numbers: the resume reads
    the current run's replica, never the old copy, which is then removed."""
    assert run["mixed_b_fresh"][0]["step"] is None  # both nodes were wiped: run B starts over
    a, b = run["mixed_a_ids"], run["mixed_b_ids"][0]
    assert {k[0] for k in a} == {k[0] for k in b} == {2, 3}  # the same step numbers, twice
    assert all(a[k][0] != b[k][0] for k in a)  # ...as different saves
    res = run["mixed"]
    assert sorted(res) == [0, 1]
    for rank, r in res.items():
        # every rank holds run B's step 3 exactly: rank 1's bytes came from node 0's replica,
        # not from the run-A copy of "step 3" on its own node
        assert r["step"] == 3 and r["salts"] == [1], (rank, r)
        assert "another run" in (r["reason"] or ""), r
    assert res[1]["source"] == "peer"
    # run A's files are gone from the returning node; only run B's remain
    run_b = {v[1] for v in run["mixed_b_ids"][0].values()}
    assert {v[1] for v in run["mixed_after"][1].values()} <= run_b, run["mixed_after"]


def test_step_saved_twice_is_replicated_again(run):
    """A step saved twice (a rollback) is replicated again: the partner holds the second
    save, not the first."""
    saves = run["resave_saves"]
    assert all(r["replicated"] == [True, True, True] for r in saves.values()), saves
    ids = run["resave_ids"]
    for owner in (0, 1):
        own, replica = ids[owner][(5, owner)], ids[1 - owner][(5, owner)]
        assert own == replica, (owner, own, replica)  # the partner holds the second save
    assert ids[0][(5, 0)][2] != ids[0][(4, 0)][2]


def test_step_saved_twice_resumes_its_second_version_after_losing_a_node(run):
    """After a node loss, a step saved twice resumes its second save from the peer."""
    res = run["resave"]
    for rank, r in res.items():
        assert r["step"] == 5 and r["salts"] == [1], (rank, r)
    assert res[1]["source"] == "peer"


def test_waiting_for_a_step_the_replicator_skipped_answers_at_once(run):
    """wait_replicated on a step the replicator skipped (superseded) answers False at once,
    not after its timeout."""
    for rank, r in run["skipped"].items():
        # 7 was superseded by 8 (found together), so it can never be protected; 8 is. 6 was
        # superseded too, and retired once 7 and 8 were saved (keep=2): its wait is answered
        # as soon as a newer step is named, not after the timeout.
        assert r["replicated"] == [False, False, True], (rank, r)
        assert max(r["seconds"][:2]) < 100, (rank, r)  # answered, not timed out (the wait is 120 s)
