"""Real HSDP (issue 38): FSDP2 ``fully_shard`` on a 2-D device mesh, replicated across 2 nodes and
sharded over the 2 ranks of each, gloo on CPU (tests/workers/hsdp_train.py). Its saves keep a
copy of each shard on the other node, so nothing is replicated; a restart with both nodes
reads nothing from peers; a lost node resumes bit for bit from the other; and a 2 x 2 save
resumes onto 1 node x 2 ranks (resharded). Each check compares the full tensors of the model
and optimizer with those the training saved (rank 0 dumps them, collectively gathered).
"""

from __future__ import annotations

import os

import pytest
import torch
from cluster import Cluster

from mlcheckpoint import history
from mlcheckpoint.store import LocalStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LAST = 3  # hsdp_train.LAST
LAUNCH_TIMEOUT = 300


def resume(c: Cluster, nodes: list[int]) -> dict[int, dict]:
    c.clear_results("hsdp_resume")
    c.start("hsdp_train.py", "resume", nodes=nodes, nnodes=len(nodes))
    codes = c.wait(LAUNCH_TIMEOUT, nodes=nodes)
    assert not any(codes), c.logs()
    res = c.results("hsdp_resume")
    assert sorted(res) == list(range(len(nodes) * c.nproc)), c.logs()
    expected = torch.load(os.path.join(c.out_dir, "hsdp_expected.pt"))
    resumed = torch.load(os.path.join(c.out_dir, "hsdp_resumed.pt"))
    assert sorted(resumed) == sorted(expected)
    differ = [k for k in expected if not torch.equal(expected[k], resumed[k])]
    assert differ == [], differ
    for rep in res.values():
        assert rep["step"] == LAST, (rep, c.logs())
    return res


def sent_bytes(c: Cluster) -> int:
    total = 0
    for n in c.nodes:
        for e in history.read(LocalStore(n.local_dir, c.job_id, create=False).job_dir):
            if e["event"] == "replicate":
                total += e["bytes"]
    return total


def test_hsdp_on_a_2d_mesh_replicates_nothing_restarts_locally_and_survives_a_node():
    """HSDP on a 2 x 2 mesh: protected by copies with no replication, a restart reads only
    its own node, a lost node reads node 0's copies, and a 1 x 2 reshard loads."""
    with Cluster(2, 2) as c:
        c.run("hsdp_train.py", "save", timeout=LAUNCH_TIMEOUT)
        saved = c.results("hsdp_save")
        for r, rep in saved.items():
            assert rep["protected"] and rep["newest_protected"] == LAST, (r, rep, c.logs())
            assert rep["reason"] == "covered by data-parallel copies", (r, rep)
        assert sent_bytes(c) == 0

        # both nodes alive: every rank reads its shard of each item on its own node
        for r, rep in resume(c, [0, 1]).items():
            assert rep["bytes_fetched"] == 0 and rep["bytes_served"] == {}, (r, rep)
            assert set(rep["sources"].values()) == {"local"} and rep["reason"] is None, (r, rep)

        # node 1 lost: its ranks read node 0's copies; node 0's ranks read nothing from peers
        c.nodes[1].wipe()
        res = resume(c, [0, 1])
        sources = res[0]["sources"]
        assert (sources["0"], sources["1"]) == ("local", "local"), sources
        assert res[0]["bytes_fetched"] > 0
        assert {node for served in res[0]["bytes_served"].values() for node in served} == {"0"}

        # one node of two ranks: the 2 x 2 save resharded onto a 1 x 2 mesh
        for r, rep in resume(c, [0]).items():
            assert rep["resharded"] is True and rep["bytes_fetched"] == 0, (r, rep)
