"""Copies made by data parallelism count as copies: real torchrun jobs over simulated nodes.

A DDP job across nodes holds every item on every node; a save keeps one copy of each item per
node (``dcp/copies.py``), so the step is protected with no replication traffic. A replica that
differs is no copy (its owner's shard is sent); FSDP's unique shards are sent as before; HSDP
sends nothing across replica groups; a node without room for its copies falls back to
replication. The test process reads each node's history (what replication sent) and metadata
(which copies were recorded) itself.

To keep launches few, the jobs that need no setting of their own share a launch: one cluster
of 2 nodes x 1 rank saves six of them, each as its own job (own job id, so own directory on
every node), one after the other, and one of 2 x 2 saves three; the tests then read each
job's directories, and the two that lose a node wipe that job's directory on it and resume
it alone. The jobs with a setting of their own (a memory limit, copies off, DCP's process
mode) launch alone.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
from cluster import Cluster

from mlcheckpoint import history

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LAST = 2
LAUNCH_TIMEOUT = 180


def run(c: Cluster, layout: str, mode: str = "sync", env: dict | None = None) -> dict[int, dict]:
    """One launch saving ``layout`` as the cluster's own job; every rank's report."""
    c.run("dp_copies.py", layout, str(LAST), mode, timeout=LAUNCH_TIMEOUT, env=env)
    return checked(c, c.results("copies"))


def checked(c: Cluster, res: dict[int, dict]) -> dict[int, dict]:
    assert sorted(res) == list(range(len(c.nodes) * c.nproc)), c.logs()
    for r, rep in res.items():
        assert rep["protected"] is True, f"rank {r}: step {LAST} never protected; {c.logs()}"
        assert rep["newest_protected"] == LAST, (r, rep)
    return res


# Jobs saved in one launch (name -> spec; tests/workers/dp_copies.py runs them in turn).
TWO_BY_ONE = {"ddp": {"layout": "ddp"}, "ddp_dcp": {"layout": "ddp", "mode": "dcp"},
              "differ": {"layout": "differ"}, "fsdp": {"layout": "fsdp"},
              "mixed": {"layout": "mixed"}, "lost": {"layout": "ddp"}}
TWO_BY_TWO = {"ddp_async": {"layout": "ddp", "mode": "async"}, "hsdp": {"layout": "hsdp"},
              "ddp_rng": {"layout": "ddp_rng", "mode": "async"}}


def launch(c: Cluster, table: dict[str, dict], **extra) -> None:
    """One launch running each job of ``table`` in turn, as ``<cluster job id>-<name>``."""
    specs = [dict(spec, job=c.sub_job(name), last=LAST, **extra) for name, spec in table.items()]
    c.run("dp_copies.py", json.dumps(specs), timeout=2 * LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def two_by_one():
    with Cluster(2, 1) as c:
        launch(c, TWO_BY_ONE)
        yield c


@pytest.fixture(scope="module")
def two_by_two():
    with Cluster(2, 2) as c:
        launch(c, TWO_BY_TWO)
        yield c


def saved(c: Cluster, name: str) -> dict[int, dict]:
    """Every rank's report of job ``name``'s save, checked protected."""
    return checked(c, c.sub_job_results("copies", name))


def resumed(c: Cluster, name: str) -> dict[int, dict]:
    """Resume job ``name`` alone in a fresh launch; every rank's report."""
    job = c.sub_job(name)
    c.clear_results(f"resumed-{job}", f"closed-{job}")
    launch(c, {name: {"layout": {**TWO_BY_ONE, **TWO_BY_TWO}[name]["layout"]}}, resume=True)
    res = c.sub_job_results("resumed", name)
    assert sorted(res) == list(range(len(c.nodes) * c.nproc)), c.logs()
    return res


def sent_bytes(c: Cluster, step: int, name: str | None = None) -> dict[int, int]:
    """Per rank, the shard bytes replication sent for ``step`` (every node's history)."""
    out: dict[int, int] = {}
    for n in range(len(c.nodes)):
        for e in history.read(c.store(n, name).job_dir):
            if e["event"] == "replicate" and e["step"] == step:
                out[e["rank"]] = out.get(e["rank"], 0) + e["bytes"]
    return out


