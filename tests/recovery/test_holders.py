"""Reads from other nodes during a resume (recovery/holders.py), without processes: which
holder each rank asks first, which nodes hold an item, how a run falls back on the ranks of
its node, and which reads are paced. That layer 2 (dcp) reaches them only through its
Protocol is one of the layer rules in tests/test_layers.py."""

from __future__ import annotations

import dataclasses
import os
import pickle

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from mlcheckpoint.dcp.remote import RemoteRun
from mlcheckpoint.errors import ShardNotFoundError
from mlcheckpoint.integrity.checksum import checksum
from mlcheckpoint.recovery import NodeInventory, StepCopy, plan_resume, take_inventory
from mlcheckpoint.recovery.holders import Holders, holder_order, rebuild_sources
from mlcheckpoint.recovery.planner import MEMORY, Decision, Fetch
from mlcheckpoint.replication import Transport
from mlcheckpoint.store import LocalStore
from mlcheckpoint.store.coverage import Held
from mlcheckpoint.store.layout import ItemLocation
from mlcheckpoint.store.manifest import Manifest, ManifestItem
from mlcheckpoint.topology import Topology


def rank_on(node: int, local_rank: int, *, nodes: int = 3, per_node: int = 2) -> Topology:
    return Topology(rank=node * per_node + local_rank, world_size=nodes * per_node,
                    local_rank=local_rank, local_world_size=per_node, node_rank=node,
                    num_nodes=nodes)


# 3 nodes x 2 ranks; node 2 was replaced. Ranks 4 and 5's shards are held by nodes 0 and 1;
# the plan names node 2's metadata fetch from rank 1 (node 0), and no source for a shard.
PLAN = Decision(MEMORY, 7, fetches=[Fetch(4, 1, 7)],
                holders={0: [0, 1, 2, 3], 4: [0, 1, 2, 3], 5: [0, 1, 2, 3]},
                metadata_holders=[0, 1, 2, 3], data_bytes={4: 100, 5: 100},
                sources={0: "local", 1: "local", 2: "local", 3: "local", 4: "peer", 5: "peer"})


