"""Bytes from the nearest place, and a damaged copy that never costs a servable step (issue 38):
real torchrun jobs over simulated nodes, data parallel (tests/workers/dp_copies.py), whose
saves keep one copy of every item on every node and replicate nothing.

- one flipped byte in a primary, with an intact copy on another node, resumes the newest step
  (2 nodes, nothing lost; 3 nodes, a node lost too): the refused shard is retired, the node
  keeps the step's metadata, and the retry plans from what the nodes hold then;
- a restart with every node alive reads every item on its own node: 0 bytes from peers;
- a replaced node is the only one that reads from peers, and its reads spread over every
  node that holds the items.

The whole-state comparison (``mismatch``) is the worker's: every rank compares what it loaded
with the state it saved, bit for bit.

The two cases on 3 nodes share their launches: one saves both jobs (each its own job id, so
its own directory on every node), the test damages each job's directories its own way, and
one launch resumes both.
"""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
from cluster import Cluster
from helpers import flip_byte

from mlcheckpoint.store import LocalStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LAST = 2
LAUNCH_TIMEOUT = 240


def save(c: Cluster, layout: str = "ddp") -> None:
    c.run("dp_copies.py", layout, str(LAST), "sync", timeout=LAUNCH_TIMEOUT)
    res = c.results("copies")
    assert all(rep["protected"] for rep in res.values()), c.logs()


def resume(c: Cluster, layout: str = "ddp") -> dict[int, dict]:
    c.clear_results("resumed")
    c.run("dp_copies.py", layout, str(LAST), "sync", "resume", timeout=LAUNCH_TIMEOUT)
    res = c.results("resumed")
    assert sorted(res) == list(range(len(c.nodes) * c.nproc)), c.logs()
    for r, rep in res.items():
        assert rep["step"] == LAST and rep["mismatch"] == [], (r, rep, c.logs())
    return res


def locations(c: Cluster, node: int, step: int, name: str | None = None) -> dict:
    """The step's item locations, from node ``node``'s metadata."""
    st = c.store(node, name)
    try:
        _, payload = st.metadata.read(step)
    finally:
        st.close()
    return pickle.loads(payload).storage_data


