"""De-duplicated staging in a real 2-node DDP-like job (tests/workers/dedup_job.py): each
rank stages, commits and replicates only the items DCP's plan gives it, also when the plan
changes under a stale prediction, and a node lost afterwards resumes bit for bit."""

import pytest
from cluster import Cluster
from helpers import wait_for

pytestmark = pytest.mark.slow

STEPS, CHANGED = 7, (3, 4)  # as in the worker


def test_ddp_job_stages_stores_and_replicates_only_its_planned_items_and_resumes_exactly():
    """A DDP job's saves stage, store and replicate only the items DCP's plan gives each
    rank (a stale plan is caught at commit), and a lost node resumes exactly."""
    with Cluster(nnodes=2, nproc=1) as c:
        c.start("dedup_job.py", "train")
        ready = wait_for(lambda: len(c.results("ready")) == 2 and c.results("ready"),
                         "every rank saved and replicated", timeout=240, diag=c.logs)
        saves = c.results("saves")
        c.nodes[1].kill()
        c.nodes[1].wipe()
        c.nodes[0].kill()
        c.run("dedup_job.py", "resume", timeout=240)
        res = c.results("resumed")
    for rank in (0, 1):
        for step in range(STEPS):
            s = saves[rank][str(step)]
            # every step loads back exactly what was saved, changed plans included
            assert s["checked"] > 0 and s["differs"] == [], (rank, step, s)
            # the shard holds the items the metadata assigns this rank, and nothing else
            # (beyond the 64-byte alignment of each item)
            assert s["referenced_end"] <= s["data_bytes"] <= s["referenced_aligned"], (rank, step, s)
            # replication sends exactly those bytes
            assert s["replicated_bytes"] in (None, s["data_bytes"]), (rank, step, s)
        for step in (1, 2, 6):  # steady steps: DCP splits the shared state between the ranks
            s = saves[rank][str(step)]
            assert s["data_bytes"] < 0.75 * s["state_bytes"], (rank, step, s)
            # the stage followed the previous plan: it copied only this rank's tensors
            assert s["staged_bytes"] == s["referenced_tensors"], (rank, step, s)
        assert saves[rank][str(STEPS - 1)]["replicated_bytes"] is not None, saves[rank]
        assert ready[rank]["replicated"], ready
    # At the first changed step rank 1's prediction was stale: the plan gave it every shared
    # item, the stage had copied half; the rest was copied at the commit (and loads exactly).
    first = saves[1][str(CHANGED[0])]
    assert first["staged_bytes"] < first["referenced_tensors"], first
    # After the change rank 1 staged everything and kept half (a trim that moved bytes).
    after = saves[1][str(CHANGED[1] + 1)]
    assert after["staged_bytes"] > after["referenced_tensors"], after
    for rank in (0, 1):  # node 1 was lost: rank 1's shard comes from node 0's replica
        r = res[rank]
        assert r["step"] == STEPS - 1 and r["sources"] == {"0": "local", "1": "peer"}, r
        assert r["digest"] == ready[rank]["digest"], (rank, r)
