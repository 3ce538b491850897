"""A save that fails on one rank fails on every rank (issue 36, item 2), in real torchrun jobs
on small tmpfs mounts (tests/workers/failed_save.py).

One rank's shard stops fitting in its node's tmpfs mid-job, while the other ranks' still fit.
Every rank's save of that step fails with the same error, which names the rank and node that
hit it, before any rank reports success; no rank is left alone in a collective, so the next
saves go on (failing at once while there is no room, succeeding once there is), ``close()``
waits for nothing, and the steps committed before stay loadable. For every way of saving:
overlapped (``guard``) and plain ``async_save``, blocking ``save`` and DCP's own
``dcp.async_save`` with our writer.
"""

from __future__ import annotations

import contextlib

import pytest
from cluster import Cluster
from helpers import mounted_tmpfs

pytestmark = pytest.mark.slow

FIRST_FULL, FREE_AT, STEPS = 2, 5, 7  # as in the worker (one node)
WHAT = {"guarded": "async save", "unguarded": "async save", "blocking": "save"}


def run(nnodes: int, mode: str, size: str) -> tuple[dict[int, dict], str]:
    """The worker in ``mode`` on ``nnodes`` nodes of 2 ranks, each node's local_dir a tmpfs of
    ``size``: every rank's report, and every node's log."""
    with Cluster(nnodes=nnodes, nproc=2) as c, contextlib.ExitStack() as mounts:
        for node in c.nodes:
            mounts.enter_context(mounted_tmpfs(node.local_dir, f"size={size},mode=0700"))
        c.run("failed_save.py", mode, timeout=240)  # nobody died, nobody hung
        return c.results("saves"), "".join(node.log() for node in c.nodes)


def assert_heard_alike(res: dict[int, dict], log: str) -> None:
    """Every step said the same on every rank; nothing waited out a timeout."""
    for step in range(STEPS):
        said = {rank: r["saves"][step] for rank, r in res.items()}
        assert len(set(said.values())) == 1, (step, said)
    assert "timeout" not in res[0]["saves"], res[0]["saves"]
    assert "not every rank reached close()" not in log  # close() waited for no missing rank
    assert "invalid fill tensor-volume" not in log  # no rank went on with an empty plan


@pytest.mark.parametrize("mode", ["guarded", "unguarded", "blocking", "native"])
def test_a_shard_that_does_not_fit_fails_the_step_on_every_rank(mode):
    """1 node x 2 ranks, a 56 MiB tmpfs of which another program holds 16 MiB: rank 1's third
    16 MiB buffer (keep=2) does not fit, rank 0's 1 MiB does."""
    res, log = run(1, mode, "56m")
    assert sorted(res) == [0, 1]
    assert_heard_alike(res, log)
    saves = res[0]["saves"]
    assert saves[:FIRST_FULL] == ["ok"] * FIRST_FULL, saves
    for step in range(FIRST_FULL, FREE_AT):  # fails at once, each time, on every rank
        if mode == "native":  # DCP's CheckpointException holds rank 1's error as it is
            assert saves[step].startswith(
                "CheckpointException: rank 1: CapacityError: checkpoint shard needs "), saves
        else:
            assert saves[step].startswith(
                f"CapacityError: {WHAT[mode]} of step {step} failed on rank 1 (node 0): "
                "checkpoint shard needs "), saves
        # fewer kept steps would make room, and one save fits the filesystem: no size to name
        assert "lower keep=" in saves[step] and "larger than" not in saves[step], saves[step]
    # Room again: saving goes on. (Only the first save is certain to fit: a 60 MiB tmpfs holds
    # keep=2 steps and the one being saved with little to spare, and retention keeps the newest
    # step protected on both nodes, so a slow replication leaves one more step in memory.)
    assert saves[FREE_AT] == "ok", saves
    for r in res.values():  # nothing committed before the failures was lost
        assert r["complete"] == [0, 1] and r["step1_loaded"] is True, r


def test_two_nodes_every_rank_hears_which_rank_and_node_failed():
    """2 nodes x 2 ranks, replicating, a 60 MiB tmpfs each, 16 MiB of node 1's held by another
    program: from step 2 on, rank 3 (node 1) finds no room for its third 16 MiB shard and the
    1 MiB replica its partner (rank 1) sends with it; all four ranks' overlapped saves fail
    alike, naming it, until the other program's file goes."""
    res, log = run(2, "guarded", "60m")
    assert sorted(res) == [0, 1, 2, 3]
    assert_heard_alike(res, log)
    saves = res[0]["saves"]
    assert saves[:FIRST_FULL] == ["ok"] * FIRST_FULL, saves
    for step in range(FIRST_FULL, FREE_AT):
        assert saves[step].startswith(
            f"CapacityError: async save of step {step} failed on rank 3 (node 1): checkpoint "
            "shard needs "), saves
        assert "what its step's 1 replica from partner nodes bring 1.0 MiB (replicas=1)" in saves[step]
    # Room again: saving goes on. (Only the first save is certain to fit: a 60 MiB tmpfs holds
    # keep=2 steps and the one being saved with little to spare, and retention keeps the newest
    # step protected on both nodes, so a slow replication leaves one more step in memory.)
    assert saves[FREE_AT] == "ok", saves
