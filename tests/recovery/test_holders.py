"""Reads from other nodes during a resume (recovery/holders.py), without processes: which
holder each rank asks first, which reads are paced, and that layer 2 (dcp) reaches them only
through its Protocol."""

from __future__ import annotations

import ast
import pathlib

import numpy as np

from mlcheckpoint import LocalStore
from mlcheckpoint.recovery.holders import Holders, holder_order
from mlcheckpoint.recovery.planner import MEMORY, Decision, Fetch
from mlcheckpoint.replication import Transport
from mlcheckpoint.topology import Topology

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mlcheckpoint"


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


class RecordingTransport(Transport):
    """Says which reads were asked to be paced; serves nothing."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def push_shard(self, peer: int, step: int, owner: int) -> int:
        raise AssertionError("holders never push")

    def push_metadata(self, peer: int, step: int) -> None:
        raise AssertionError("holders never push")

    def fetch_shard(self, peer: int, step: int, owner: int, *, paced: bool = True) -> int:
        self.calls.append(("fetch_shard", paced))
        return 0

    def read_items(self, peer, step, owner, ranges, sinks, on_range=None, *, paced=False) -> int:
        self.calls.append(("read_items", paced))
        return 0

    def fetch_metadata(self, peer: int, step: int, *, paced: bool = False) -> None:
        self.calls.append(("fetch_metadata", paced))

    def close(self) -> None:
        pass


def test_a_resumes_reads_are_unpaced_and_the_heal_is_paced(store_dir):
    """The resume waits for its range reads and metadata: full link. The rebuild of a replaced
    node's own shard runs in the background: within the holder's budget."""
    transport, store = RecordingTransport(), LocalStore(store_dir, "holders-paced")
    try:
        holders = Holders(transport, store, rank_on(2, 0), PLAN)
        holders.read_ranges(7, 4, [(0, 1)], [np.zeros(1, np.uint8)], lambda i: None)
        holders.fetch_metadata()
        assert holders.rebuild(4)
    finally:
        store.close()
    assert transport.calls == [("read_items", False), ("fetch_metadata", False),
                               ("fetch_shard", True)]
