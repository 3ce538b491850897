"""Reads from other nodes during a resume (recovery/holders.py), without processes: which
holder each rank asks first, which nodes hold an item, how a run falls back on the ranks of
its node, and which reads are paced. That layer 2 (dcp) reaches them only through its
Protocol is one of the layer rules in tests/test_layers.py."""

from __future__ import annotations

import dataclasses
import os
import pickle

import numpy as np
import pytest
from helpers import held_step
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from mlcheckpoint.dcp.remote import RemoteRun
from mlcheckpoint.errors import CorruptShardError, ShardNotFoundError
from mlcheckpoint.integrity.checksum import checksum
from mlcheckpoint.recovery import NodeInventory, plan_resume
from mlcheckpoint.recovery.holders import Holders, holder_order
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


def test_the_planned_metadata_source_comes_first():
    for local_rank in (0, 1):
        order = holder_order(PLAN, rank_on(2, local_rank), None)
        assert order[0] == 1  # the plan's source
        assert sorted(order) == [0, 1, 2, 3]  # then every other holder, each once
        assert sorted(holder_order(PLAN, rank_on(2, local_rank), 4)) == [0, 1, 2, 3]
    # the two ranks of node 2 ask a shard's holders in different orders
    assert len({holder_order(PLAN, rank_on(2, lr), 4)[0] for lr in (0, 1)}) == 2


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

    def read_items(self, peer, step, owner, ranges, sinks, on_range=None, *, paced=False) -> int:
        self.calls.append(("read_items", paced))
        return 0

    def fetch_metadata(self, peer: int, step: int, *, paced: bool = False) -> None:
        self.calls.append(("fetch_metadata", paced))

    def close(self) -> bool:
        return True


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
        self.calls.append(("read_items", paced))
        if peer in self.down:
            raise ShardNotFoundError(f"rank {peer} is down")
        shard = self.bytes_of(peer)
        for i, ((offset, nbytes), sink) in enumerate(zip(ranges, sinks, strict=True)):
            sink[:] = np.frombuffer(shard[offset:offset + nbytes], np.uint8)
            on_range(i)
        self.served[peer] = self.served.get(peer, 0) + sum(n for _, n in ranges)
        return sum(n for _, n in ranges)

    def bytes_of(self, peer: int) -> bytes:
        """The shard's bytes as ``peer`` serves them."""
        return self.shard


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
    partial_copy = held_step({0, 1, 2, 3}, required=required, world_size=4,
                             shard_bytes={0: 192, 1: 100, 2: 100, 3: 100},
                             copy_groups={0: [(), (2,)]},
                             partial={0: Held(frozenset({0, 64}), frozenset({()}))})
    lost_own = held_step({1}, required=required, world_size=4, shard_bytes={1: 100},
                         copy_groups={0: [(), (2,)]})
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
        stores[0].metadata.write(5, pickle.dumps(md), world_size=2, ranks=[0, 1], total_bytes=0,
                                 save_id="s1")
        nodes = [NodeInventory(n, [n], store.inventory.all()) for n, store in enumerate(stores)]
        assert nodes[1].steps[5].partial[0] == Held(frozenset())
        plan = plan_resume(nodes, None, 3)
        assert plan.kind == MEMORY and plan.step == 5, plan.reason
        assert plan.partial == {0: {1: frozenset()}}
        reader = Holders(RecordingTransport(), stores[2], rank_on(2, 0, nodes=3, per_node=1), plan)
        assert reader.nodes_holding(5, 0, 4096) == [0]  # not node 1: nothing vouches for its copy
    finally:
        for store in stores:
            store.close()


# ---------------------------------------------------------------------------- the rebuild
# A replaced node's rank puts its own shard back from its items' places (Holders.rebuild): a
# whole copy of the shard on another node is a place of every item, so the rebuild is the
# load's item reads again, paced, and spread over the holders as they are.
REBUILD_ITEMS = 6
REBUILD_ITEM_BYTES = 4096


