"""More than one partner with real processes: four simulated nodes, ``replicas=2``.

Losing two nodes that keep each other's replicas (nodes 0 and 1, wiped as replacement
machines) resumes from memory with two partners, while the same job with one partner (pairs
0<->1, 2<->3) has lost both copies of their shards. After saving again, losing one node
leaves its shard on its two partners, and the replaced node reads it from both (the spread
reads of recovery/holders.py), as ``ResumeInfo.bytes_served`` says.
"""

from __future__ import annotations

import json

import pytest
from cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TWO = {"replicas": 2, "layers": 4}  # several items per shard: whole items are dealt to holders


def launch(c: Cluster, table: dict[str, dict]) -> None:
    c.clear_results()
    specs = json.dumps([dict(spec, job=c.sub_job(name)) for name, spec in table.items()])
    c.run("elastic_job.py", specs, timeout=240)


def test_two_partners_survive_two_lost_nodes_and_reads_spread_over_both():
    """replicas=2: two lost nodes still resume from memory (replicas=1 does not), and a lost
    node's shard is read from both its holders."""
    with Cluster(4) as c:
        launch(c, {"two": dict(TWO, first=1, last=3), "one": {"first": 1, "last": 3}})
        saved = {name: c.sub_job_results("acked", name) for name in ("two", "one")}
        logs = c.logs()
        for node in (0, 1):
            c.nodes[node].wipe()
        launch(c, {"two": dict(TWO, first=4, last=5), "one": {"first": 1, "last": 0}})
        after_two = {name: c.sub_job_results("resume", name) for name in ("two", "one")}
        resaved = c.sub_job_results("acked", "two")
        logs_two = c.logs()
        c.nodes[0].wipe()
        launch(c, {"two": dict(TWO, first=1, last=0)})
        after_one = c.sub_job_results("resume", "two")

    for name in ("two", "one"):
        assert all(r["steps"] == [1, 2, 3] for r in saved[name].values()), (name, saved, logs[-6000:])
    assert "node 0 replicates to node 1, node 3" in logs, logs[-6000:]

    # nodes 0 and 1 lost: with two partners every shard survived, with one it did not
    two, one = after_two["two"], after_two["one"]
    assert sorted(two) == [0, 1, 2, 3], logs_two[-8000:]
    for rank, r in two.items():
        assert r["step"] == 3 and r["match"] and not r["mismatch"], (rank, r)
        assert r["source"] == "peer", (rank, r)
    for rank, r in one.items():
        assert r["step"] is None, (rank, r)
    assert all(r["steps"] == [4, 5] for r in resaved.values()), (resaved, logs_two[-8000:])

    # node 0 lost: its shard is on nodes 1 and 3, and it reads from both
    assert sorted(after_one) == [0, 1, 2, 3], c.logs()[-6000:]
    for rank, r in after_one.items():
        assert r["step"] == 5 and r["match"] and not r["mismatch"], (rank, r)
    # Every rank says the same, job-wide: rank 0's shard came from both its holders (1 and 3),
    # in whole items (4 layers dealt to 2 holders), and from no other node. The deal evens out
    # the bytes each node serves the reader over every shard it reads (dcp/remote.py), so a
    # holder that also serves it another shard's item (the replicated values, saved once in
    # rank 3's shard) sends less of this one: the shares of one shard need not be even.
    served = after_one[0]["served"]
    assert all(r["served"] == served for r in after_one.values()), after_one
    own = served["0"]
    assert set(own) == {"1", "3"} and min(own.values()) > 0, served
    assert sum(b for by_node in served.values() for b in by_node.values()) == after_one[0]["bytes_fetched"]