def test_the_planned_metadata_source_and_the_dealt_node_come_first():
    for local_rank in (0, 1):
        assert holder_order(PLAN, rank_on(2, local_rank), None)[0] == 1  # the plan's source
        for node in (0, 1):  # a shard: the ranks of the node the read was dealt to
            order = holder_order(PLAN, rank_on(2, local_rank), 4, first_node=node)
            assert [r // 2 for r in order[:2]] == [node, node], order
            assert sorted(order) == [0, 1, 2, 3]  # then every other holder, each once
    # the two ranks of node 2 ask the dealt node's ranks in different orders
    assert len({holder_order(PLAN, rank_on(2, lr), 4, first_node=0)[0] for lr in (0, 1)}) == 2


def test_the_rebuilds_of_a_replaced_node_are_dealt_over_the_holders_alike_on_every_rank():
    # The plan picks no source; every rank deals the plan's two rebuilds over nodes 0 and 1.
    for node, local_rank in ((2, 0), (2, 1), (0, 0)):
        assert rebuild_sources(PLAN, rank_on(node, local_rank)) == {4: 0, 5: 1}
    # a partial replica never serves a whole shard: rank 4's rebuild goes to node 1
    partial = dataclasses.replace(PLAN, partial={4: {0: frozenset({0})}})
    assert rebuild_sources(partial, rank_on(2, 0)) == {4: 1, 5: 0}


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
        self.fetched_from: list[int] = []  # the ranks fetch_shard asked

    def push_shard(self, peer: int, step: int, owner: int, items=None) -> int:
        raise AssertionError("holders never push")

    def push_metadata(self, peer: int, step: int) -> None:
        raise AssertionError("holders never push")

    def fetch_shard(self, peer: int, step: int, owner: int, *, paced: bool = True) -> int:
        self.calls.append(("fetch_shard", paced))
        self.fetched_from.append(peer)
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
        assert holders.read_runs(7, [RemoteRun(4, 1, [(0, 1)], [np.zeros(1, np.uint8)])],
                                 lambda r, i: None) == [None]
        holders.fetch_metadata()
        assert holders.rebuild(4)
    finally:
        store.close()
    assert transport.calls == [("read_items", False), ("fetch_metadata", False),
                               ("fetch_shard", True)]


def test_each_rank_of_a_replaced_node_rebuilds_from_the_holder_dealt_to_it(store_dir):
    """Ranks 4 and 5 (node 2) rebuild their shards from nodes 0 and 1 respectively, as
    ``rebuild_sources`` dealt them: one node does not serve both while the other idles."""
    asked = {}
    for local_rank in (0, 1):
        transport = RecordingTransport()
        store = LocalStore(os.path.join(store_dir, f"r{local_rank}"), "holders-rebuild")
        try:
            assert Holders(transport, store, rank_on(2, local_rank), PLAN).rebuild(4 + local_rank)
        finally:
            store.close()
        asked[4 + local_rank] = transport.fetched_from[0] // 2  # the node asked first
    assert asked == {4: 0, 5: 1}


# Which nodes hold an item (issue 38): every holder of the shard, a partial replica only for
# the items it lists; a node's ranks start on different holders.

def test_every_other_node_holding_the_shard_holds_its_items():
    for local_rank in (0, 1):
        nodes = Holders(RecordingTransport(), None, rank_on(2, local_rank), PLAN).nodes_holding(7, 4, 0)
        assert sorted(nodes) == [0, 1]
    firsts = {Holders(RecordingTransport(), None, rank_on(2, lr), PLAN).nodes_holding(7, 4, 0)[0]
              for lr in (0, 1)}
    assert firsts == {0, 1}  # the two readers of node 2 begin on different holders
    assert Holders(RecordingTransport(), None, rank_on(1, 0), PLAN).nodes_holding(7, 4, 0) == [0]


def test_a_partial_replica_holds_only_the_items_it_lists():
    plan = dataclasses.replace(PLAN, partial={4: {1: frozenset({100})}})
    holders = Holders(RecordingTransport(), None, rank_on(2, 0), plan)
    assert sorted(holders.nodes_holding(7, 4, 100)) == [0, 1]
    assert holders.nodes_holding(7, 4, 0) == [0]  # node 1's copy of rank 4's shard lacks it


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


class DeadTransport(ServingTransport):
    """Ranks in ``down`` fail as a dead node's do (the connection refused), not as "missing"."""

    def read_items(self, peer, step, owner, ranges, sinks, on_range=None, *, paced=False) -> int:
        if peer in self.down:
            raise ConnectionRefusedError(f"rank {peer}: connection refused")
        return super().read_items(peer, step, owner, ranges, sinks, on_range, paced=paced)


def _run(node: int, shard: bytes, nranges: int) -> RemoteRun:
    size = len(shard) // nranges
    return RemoteRun(4, node, [(i * size, size) for i in range(nranges)],
                     [np.zeros(size, np.uint8) for _ in range(nranges)])


def test_runs_on_two_nodes_are_read_from_both_and_counted(store_dir):
    shard = bytes(range(256)) * 40
    transport, store = ServingTransport(shard), LocalStore(store_dir, "holders-spread")
    try:
        holders = Holders(transport, store, rank_on(2, 0), PLAN)
        runs = [_run(0, shard, 4), _run(1, shard, 4)]
        landed: list[tuple[int, int]] = []
        assert holders.read_runs(7, runs, lambda r, i: landed.append((r, i))) == [None, None]
    finally:
        store.close()
    assert sorted(landed) == [(r, i) for r in range(2) for i in range(4)]
    for run in runs:
        assert b"".join(s.tobytes() for s in run.sinks) == shard
    assert sorted({rank // 2 for rank in transport.served}) == [0, 1]
    assert holders.bytes_served == {4: {0: len(shard), 1: len(shard)}}
    assert holders.bytes_fetched == 2 * len(shard)


def test_a_run_falls_back_on_the_other_ranks_of_its_node(store_dir):
    shard = bytes(range(256)) * 40
    transport = ServingTransport(shard, down={3})  # node 1's first rank for this reader
    store = LocalStore(store_dir, "holders-fallback")
    try:
        holders = Holders(transport, store, rank_on(2, 1), PLAN)
        run = _run(1, shard, 2)
        assert holders.read_runs(7, [run], lambda r, i: None) == [None]
    finally:
        store.close()
    assert b"".join(s.tobytes() for s in run.sinks) == shard
    assert set(transport.served) == {2}


def test_a_node_that_fails_fails_its_runs_and_says_how(store_dir):
    shard = bytes(range(256)) * 40
    store = LocalStore(store_dir, "holders-down")
    try:
        missing = Holders(ServingTransport(shard, down={2, 3}), store, rank_on(2, 0), PLAN)
        errors = missing.read_runs(7, [_run(1, shard, 2), _run(0, shard, 2)], lambda r, i: None)
        assert isinstance(errors[0], ShardNotFoundError) and errors[1] is None, errors
        dead = DeadTransport(shard, down={2, 3})
        holders = Holders(dead, store, rank_on(2, 0), PLAN)
        errors = holders.read_runs(7, [_run(1, shard, 2), _run(1, shard, 2), _run(0, shard, 2)],
                                   lambda r, i: None)
    finally:
        store.close()
    # a dead node: both its ranks refused the first run; its second run is not tried again
    assert [type(e) for e in errors] == [ConnectionRefusedError, ConnectionRefusedError, type(None)]
    assert holders.bytes_served == {4: {0: len(shard)}}


def test_a_planned_partial_replica_serves_the_items_it_lists_and_never_the_whole_shard():
    # From the inventories up: 2 nodes x 2 ranks, node 0 lost its copy of rank 0's shard. Node
    # 1 holds a partial replica of it (per-rank items at offsets 0 and 64 were pushed; the
    # item at 128 has a copy in rank 2's shard). The merged planner once counted the partial
    # replica for completeness but left its node out of the holders: every read of rank 0's
    # per-rank items then failed on "no node holds it", and the step was dropped.
    required = (0, 1, 2, 3)
    partial_copy = StepCopy(owners=frozenset({0, 1, 2, 3}), has_metadata=True, required=required,
                            world_size=4, shard_bytes=((0, 192), (1, 100), (2, 100), (3, 100)),
                            copy_groups=((0, ((), (2,))),),
                            partial=((0, Held(frozenset({0, 64}), frozenset({()}))),))
    lost_own = StepCopy(owners=frozenset({1}), has_metadata=True, required=required, world_size=4,
                        shard_bytes=((1, 100),), copy_groups=((0, ((), (2,))),))
    nodes = [NodeInventory(0, [0, 1], {5: lost_own}), NodeInventory(1, [2, 3], {5: partial_copy})]
    plan = plan_resume(nodes, None, 4)
    assert plan.kind == MEMORY and plan.step == 5, plan.reason
    assert plan.partial == {0: {1: frozenset({0, 64})}}
    # the partial replica's file is as long as the shard: a rebuild of rank 0's shard (whole
    # on no node) takes that size, so it is the shard the replica describes
    assert plan.through_copies == [0] and plan.data_bytes[0] == 192
    reader = Holders(RecordingTransport(), None, rank_on(0, 0, nodes=2), plan)
    assert reader.nodes_holding(5, 0, 0) == [1] and reader.nodes_holding(5, 0, 64) == [1]
    assert reader.nodes_holding(5, 0, 128) == []  # not listed: read from its copy in rank 2's shard
    assert reader.nodes_holding(5, 2, 40) == [1]
    # a whole-shard fetch (the rebuild) never asks the partial replica
    assert holder_order(plan, rank_on(0, 0, nodes=2), 0, whole=True) == []
    assert sorted(holder_order(plan, rank_on(0, 0, nodes=2), 0)) == [2, 3]


def test_a_partial_replica_no_metadata_here_vouches_for_is_neither_counted_nor_read(store_dir):
    # 3 nodes x 1 rank; node 2 was replaced. Node 0 holds the step whole; node 1 holds rank
    # 1's shard and a partial replica of rank 0 with its per-rank item, but no metadata (lost
    # there): nothing here checks that replica against the save, so the planner counts none
    # of it. The inventory once also listed its items apart from what it counted, and the
    # reader was then sent to read from the replica the planner had not counted.
    data = np.random.default_rng(0).bytes(2 * 4096)
    own = [ManifestItem(f"k{o}", o, 4096, checksum(data[o:o + 4096])) for o in (0, 4096)]
    m0 = Manifest("job", 5, 0, len(data), own, world_size=2, save_id="s1")
    m1 = Manifest("job", 5, 1, 4096, [ManifestItem("r1", 0, 4096, checksum(data[:4096]))],
                  world_size=2, save_id="s1")
    md = Metadata(state_dict_metadata={}, storage_data={
        MetadataIndex("model"): ItemLocation(0, 0, 4096, own[0].checksum, copies=((1, 0),)),
        MetadataIndex("rng0"): ItemLocation(0, 4096, 4096, own[1].checksum),
        MetadataIndex("rng1"): ItemLocation(1, 0, 4096, m1.items[0].checksum)})
    stores = [LocalStore(os.path.join(store_dir, f"node{n}"), "job") for n in range(3)]
    try:
        for store, m, part in ((stores[0], m0, None), (stores[0], m1, None),
                               (stores[1], m1, None), (stores[1], m0, [own[1]])):
            shard_m = m if part is None else m.only(part)
            shard = store.begin_shard(5, m.rank, m.data_bytes,
                                      shard_m.held_ranges() if shard_m.partial else None)
            for offset, n in shard_m.held_ranges():
                shard.buffer.array[offset:offset + n] = np.frombuffer(
                    (data if m.rank == 0 else data[:4096])[offset:offset + n], np.uint8)
            shard.commit_manifest(shard_m)
        stores[0].write_metadata(5, pickle.dumps(md), world_size=2, ranks=[0, 1], total_bytes=0,
                                 save_id="s1")
        nodes = [take_inventory(store, n, [n]) for n, store in enumerate(stores)]
        assert nodes[1].steps[5].held(0) == Held(frozenset())
        plan = plan_resume(nodes, None, 3)
        assert plan.kind == MEMORY and plan.step == 5, plan.reason
        assert plan.partial == {0: {1: frozenset()}}
        reader = Holders(RecordingTransport(), stores[2], rank_on(2, 0, nodes=3, per_node=1), plan)
        assert reader.nodes_holding(5, 0, 4096) == [0]  # not node 1: nothing vouches for its copy
    finally:
        for store in stores:
            store.close()