def flip_item_of(c: Cluster, node: int, rank: int, step: int, name: str | None = None) -> str:
    """Flip one byte in the middle of the largest item ``rank`` is the primary of, in its
    shard on ``node``; returns the item's name."""
    index, loc = max(((i, loc) for i, loc in locations(c, node, step, name).items() if loc.rank == rank),
                     key=lambda kv: kv[1].nbytes)
    st = c.store(node, name)
    try:
        flip_byte(st.paths.data(step, rank), loc.offset + loc.nbytes // 2)
    finally:
        st.close()
    return index.fqn


THREE_NODE_JOBS = ("flipped_copy", "replaced")


@pytest.fixture(scope="module")
def three_nodes():
    """3 nodes x 1 rank, DDP: one launch saves both jobs; node 0 of ``flipped_copy`` is lost
    (a replacement starts empty) and a byte of an item of rank 1's flipped on its node 1;
    node 2 of ``replaced`` is replaced; one launch resumes both. Yields the cluster and each
    job's resume reports, every one checked bit-exact."""
    with Cluster(3, 1) as c:
        def launch(**extra) -> None:
            specs = [{"job": c.sub_job(name), "layout": "ddp", "last": LAST, **extra}
                     for name in THREE_NODE_JOBS]
            c.run("dp_copies.py", json.dumps(specs), timeout=2 * LAUNCH_TIMEOUT)

        launch()
        for name in THREE_NODE_JOBS:
            assert all(rep["protected"] for rep in c.sub_job_results("copies", name).values()), c.logs()
        shutil.rmtree(c.sub_job_dir(0, "flipped_copy"))
        flip_item_of(c, 1, 1, LAST, "flipped_copy")
        shutil.rmtree(c.sub_job_dir(2, "replaced"))
        launch(resume=True)
        resumed = {}
        for name in THREE_NODE_JOBS:
            res = resumed[name] = c.sub_job_results("resumed", name)
            assert sorted(res) == [0, 1, 2], c.logs()
            for r, rep in res.items():
                assert rep["step"] == LAST and rep["mismatch"] == [], (name, r, rep, c.logs())
        yield c, resumed


def test_a_flipped_primary_with_a_copy_on_the_other_node_resumes_the_newest_step():
    """2 nodes x 1 rank, nothing lost: node 0's copy of an item of rank 0's is refused, rank
    0's shard retired; node 0 then reads the step from node 1's copies, and rebuilds the shard
    from them after the load."""
    with Cluster(2, 1) as c:
        save(c)
        flip_item_of(c, 0, 0, LAST)
        res = resume(c)
        for rep in res.values():
            assert "checksum mismatch" in (rep["reason"] or ""), rep
        assert res[0]["sources"]["0"] == "copies", res[0]  # its shard was refused: read from copies
        assert res[0]["bytes_served"] == {"1": {"1": res[0]["bytes_fetched"]}}, res[0]
        assert "AssertionError" not in c.nodes[0].log() + c.nodes[1].log()
        # refused, then rebuilt after the load (the heal) from node 1's copies: it verifies
        # against the checksums the metadata recorded
        recorded = [loc for loc in locations(c, 0, LAST).values() if loc.rank == 0]
        store = LocalStore(c.nodes[0].local_dir, c.job_id, create=False)
        try:
            assert not store.verify_shard(LAST, 0, recorded).partial
        finally:
            store.close()
        assert f"rebuilt rank 0's shard of step {LAST}" in c.nodes[0].log(), c.logs()
        # close() did not wait out its 60 s drain (it once did, for the metadata of a
        # superseded step, which is never sent, after the own shard was refused)
        closed = c.results("closed")
        assert sorted(closed) == [0, 1] and all(r["close_s"] < 30 for r in closed.values()), closed


def test_a_flipped_copy_with_a_lost_node_resumes_from_the_copy_left(three_nodes):
    """3 nodes x 1 rank; node 0 lost (a replacement starts empty) and one byte of an item of
    rank 1's flipped on node 1: node 2's copies serve the step."""
    c, resumed = three_nodes
    for rep in resumed["flipped_copy"].values():
        assert "checksum mismatch" in (rep["reason"] or ""), rep
    assert "AssertionError" not in "".join(n.log() for n in c.nodes)


def test_a_restart_with_every_node_alive_reads_nothing_from_peers():
    """DDP 2 nodes x 2 ranks: every item is on both nodes (a primary or a copy), so every rank
    reads each item on its own node."""
    with Cluster(2, 2) as c:
        save(c)
        res = resume(c)
        for r, rep in res.items():
            assert rep["bytes_fetched"] == 0 and rep["bytes_served"] == {}, (r, rep)
            assert set(rep["sources"].values()) == {"local"}, (r, rep)
            assert rep["reason"] is None, (r, rep)


def test_a_replaced_node_alone_reads_from_peers_spread_over_the_holders(three_nodes):
    """DDP 3 nodes x 1 rank, node 2 replaced: nodes 0 and 1 read locally; node 2 reads each
    item from node 0 or node 1, about half its bytes from each."""
    _, resumed = three_nodes
    res = resumed["replaced"]
    sources = res[0]["sources"]
    assert (sources["0"], sources["1"]) == ("local", "local"), sources  # fetched nothing
    assert sources["2"] == "copies", sources
    by_node: dict[str, int] = {}
    for served in res[0]["bytes_served"].values():
        for node, nbytes in served.items():
            by_node[node] = by_node.get(node, 0) + nbytes
    assert sorted(by_node) == ["0", "1"], res[0]["bytes_served"]
    total = res[0]["bytes_fetched"]
    assert sum(by_node.values()) == total > 0
    # whole items are dealt, largest first: each holder serves between a quarter and three
    assert all(total / 4 <= n <= 3 * total / 4 for n in by_node.values()), by_node
