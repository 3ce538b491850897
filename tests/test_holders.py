"""Reads from other nodes during a resume (recovery/holders.py), without processes: which
holder each rank asks first, and that layer 2 (dcp) reaches them only through its Protocol."""

from __future__ import annotations

import ast
import pathlib

from mlcheckpoint.recovery.holders import holder_order
from mlcheckpoint.recovery.planner import MEMORY, Decision, Fetch
from mlcheckpoint.topology import Topology

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mlcheckpoint"


def rank_on(node: int, local_rank: int, *, nodes: int = 3, per_node: int = 2) -> Topology:
    return Topology(rank=node * per_node + local_rank, world_size=nodes * per_node,
                    local_rank=local_rank, local_world_size=per_node, node_rank=node,
                    num_nodes=nodes)


# 3 nodes x 2 ranks; node 2 was replaced. Rank 4's shard is held by nodes 0 and 1; the plan
# balanced node 2's fetch of it onto rank 3 (node 1).
PLAN = Decision(MEMORY, 7, fetches=[Fetch(4, 3, 7, 4, 100), Fetch(4, 1, 7, None)],
                holders={0: [0, 1, 2, 3], 4: [0, 1, 2, 3]}, metadata_holders=[0, 1, 2, 3])


def test_the_planned_source_comes_first_for_every_rank_of_the_node():
    for local_rank in (0, 1):
        order = holder_order(PLAN, rank_on(2, local_rank), 4)
        assert order[0] == 3, order
        assert sorted(order) == [0, 1, 2, 3]  # then every other holder, each once
    assert holder_order(PLAN, rank_on(2, 0), None)[0] == 1  # the metadata's planned source


def test_without_a_plan_for_this_node_readers_spread_over_the_holders():
    # Node 2's ranks read rank 0's shard (DCP de-duplication): nothing planned, each rank
    # starts elsewhere.
    firsts = {holder_order(PLAN, rank_on(2, lr), 0)[0] for lr in (0, 1)}
    assert len(firsts) == 2, firsts


def test_a_rank_never_asks_its_own_node():
    # Node 1 lacks nothing the plan names; its ranks read rank 0's shard from node 0 only.
    for local_rank in (0, 1):
        assert sorted(holder_order(PLAN, rank_on(1, local_rank), 0)) == [0, 1]
        assert sorted(holder_order(PLAN, rank_on(1, local_rank), None)) == [0, 1]


def test_layer_2_never_imports_recovery_or_replication():
    for path in (PACKAGE / "dcp").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                top = (node.module or "").split(".")[0]
                assert top not in ("recovery", "replication"), f"{path.name} imports ..{node.module}"
