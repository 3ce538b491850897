"""Reads from other nodes during a resume (recovery/holders.py), without processes: which
holder each rank asks first and which reads are paced. That layer 2 (dcp) reaches them only
through its Protocol is one of the layer rules in tests/test_layers.py."""

from __future__ import annotations

import numpy as np

from mlcheckpoint import LocalStore
from mlcheckpoint.errors import ShardNotFoundError
from mlcheckpoint.recovery.holders import Holders, holder_order, stripe_over_holders
from mlcheckpoint.recovery.planner import MEMORY, Decision, Fetch
from mlcheckpoint.replication import Transport
from mlcheckpoint.topology import Topology


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


class RecordingTransport(Transport):
    """Says which reads were asked to be paced; serves nothing."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def push_shard(self, peer: int, step: int, owner: int, items=None) -> int:
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

    def close(self) -> bool:
        return True


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


# Spread reads (issue 23, part 3): a shard held by several other nodes is read from all of them.

def test_ranges_are_dealt_over_every_holder_node_in_about_equal_bytes():
    order = holder_order(PLAN, rank_on(2, 0), 4)  # rank 3 (node 1) planned, then node 0
    ranges = [(i * 100, 100) for i in range(10)]
    runs = stripe_over_holders(order, ranges, 2)
    assert sorted(i for indices, _ in runs for i in indices) == list(range(10))  # each once
    firsts = [asks[0] // 2 for _, asks in runs]
    assert firsts == [1, 0], runs  # the planned node first, then every other holder node
    assert [len(indices) for indices, _ in runs] == [5, 5]
    for _, asks in runs:  # a run falls back on every other holder
        assert sorted(asks) == sorted(order)


def test_one_large_range_goes_to_one_node_and_the_rest_to_the_other():
    runs = stripe_over_holders([3, 0], [(0, 10), (10, 10), (20, 1000), (1020, 5)], 2)
    assert runs == [([2], [3, 0]), ([0, 1, 3], [0, 3])]


def test_one_holder_node_or_one_range_is_one_run():
    assert stripe_over_holders([0, 1], [(0, 10), (10, 10)], 2) == [([0, 1], [0, 1])]
    assert stripe_over_holders([0, 2], [(0, 10)], 2) == [([0], [0, 2])]


class ServingTransport(RecordingTransport):
    """Serves one shard's bytes from memory to every range read; ranks in ``down`` fail."""

    def __init__(self, shard: bytes, down: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__()
        self.shard, self.down = shard, down
        self.served: dict[int, int] = {}  # rank -> bytes it served

    def read_items(self, peer, step, owner, ranges, sinks, on_range=None, *, paced=False) -> int:
        if peer in self.down:
            raise ShardNotFoundError(f"rank {peer} is down")
        for i, ((offset, nbytes), sink) in enumerate(zip(ranges, sinks, strict=True)):
            sink[:] = np.frombuffer(self.shard[offset:offset + nbytes], np.uint8)
            on_range(i)
        self.served[peer] = self.served.get(peer, 0) + sum(n for _, n in ranges)
        return sum(n for _, n in ranges)


def _read_all(holders: Holders, shard: bytes, nranges: int) -> tuple[list[int], list[int]]:
    size = len(shard) // nranges
    ranges = [(i * size, size) for i in range(nranges)]
    sinks = [np.zeros(size, np.uint8) for _ in ranges]
    landed: list[int] = []
    nodes = holders.read_ranges(7, 4, ranges, sinks, landed.append)
    assert b"".join(s.tobytes() for s in sinks) == shard
    return nodes, sorted(landed)


def test_a_shard_on_two_nodes_is_read_from_both(store_dir):
    shard = bytes(range(256)) * 40
    transport, store = ServingTransport(shard), LocalStore(store_dir, "holders-spread")
    try:
        holders = Holders(transport, store, rank_on(2, 0), PLAN)
        nodes, landed = _read_all(holders, shard, 8)
    finally:
        store.close()
    assert landed == list(range(8))
    assert sorted(set(nodes)) == [0, 1], nodes
    assert sorted({rank // 2 for rank in transport.served}) == [0, 1]
    assert holders.bytes_fetched == len(shard)
    assert holders.bytes_served == {4: {0: len(shard) // 2, 1: len(shard) // 2}}


def test_a_holder_that_fails_leaves_its_ranges_to_the_others(store_dir):
    shard = bytes(range(256)) * 40
    transport = ServingTransport(shard, down={3})  # the planned source, on node 1
    store = LocalStore(store_dir, "holders-fallback")
    try:
        holders = Holders(transport, store, rank_on(2, 0), PLAN)
        nodes, landed = _read_all(holders, shard, 8)
    finally:
        store.close()
    assert landed == list(range(8))
    assert set(nodes) <= {0, 1} and 3 not in transport.served
    assert holders.bytes_fetched == len(shard)
