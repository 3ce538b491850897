"""Copies made by data parallelism count as copies: real torchrun jobs over simulated nodes.

A DDP job across nodes holds every item on every node; a save keeps one copy of each item per
node (``dcp/copies.py``), so the step is protected with no replication traffic. A replica that
differs is no copy (its owner's shard is sent); FSDP's unique shards are sent as before; HSDP
sends nothing across replica groups; a node without room for its copies falls back to
replication. The test process reads each node's history (what replication sent) and metadata
(which copies were recorded) itself.
"""

from __future__ import annotations

import pickle

import pytest
from cluster import Cluster

from mlcheckpoint import LocalStore, history

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LAST = 2
LAUNCH_TIMEOUT = 180


def run(c: Cluster, layout: str, mode: str = "sync", env: dict | None = None) -> dict[int, dict]:
    c.run("dp_copies.py", layout, str(LAST), mode, timeout=LAUNCH_TIMEOUT, env=env)
    res = c.results("copies")
    assert sorted(res) == list(range(len(c.nodes) * c.nproc)), c.logs()
    for r, rep in res.items():
        assert rep["protected"] is True, f"rank {r}: step {LAST} never protected; {c.logs()}"
        assert rep["newest_protected"] == LAST, (r, rep)
    return res


def sent_bytes(c: Cluster, step: int) -> dict[int, int]:
    """Per rank, the shard bytes replication sent for ``step`` (every node's history)."""
    out: dict[int, int] = {}
    for n in c.nodes:
        for e in history.read(LocalStore(n.local_dir, c.job_id, create=False).job_dir):
            if e["event"] == "replicate" and e["step"] == step:
                out[e["rank"]] = out.get(e["rank"], 0) + e["bytes"]
    return out


def metadata(c: Cluster, node: int, step: int):
    _, payload = LocalStore(c.nodes[node].local_dir, c.job_id, create=False).read_metadata(step)
    return pickle.loads(payload)


def shard_bytes(c: Cluster, node: int, step: int, rank: int) -> int:
    return LocalStore(c.nodes[node].local_dir, c.job_id, create=False).read_manifest(step, rank).data_bytes


@pytest.mark.parametrize("nproc,mode", [(1, "sync"), (2, "async"), (1, "dcp")],
                         ids=["2x1-save", "2x2-async_save", "2x1-dcp-native"])
def test_ddp_protected_with_no_replication_bytes(nproc, mode):
    with Cluster(2, nproc) as c:
        res = run(c, "ddp", mode)
        world = 2 * nproc
        sent = sent_bytes(c, LAST)
        assert sent == dict.fromkeys(range(world), 0), sent
        for rep in res.values():
            assert rep["state"] == "replicated" and rep["reason"] == "covered by data-parallel copies", rep
            assert rep["stats"]["mlcheckpoint/dp_copies_nodes"] == 2.0, rep["stats"]
            assert rep["stats"]["mlcheckpoint/replication_skipped_bytes"] > 0, rep["stats"]
            # nothing was pushed: no replication rate to report
            assert "mlcheckpoint/replication_bytes_per_second" not in rep["stats"], rep["stats"]
        # every item's primary has an agreeing copy on the other node, named in the metadata
        md = metadata(c, 0, LAST)
        for index, loc in md.storage_data.items():
            nodes = {loc.rank // nproc} | {r // nproc for r, _ in loc.copies}
            assert nodes == {0, 1}, (index, loc)
        # a node stores each replicated item once (not once per rank)
        for index, loc in md.storage_data.items():
            assert len(loc.copies) == 1, (index, loc)


def test_replicas_that_differ_are_no_copies():
    with Cluster(2, 1) as c:
        run(c, "differ")
        md = metadata(c, 0, LAST)
        (w,) = [loc for index, loc in md.storage_data.items() if index.fqn == "model.w"]
        assert w.copies == (), w  # rank 1 perturbed it: the copy disagrees, not recorded
        others = [loc for index, loc in md.storage_data.items() if index.fqn != "model.w"]
        assert others and all(len(loc.copies) == 1 for loc in others), others
        sent = sent_bytes(c, LAST)
        owner = w.rank  # its shard is sent whole; the other rank's is covered
        assert sent[owner] == shard_bytes(c, owner, LAST, owner) > 0, sent
        assert sent[1 - owner] == 0, sent
        assert "differ between data-parallel replicas" in c.nodes[0].log(), c.logs()


def test_fsdp_sends_its_own_shards():
    with Cluster(2, 1) as c:
        res = run(c, "fsdp")
        sent = sent_bytes(c, LAST)
        for r in range(2):
            assert sent[r] == shard_bytes(c, r, LAST, r) > 0, sent
            assert res[r]["reason"] is None, res[r]
            stats = res[r]["stats"]  # no node held an item of another's: none kept, none skipped
            assert (stats["mlcheckpoint/dp_copies_nodes"], stats["mlcheckpoint/dedup_nodes"],
                    stats["mlcheckpoint/replication_skipped_bytes"]) == (0, 0, 0), stats
        assert all(not loc.copies for loc in metadata(c, 0, LAST).storage_data.values())


def test_hsdp_sends_nothing_across_replica_groups():
    with Cluster(2, 2) as c:
        run(c, "hsdp")
        assert sent_bytes(c, LAST) == dict.fromkeys(range(4), 0)
        md = metadata(c, 1, LAST)
        for index, loc in md.storage_data.items():
            # shard k lives on local rank k of each node: the copy is on the other node's
            assert [loc.rank % 2] + [r % 2 for r, _ in loc.copies] == [loc.rank % 2] * 2, (index, loc)


def test_too_little_room_falls_back_to_replication():
    # A step is ~512 KiB: each node ~256 KiB of its own items, as much again of its
    # partner's replicas or of copies. With keep=1 a node's room per step is a third of the
    # limit (kept, protected and in-flight steps: room.step_room); copies are only kept where
    # the node's own items, its partner's replicas and the copies fit (768 KiB, not in
    # 2 MiB / 3); replication as before (~1.7 MiB at its peak) does fit.
    limit = 2048 * 1024
    with Cluster(2, 1) as c:
        res = run(c, "ddp", env={"TEST_MEMORY_LIMIT": str(limit), "TEST_KEEP": "1"})
        for rep in res.values():
            assert rep["stats"]["mlcheckpoint/dedup_nodes"] == 2.0, rep["stats"]
            assert rep["reason"] is None, rep
        sent = sent_bytes(c, LAST)
        assert all(sent[r] == shard_bytes(c, r, LAST, r) > 0 for r in range(2)), sent
        assert "too little room for its copies" in c.nodes[0].log(), c.logs()
        assert all(not loc.copies for loc in metadata(c, 0, LAST).storage_data.values())


def test_lost_node_resumes_from_the_copies_on_the_other():
    """DDP over 2 nodes, nothing replicated; node 1 is lost (SIGKILL, memory wiped): the
    resume reads the items DCP gave rank 1 from node 0's copies, bit-exact."""
    with Cluster(2, 1) as c:
        run(c, "ddp")
        assert sent_bytes(c, LAST) == {0: 0, 1: 0}
        c.nodes[1].kill()
        c.nodes[1].wipe()
        c.run("dp_copies.py", "ddp", str(LAST), "sync", "resume", timeout=LAUNCH_TIMEOUT)
        res = c.results("resumed")
        for r, rep in res.items():
            assert rep["step"] == LAST and rep["mismatch"] == [], (r, rep, c.logs())
        # rank 1's shard was on no node: its items came from the copies in rank 0's
        assert res[0]["sources"]["1"] == "copies", res[0]