def metadata(c: Cluster, node: int, step: int, name: str | None = None):
    _, payload = c.store(node, name).metadata.read(step)
    return pickle.loads(payload)


def shard_bytes(c: Cluster, node: int, step: int, rank: int, name: str | None = None) -> int:
    return c.store(node, name).shards.read_manifest(step, rank).data_bytes


@pytest.mark.parametrize("cluster,name", [("two_by_one", "ddp"), ("two_by_two", "ddp_async"),
                                          ("two_by_one", "ddp_dcp")],
                         ids=["2x1-save", "2x2-async_save", "2x1-dcp-native"])
def test_ddp_protected_with_no_replication_bytes(request, cluster, name):
    """DDP across 2 nodes (save, async_save, DCP-native): the step is protected by the copies
    data parallelism keeps, recorded in the metadata, and replication sends nothing."""
    c: Cluster = request.getfixturevalue(cluster)
    nproc = c.nproc
    res = saved(c, name)
    world = 2 * nproc
    sent = sent_bytes(c, LAST, name)
    assert sent == dict.fromkeys(range(world), 0), sent
    for rep in res.values():
        assert rep["state"] == "replicated" and rep["reason"] == "covered by data-parallel copies", rep
        assert rep["stats"]["mlcheckpoint/dp_copies_nodes"] == 2.0, rep["stats"]
        assert rep["stats"]["mlcheckpoint/replication_skipped_bytes"] > 0, rep["stats"]
        # nothing was pushed: no replication rate to report
        assert "mlcheckpoint/replication_bytes_per_second" not in rep["stats"], rep["stats"]
    # every item's primary has an agreeing copy on the other node, named in the metadata
    md = metadata(c, 0, LAST, name)
    for index, loc in md.storage_data.items():
        nodes = {loc.rank // nproc} | {r // nproc for r, _ in loc.copies}
        assert nodes == {0, 1}, (index, loc)
    # a node stores each replicated item once (not once per rank)
    for index, loc in md.storage_data.items():
        assert len(loc.copies) == 1, (index, loc)


def test_replicas_that_differ_are_no_copies(two_by_one):
    """An item that differs between the data-parallel ranks is no copy: it alone is sent
    (with a warning); recording a disagreeing copy would fail here."""
    c = two_by_one
    saved(c, "differ")
    md = metadata(c, 0, LAST, "differ")
    (w,) = [loc for index, loc in md.storage_data.items() if index.fqn == "model.w"]
    assert w.copies == (), w  # rank 1 perturbed it: the copy disagrees, not recorded
    others = [loc for index, loc in md.storage_data.items() if index.fqn != "model.w"]
    assert others and all(len(loc.copies) == 1 for loc in others), others
    sent = sent_bytes(c, LAST, "differ")
    owner = w.rank  # that item alone is sent; the other rank's shard is covered
    assert sent[owner] == w.nbytes > 0, sent
    assert sent[1 - owner] == 0, sent
    # (the launch's log holds every job's: this layout is the one whose replicas differ)
    assert "differ between data-parallel replicas" in c.nodes[0].log(), c.logs()


def test_fsdp_sends_its_own_shards(two_by_one):
    """FSDP's unique shards hold no copies: each rank's whole shard is replicated, as
    without data-parallel copies."""
    c = two_by_one
    res = saved(c, "fsdp")
    sent = sent_bytes(c, LAST, "fsdp")
    for r in range(2):
        assert sent[r] == shard_bytes(c, r, LAST, r, "fsdp") > 0, sent
        assert res[r]["reason"] is None, res[r]
        stats = res[r]["stats"]  # no node held an item of another's: none kept, none skipped
        assert (stats["mlcheckpoint/dp_copies_nodes"], stats["mlcheckpoint/dedup_nodes"],
                stats["mlcheckpoint/replication_skipped_bytes"]) == (0, 0, 0), stats
    assert all(not loc.copies for loc in metadata(c, 0, LAST, "fsdp").storage_data.values())


def test_hsdp_sends_nothing_across_replica_groups(two_by_two):
    """HSDP (2 x 2): each shard's copy is on the other node's same local rank, so nothing
    is sent across replica groups."""
    c = two_by_two
    saved(c, "hsdp")
    assert sent_bytes(c, LAST, "hsdp") == dict.fromkeys(range(4), 0)
    md = metadata(c, 1, LAST, "hsdp")
    for index, loc in md.storage_data.items():
        # shard k lives on local rank k of each node: the copy is on the other node's
        assert [loc.rank % 2] + [r % 2 for r, _ in loc.copies] == [loc.rank % 2] * 2, (index, loc)


def test_too_little_room_falls_back_to_replication():
    # DDP over 4 nodes: a step is ~1 MiB (TEST_SCALE=2). With copies a node holds all of it
    # (a quarter its own, the rest copies); with replication a quarter of its own and its
    # partner's quarter. With keep=1 a node's room per step is a third of the limit (kept,
    # protected and in-flight steps: tmpfs.step_room): 2.5 MiB / 3 has no room for the
    # copies, and replication as before does fit.
    """A node without room for the copies (a small memory limit) falls back to replicating
    its whole shards, and says so once."""
    limit = 2560 * 1024
    with Cluster(4, 1) as c:
        res = run(c, "ddp", env={"TEST_MEMORY_LIMIT": str(limit), "TEST_KEEP": "1",
                                 "TEST_SCALE": "2"})
        for rep in res.values():
            assert rep["stats"]["mlcheckpoint/dedup_nodes"] == 4.0, rep["stats"]
            assert rep["reason"] is None, rep
        sent = sent_bytes(c, LAST)
        assert all(sent[r] == shard_bytes(c, r, LAST, r) > 0 for r in range(4)), sent
        assert "too little room for its copies" in c.nodes[0].log(), c.logs()
        assert all(not loc.copies for loc in metadata(c, 0, LAST).storage_data.values())


def test_lost_node_resumes_from_the_copies_on_the_other(two_by_one):
    """DDP over 2 nodes, nothing replicated; node 1 is lost (memory wiped, a fresh launch):
    the resume reads the items DCP gave rank 1 from node 0's copies, bit-exact."""
    c = two_by_one
    saved(c, "lost")
    assert sent_bytes(c, LAST, "lost") == {0: 0, 1: 0}
    shutil.rmtree(c.sub_job_dir(1, "lost"))
    res = resumed(c, "lost")
    for r, rep in res.items():
        assert rep["step"] == LAST and rep["mismatch"] == [], (r, rep, c.logs())
    # rank 1's shard was on no node: its items came from the copies in rank 0's
    assert res[0]["sources"]["1"] == "copies", res[0]


# ---------------------------------------------------------------------------- per item (issue 38)
def entries(md, rank: int, prefix: tuple[str, ...]) -> list:
    """``rank``'s primary items of the metadata whose key starts with ``prefix``."""
    return [loc for index, loc in md.storage_data.items()
            if loc.rank == rank and index.fqn.startswith(prefix)]


def allocated(c: Cluster, node: int, step: int, rank: int, name: str) -> int:
    """The memory (pages) the data file of rank's shard of job ``name`` takes on ``node``."""
    return os.stat(c.store(node, name).paths.data(step, rank)).st_blocks * 512


def test_ddp_with_per_rank_entries_sends_only_those_entries(two_by_two):
    """DDP on 2 nodes x 2 ranks, each rank with its own RNG state and data loader position
    beside the identical model: each rank sends exactly its own entries' bytes, the partner
    stores them alone (at their offsets, the rest holes), the step is protected; node 1 lost
    and wiped, every rank resumes the step bit for bit."""
    c, name = two_by_two, "ddp_rng"
    res = saved(c, name)
    md = metadata(c, 0, LAST, name)
    sent = sent_bytes(c, LAST, name)
    for r in range(4):
        own = entries(md, r, ("rng.", "loader."))  # (the loader's dict: an item per entry)
        assert len(own) == 3 and sent[r] == sum(loc.nbytes for loc in own) > 5000, (r, sent, own)
        rep = res[r]
        assert rep["sent"] == sent[r], rep
        assert rep["state"] == "replicated" and rep["reason"] is None, rep
        assert rep["stats"]["mlcheckpoint/dp_copies_nodes"] == 2.0, rep["stats"]
        partner = 1 - r // 2
        replica = c.store(partner, name).shards.read_manifest(LAST, r)
        assert replica.partial and sorted(it.offset for it in replica.items) == \
            sorted(loc.offset for loc in own), replica
        # a node stores an item once: the model's items are there as copies, not again
        assert allocated(c, partner, LAST, r, name) <= 2 * 4096 + sent[r], allocated(c, partner, LAST, r, name)
    # every node alive: each rank reads its items where its node holds them (its shard, a
    # copy in its neighbour's), never from the partial replica's holes, nor from a peer
    intact = resumed(c, name)
    for r, rep in intact.items():
        assert rep["step"] == LAST and rep["mismatch"] == [], (r, rep, c.logs())
        assert rep["bytes_fetched"] == 0, (r, rep)
    shutil.rmtree(c.sub_job_dir(1, name))  # node 1 lost: a replacement starts empty
    again = resumed(c, name)
    for r, rep in again.items():
        assert rep["step"] == LAST and rep["mismatch"] == [], (r, rep, c.logs())
    # ranks 2 and 3's shards are whole on no node: their items came from the copies in
    # ranks 0 and 1's shards and from the partial replicas of their own entries
    assert again[0]["sources"]["2"] == "copies", again[0]


def test_fsdp_with_one_uncovered_item_sends_that_item_only(two_by_one):
    """FSDP with replicated parameters, 2 nodes: the replicated ones have copies on the other
    node; each rank's own shard of the sharded weight is the one item that lacks a place, and
    the only one sent."""
    c, name = two_by_one, "mixed"
    saved(c, name)
    md = metadata(c, 0, LAST, name)
    sent = sent_bytes(c, LAST, name)
    for r in range(2):
        (w,) = entries(md, r, (f"rank{r}.",))
        assert sent[r] == w.nbytes, (r, sent, w)
        assert shard_bytes(c, r, LAST, r, name) > w.nbytes  # the shard holds more than what was sent


def test_copies_off_replicates_whole_shards():
    """``MLCHECKPOINT_DP_COPIES=off``: no copies are kept, every shard goes whole, as before
    copies existed; the step is protected all the same."""
    with Cluster(2, 1) as c:
        res = run(c, "ddp_rng", env={"MLCHECKPOINT_DP_COPIES": "off"})
        sent = sent_bytes(c, LAST)
        assert all(sent[r] == shard_bytes(c, r, LAST, r) > 0 for r in range(2)), sent
        assert all(not loc.copies for loc in metadata(c, 0, LAST).storage_data.values())
        for rep in res.values():
            assert rep["reason"] is None, rep
            assert "mlcheckpoint/dp_copies_nodes" not in rep["stats"], rep["stats"]


def test_stats_name_the_copies_in_dcp_process_mode():
    """dcp.async_save in DCP's PROCESS mode: the writer chooses the copies in DCP's checkpoint
    process, yet stats() in the trainer says which nodes keep them."""
    with Cluster(2, 1) as c:
        res = run(c, "ddp", "process")
        assert sent_bytes(c, LAST) == {0: 0, 1: 0}
        for rep in res.values():
            assert rep["stats"]["mlcheckpoint/dp_copies_nodes"] == 2.0, rep["stats"]
            assert rep["stats"]["mlcheckpoint/dedup_nodes"] == 0.0, rep["stats"]
            assert rep["stats"]["mlcheckpoint/replication_skipped_bytes"] > 0, rep["stats"]


def test_room_is_kept_for_what_replicas_bring_not_for_whole_shards():
    """An unguarded async_save stages the whole state (4 MiB per rank here) and used to keep
    as much again for the partner's replica; with copies only the partner's own entries
    arrive, so 2 x 2 ranks save, keep copies and are protected under a 28 MiB limit (where
    every save after the first was refused with CapacityError)."""
    with Cluster(2, 2) as c:
        res = run(c, "ddp_rng", "async", env={"TEST_MEMORY_LIMIT": str(28 << 20), "TEST_SCALE": "8"})
        for rep in res.values():
            assert rep["stats"]["mlcheckpoint/dp_copies_nodes"] == 2.0, rep["stats"]
        md = metadata(c, 0, LAST)
        sent = sent_bytes(c, LAST)
        assert all(sent[r] == sum(loc.nbytes for loc in entries(md, r, ("rng.", "loader.")))
                   for r in range(4)), sent