def _rebuild_setup(store: LocalStore) -> tuple[Decision, bytes]:
    """Step 7's metadata (save "s1") on this node, recording rank 4's shard as six items;
    a plan whose holders of that shard are nodes 0 and 1 (PLAN's), and the shard's bytes."""
    data = np.random.default_rng(4).bytes(REBUILD_ITEMS * REBUILD_ITEM_BYTES)
    storage = {}
    for i in range(REBUILD_ITEMS):
        offset = i * REBUILD_ITEM_BYTES
        storage[MetadataIndex(f"item{i}")] = ItemLocation(
            4, offset, REBUILD_ITEM_BYTES, checksum(data[offset:offset + REBUILD_ITEM_BYTES]))
    md = Metadata(state_dict_metadata={}, storage_data=storage)
    store.metadata.write(7, pickle.dumps(md), world_size=6, ranks=range(6), total_bytes=len(data),
                         save_id="s1")
    return dataclasses.replace(PLAN, save_id="s1", data_bytes={4: len(data), 5: 100}), data


def test_a_rebuild_reads_its_items_paced_from_every_holder_and_commits_the_shard(store_dir):
    store = LocalStore(store_dir, "holders-rebuild")
    try:
        plan, data = _rebuild_setup(store)
        transport = ServingTransport(data)
        holders = Holders(transport, store, rank_on(2, 0), plan)
        assert holders.rebuild(4)
        with store.shards.open(7, 4) as source:
            assert source.manifest.save_id == "s1" and not source.manifest.partial
            assert source.read(0, len(data)) == data
        assert not holders.rebuild(4)  # here already: nothing is read again
    finally:
        store.close()
    assert transport.calls == [("read_items", True)] * 2  # one paced read per holder node
    assert sorted({rank // 2 for rank in transport.served}) == [0, 1]  # both served
    assert sum(transport.served.values()) == len(data)
    assert holders.bytes_fetched == 0  # a rebuild is not the load's reads


def test_a_resumes_reads_are_unpaced_and_the_heal_is_paced(store_dir):
    """The resume waits for its range reads and metadata: full link. The rebuild of a replaced
    node's own shard runs in the background: within the holder's budget."""
    store = LocalStore(store_dir, "holders-paced")
    try:
        plan, data = _rebuild_setup(store)
        transport = ServingTransport(data)
        holders = Holders(transport, store, rank_on(2, 0), plan)
        assert holders.read_runs(7, [RemoteRun(4, 1, [(0, 1)], [np.zeros(1, np.uint8)])],
                                 lambda r, i: None) == [None]
        holders.fetch_metadata()
        assert holders.rebuild(4)
    finally:
        store.close()
    assert transport.calls[:2] == [("read_items", False), ("fetch_metadata", False)]
    assert transport.calls[2:] and set(transport.calls[2:]) == {("read_items", True)}


def test_a_rebuild_refuses_bytes_that_disagree_with_the_recorded_checksum(store_dir):
    store = LocalStore(store_dir, "holders-rebuild-corrupt")
    try:
        plan, data = _rebuild_setup(store)
        bad = bytearray(data)
        bad[5 * REBUILD_ITEM_BYTES + 7] ^= 0xFF  # the last item, on whichever node serves it
        with pytest.raises(CorruptShardError, match="offset 20480") as e:
            Holders(ServingTransport(bytes(bad)), store, rank_on(2, 0), plan).rebuild(4)
        assert e.value.copy is not None and e.value.copy.owner == 4
        with pytest.raises(ShardNotFoundError):  # nothing was committed
            store.shards.open(7, 4)
        # The step's metadata stays, for the node's loads and its other ranks' rebuilds (the
        # failed rebuild's buffer used to take the step's folder with it).
        assert store.inventory.step_state(7).has_metadata
        assert Holders(ServingTransport(data), store, rank_on(2, 0), plan).rebuild(4)
    finally:
        store.close()


class SilentTransport(ServingTransport):
    """Ranks in ``down`` answer a read as served without sending its ranges (a broken or
    hostile holder)."""

    def read_items(self, peer, step, owner, ranges, sinks, on_range=None, *, paced=False) -> int:
        if peer in self.down:
            return sum(n for _, n in ranges)
        return super().read_items(peer, step, owner, ranges, sinks, on_range, paced=paced)


@pytest.mark.parametrize("failing", [DeadTransport, SilentTransport], ids=["dead", "silent"])
def test_a_rebuild_goes_on_from_the_other_holder_when_one_fails(store_dir, failing):
    # Node 0 is dead, or answers "ok" without sending the bytes (its items would otherwise be
    # committed unverified, as zeros): the items dealt to it are read from node 1.
    store = LocalStore(store_dir, "holders-rebuild-failing")
    try:
        plan, data = _rebuild_setup(store)
        transport = failing(data, down={0, 1})  # node 0's ranks
        assert Holders(transport, store, rank_on(2, 0), plan).rebuild(4)
        with store.shards.open(7, 4) as source:
            assert source.read(0, len(data)) == data
    finally:
        store.close()
    assert set(transport.served) <= {2, 3} and sum(transport.served.values()) == len(data)


class CorruptOnTransport(ServingTransport):
    """Ranks in ``corrupt`` serve ``bad`` (the shard with bytes flipped) instead of the shard."""

    def __init__(self, shard: bytes, bad: bytes, corrupt: set[int]) -> None:
        super().__init__(shard)
        self.bad, self.corrupt = bad, corrupt

    def bytes_of(self, peer: int) -> bytes:
        return self.bad if peer in self.corrupt else self.shard


def test_a_rebuild_reads_items_again_from_another_place_when_one_copy_is_corrupt(store_dir, caplog):
    # Node 0's copy of rank 4's shard has a flipped byte in every item; the rebuild deals some
    # items to it, finds them corrupt, reads them again from node 1 and commits the shard.
    # Node 0's copy is asked nothing more.
    store = LocalStore(store_dir, "holders-rebuild-one-corrupt")
    try:
        plan, data = _rebuild_setup(store)
        bad = bytearray(data)
        for i in range(REBUILD_ITEMS):
            bad[i * REBUILD_ITEM_BYTES + 7] ^= 0xFF
        transport = CorruptOnTransport(data, bytes(bad), corrupt={0, 1})
        holders = Holders(transport, store, rank_on(2, 0), plan)
        with caplog.at_level("WARNING", logger="mlcheckpoint.recovery.holders"):
            assert holders.rebuild(4)
        with store.shards.open(7, 4) as source:
            assert source.read(0, len(data)) == data
    finally:
        store.close()
    refused = [r.getMessage() for r in caplog.records if "from another place" in r.getMessage()]
    assert refused and all("rank 4's shard on node 0" in m for m in refused), refused
    assert holders.nodes_holding(7, 4, 0) == [1]


def test_a_rebuild_reads_every_item_though_an_empty_one_shares_its_offset(store_dir):
    # An empty tensor takes the offset of the item after it. Here the metadata lists it after
    # that item: a rebuild that told items apart by offset read the empty one only, and
    # committed the other's bytes unread (zeros) under its checksum.
    store = LocalStore(store_dir, "holders-rebuild-empty")
    try:
        data = np.random.default_rng(5).bytes(2 * REBUILD_ITEM_BYTES)
        storage = {MetadataIndex(f"item{i}"): ItemLocation(
            4, i * REBUILD_ITEM_BYTES, REBUILD_ITEM_BYTES,
            checksum(data[i * REBUILD_ITEM_BYTES:(i + 1) * REBUILD_ITEM_BYTES])) for i in range(2)}
        storage[MetadataIndex("empty")] = ItemLocation(4, REBUILD_ITEM_BYTES, 0, checksum(b""))
        store.metadata.write(7, pickle.dumps(Metadata(state_dict_metadata={}, storage_data=storage)),
                             world_size=6, ranks=range(6), total_bytes=len(data), save_id="s1")
        plan = dataclasses.replace(PLAN, save_id="s1", data_bytes={4: len(data), 5: 100})
        assert Holders(ServingTransport(data), store, rank_on(2, 0), plan).rebuild(4)
        rebuilt = store.verify_shard(7, 4)  # every item against its checksum
        assert sorted((it.offset, it.nbytes) for it in rebuilt.items) == [
            (0, REBUILD_ITEM_BYTES), (REBUILD_ITEM_BYTES, 0), (REBUILD_ITEM_BYTES, REBUILD_ITEM_BYTES)]
        with store.shards.open(7, 4) as source:
            assert source.read(0, len(data)) == data
    finally:
        store.close()
