"""Reading an item from a copy when its shard is on no node (issue 28 item 2, recovery side).

A data-parallel job keeps agreeing copies of an item in other ranks' shards
(``ItemLocation.copies``). Here a real checkpoint is built where rank 1's shard is on no node
and every item it was the primary of has a copy in rank 0's shard: the reader loads them from
the copies, bit-exact, on the node that holds rank 0's shard and, through recovery's
``Holders``, on another node; a corrupt copy is named (its rank and node) so recovery can
refuse it.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import flip_byte
from states import assert_same, clone_state, make_state, zeros_like_state

from mlcheckpoint import (
    CheckpointManager,
    CorruptShardError,
    MemoryStorageReader,
    MemoryStorageWriter,
)
from mlcheckpoint.errors import CopyId, ShardNotFoundError
from mlcheckpoint.recovery import NodeInventory, plan_resume
from mlcheckpoint.recovery.holders import Holders
from mlcheckpoint.recovery.planner import MEMORY, Decision
from mlcheckpoint.recovery.resume import load_step
from mlcheckpoint.replication import Transport
from mlcheckpoint.store import LocalStore, coverage
from mlcheckpoint.store.identity import Lineage
from mlcheckpoint.store.layout import ItemLocation
from mlcheckpoint.store.manifest import ManifestItem
from mlcheckpoint.testing import internals
from mlcheckpoint.topology import Topology

JOB = "job-read-copies"
STEP = 4
KEPT = "model.f32"  # the one item rank 0 stays the primary of; rank 1 was the primary of the rest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(seed: int = 1) -> dict:
    """make_state's tensors and plain values (byte items), and a quantized tensor (stored as
    DCP stores it: ``is_tensor`` False)."""
    sd = make_state(seed)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    sd["q"] = torch.quantize_per_tensor(x, 0.05, 3, torch.qint8)
    return sd


def target() -> dict:
    out = zeros_like_state(make_state(1))
    out["q"] = torch.quantize_per_tensor(torch.zeros(4, 6), 0.05, 3, torch.qint8)
    return out


def same(expected: dict, out: dict) -> None:
    assert torch.equal(out["q"].int_repr(), expected["q"].int_repr())
    assert (out["q"].q_scale(), out["q"].q_zero_point()) == (expected["q"].q_scale(), expected["q"].q_zero_point())
    assert_same({k: v for k, v in expected.items() if k != "q"}, {k: v for k, v in out.items() if k != "q"})


def save_with_lost_shard(store: LocalStore) -> tuple[dict, dict[str, ItemLocation]]:
    """Save ``state()`` as rank 0's shard, then commit a metadata in which rank 1 is the
    primary of every item but ``KEPT``, at offsets of its own, with the copy in rank 0's shard;
    rank 1's shard is never written. Returns the state saved and the moved items' copies."""
    sd = state()
    expected = clone_state(sd)
    dcp.save(sd, storage_writer=MemoryStorageWriter(STEP, store))
    header, payload = store.metadata.read(STEP)
    md = pickle.loads(payload)
    copies: dict[str, ItemLocation] = {}
    for i, (index, loc) in enumerate(sorted(md.storage_data.items(), key=lambda kv: str(kv[0]))):
        if index.fqn == KEPT:
            continue
        copies[index.fqn] = loc
        md.storage_data[index] = ItemLocation(rank=1, offset=4096 * i, nbytes=loc.nbytes,
                                              checksum=loc.checksum, is_tensor=loc.is_tensor,
                                              copies=((0, loc.offset),))
    kinds = {loc.is_tensor for loc in copies.values()}
    assert kinds == {True, False} and any(k.startswith("extra.") for k in copies)  # every kind moved
    locations = list(md.storage_data.values())
    store.metadata.write(STEP, pickle.dumps(md), world_size=2, ranks={0, 1},
                         total_bytes=sum(loc.nbytes for loc in locations), save_id=header.save_id,
                         lineage=Lineage.from_header(header.run_id, header.lineage))
    assert store.inventory.step_state(STEP).copy_groups == {1: [(0,)]}
    assert STEP in store.inventory.complete_steps()  # whole here: rank 1's items through their copies
    return expected, copies


def test_items_of_a_shard_on_no_node_load_from_their_copies(store, caplog):
    expected, _ = save_with_lost_shard(store)
    out = target()
    with caplog.at_level("DEBUG", logger="mlcheckpoint.dcp.reader"):  # layout words: debug
        load_step(out, MemoryStorageReader(STEP, store, node=0), None)
    same(expected, out)
    assert "reading items of rank 1's shard from their copies in the shards of ranks [0]" in caplog.text


def test_a_corrupt_copy_is_named(store):
    _, copies = save_with_lost_shard(store)
    loc = copies["model.layer.i32"]
    flip_byte(store.paths.data(STEP, 0), loc.offset + 3)
    with pytest.raises(CorruptShardError) as ei:
        load_step(target(), MemoryStorageReader(STEP, store, node=0), None)
    assert ei.value.copy == CopyId(STEP, 0, 0)  # the copy's rank and node: refused, another tried
    assert "'model.layer.i32' (its copy" in str(ei.value)


def test_a_copy_gone_too_is_a_clear_error(store):
    save_with_lost_shard(store)
    os.unlink(store.paths.manifest(STEP, 0))  # rank 0's shard uncommitted: the copies are gone
    with pytest.raises(ShardNotFoundError, match="neither in rank 1's shard nor in any of its copies"):
        load_step(target(), MemoryStorageReader(STEP, store, node=0), None)


def test_a_resume_reads_them_and_refuses_a_corrupt_copy(store_dir):
    """A restart with one rank (rank 1 is gone): the resume loads step 4 through the copies and
    says so; with a copy corrupt, it refuses that copy (rank 0's shard here) and loads step 3."""
    local = os.path.join(store_dir, "local")
    store = LocalStore(local, JOB)
    try:
        older = state(3)
        dcp.save(clone_state(older), storage_writer=MemoryStorageWriter(3, store))
        expected, copies = save_with_lost_shard(store)
    finally:
        store.close()
    with CheckpointManager(None, job_id=JOB, local_dir=local, replication="none") as ckpt:
        out = target()
        info = ckpt.resume(out)
        assert info.step == STEP, info
        assert "shards of ranks [1] are whole on no surviving node" in info.reason and "copies" in info.reason
        same(expected, out)
        flip_byte(internals(ckpt).store.paths.data(STEP, 0), copies["model.f16"].offset + 1)
    with CheckpointManager(None, job_id=JOB, local_dir=local, replication="none") as ckpt:
        out = target()
        info = ckpt.resume(out)
        assert info.step == 3, info
        assert "step 4" in info.reason and "its copy" in info.reason, info.reason
        same(older, out)


# ---------------------------------------------------------------- from another node

class OtherNode(Transport):
    """Serves range reads from another node's store (a real LocalStore on tmpfs, read in
    this process): what the transport would stream, without the network."""

    name = "other-node"

    def __init__(self, store: LocalStore) -> None:
        self.store = store
        self.owners_read: list[int] = []
        self.paced: list[bool] = []  # per read: whether it asked the holder to pace it

    def read_items(self, peer, step, owner, ranges, sinks, on_range=None, *, paced=False) -> int:
        self.owners_read.append(owner)
        self.paced.append(paced)
        with self.store.shards.open(step, owner) as source:
            for i, ((offset, nbytes), sink) in enumerate(zip(ranges, sinks, strict=True)):
                sink[:] = np.frombuffer(source.read(offset, nbytes), np.uint8)
                if on_range is not None:
                    on_range(i)
        return sum(n for _, n in ranges)

    def push_shard(self, peer: int, step: int, owner: int, items=None) -> int:
        raise AssertionError("a load never pushes")

    def push_metadata(self, peer: int, step: int) -> None:
        raise AssertionError("a load never pushes")

    def fetch_metadata(self, peer: int, step: int, *, paced: bool = False) -> None:
        raise AssertionError("node 1 holds the metadata")

    def close(self) -> bool:
        return True


def node(n: int) -> Topology:
    return Topology(rank=n, world_size=2, local_rank=0, local_world_size=1, node_rank=n, num_nodes=2)


@pytest.mark.parametrize("corrupt", [False, True])
def test_copies_held_by_another_node_are_read_through_the_holders(store, store_dir, corrupt):
    """Node 1 (a replacement) holds only the metadata; node 0 holds rank 0's shard with the
    copies. The planner reads rank 1 through copies; node 1's reader streams them from node 0,
    and the heal then rebuilds rank 1's shard on node 1 from them."""
    expected, copies = save_with_lost_shard(store)
    replacement = LocalStore(os.path.join(store_dir, "node1"), JOB)
    try:
        replacement.metadata.write_file(STEP, store.metadata.read_file(STEP))
        inventories = [NodeInventory(0, [0], store.inventory.all()), NodeInventory(1, [1], replacement.inventory.all())]
        plan = plan_resume(inventories, None, 2)
        assert (plan.step, plan.through_copies, plan.sources) == (STEP, [1], {0: "local", 1: "copies"})
        transport = OtherNode(store)
        holders = Holders(transport, replacement, node(1), plan)
        assert holders.nodes_holding(STEP, 0, 0) == [0] and holders.nodes_holding(STEP, 1, 0) == []
        if corrupt:
            flip_byte(store.paths.data(STEP, 0), copies["i64"].offset)
        reader = MemoryStorageReader(STEP, replacement, node=1, remote=holders, save_id=plan.save_id)
        out = target()
        if corrupt:
            with pytest.raises(CorruptShardError) as ei:
                load_step(out, reader, None)
            assert ei.value.copy == CopyId(STEP, 0, 0), ei.value  # node 0's copy of rank 0's shard
            return
        load_step(out, reader, None)
        same(expected, out)
        assert set(transport.owners_read) == {0}  # rank 1's items came from rank 0's shard
        assert transport.paced == [False]  # the load waits for them: at the link's speed
        # Heal: rank 1's shard, whole on no node, is assembled on node 1 from the copies, as
        # its save recorded it (the same save, offsets and checksums), in paced reads
        assert holders.rebuild(1)
        assert transport.paced[1:] and all(transport.paced[1:]), transport.paced
        recorded = [loc for loc in pickle.loads(store.metadata.read(STEP)[1]).storage_data.values()
                    if loc.rank == 1]
        m = replacement.verify_shard(STEP, 1, recorded)  # every checksum, as the metadata says
        assert not m.partial and (m.save_id, m.run_id) == (plan.save_id, store.shards.read_manifest(STEP, 0).run_id)
        assert sorted(it.offset for it in m.items) == sorted(loc.offset for loc in recorded)
        assert {it.key.split("@")[0] for it in m.items} == set(copies)
        st = replacement.inventory.step_state(STEP)
        assert not coverage.unreadable([1], st.copy_groups, st.holdings())  # all of rank 1's, here
        assert not holders.rebuild(1)  # here already
        reads = len(transport.owners_read)
        out = target()
        load_step(out, MemoryStorageReader(STEP, replacement, node=1, remote=holders,
                                           save_id=plan.save_id), None)
        same(expected, out)
        assert len(transport.owners_read) == reads + 1  # only rank 0's own item came from node 0
    finally:
        replacement.close()


# ---------------------------------------------------------------- nearest first (issue 38)

class NoReads(OtherNode):
    """A node the reader must not need: any read from it fails the test."""

    def read_items(self, peer, step, owner, ranges, sinks, on_range=None, *, paced=False) -> int:
        raise AssertionError(f"read rank {owner}'s shard from rank {peer}, though node 0 holds copies")


class DiesFor(OtherNode):
    """Serves ``store``'s shards, but the ranks in ``dead`` fail as a holder killed mid-read
    does (the connection reset after the request)."""

    def __init__(self, store: LocalStore, dead: set[int]) -> None:
        super().__init__(store)
        self.dead = dead
        self.asked: list[int] = []

    def read_items(self, peer, step, owner, ranges, sinks, on_range=None, *, paced=False) -> int:
        self.asked.append(peer)
        if peer in self.dead:
            raise ConnectionResetError(f"rank {peer}: connection reset by peer")
        return super().read_items(peer, step, owner, ranges, sinks, on_range, paced=paced)


def rank_on(rank: int, world: int = 3) -> Topology:
    return Topology(rank=rank, world_size=world, local_rank=0, local_world_size=1, node_rank=rank,
                    num_nodes=world)


def plan_with_holders(save_id: str, holders: dict[int, list[int]]) -> Decision:
    return Decision(MEMORY, STEP, holders=holders, metadata_holders=[0], save_id=save_id)


def test_an_item_with_a_copy_here_is_read_here_though_its_shard_is_elsewhere(store):
    """Node 0 holds copies of rank 1's items; rank 1's shard is on node 1. Every item is read
    on node 0: nothing from node 1."""
    expected, _ = save_with_lost_shard(store)
    header, _ = store.metadata.read(STEP)
    plan = plan_with_holders(header.save_id, {0: [0], 1: [1]})
    holders = Holders(NoReads(store), store, rank_on(0, 2), plan)
    out = target()
    load_step(out, MemoryStorageReader(STEP, store, node=0, remote=holders, save_id=plan.save_id), None)
    same(expected, out)
    assert holders.bytes_fetched == 0


def test_items_whose_holder_dies_mid_read_come_from_their_copies(store, store_dir):
    """Node 2 (a replacement) holds only the metadata. Rank 1's items are primaries on node 1,
    which dies as it is asked; their copies on node 0 serve them."""
    expected, _ = save_with_lost_shard(store)
    header, _ = store.metadata.read(STEP)
    replacement = LocalStore(os.path.join(store_dir, "node2"), JOB)
    try:
        replacement.metadata.write_file(STEP, store.metadata.read_file(STEP))
        plan = plan_with_holders(header.save_id, {0: [0], 1: [1]})
        transport = DiesFor(store, dead={1})
        holders = Holders(transport, replacement, rank_on(2), plan)
        out = target()
        load_step(out, MemoryStorageReader(STEP, replacement, node=2, remote=holders,
                                           save_id=plan.save_id), None)
        same(expected, out)
        assert 1 in transport.asked  # the dead holder was dealt items first
        assert set(holders.bytes_served) == {0} and set(holders.bytes_served[0]) == {0}
    finally:
        replacement.close()


def test_when_every_place_of_an_item_fails_the_error_names_them(store, store_dir):
    save_with_lost_shard(store)
    header, _ = store.metadata.read(STEP)
    replacement = LocalStore(os.path.join(store_dir, "node2"), JOB)
    try:
        replacement.metadata.write_file(STEP, store.metadata.read_file(STEP))
        plan = plan_with_holders(header.save_id, {0: [0], 1: [1]})
        holders = Holders(DiesFor(store, dead={0, 1}), replacement, rank_on(2), plan)
        with pytest.raises(ShardNotFoundError, match="on any node; failed: node") as ei:
            load_step(target(), MemoryStorageReader(STEP, replacement, node=2, remote=holders,
                                                    save_id=plan.save_id), None)
        assert "connection reset" in str(ei.value)
    finally:
        replacement.close()


def test_a_shard_here_serves_only_the_items_its_manifest_lists(store):
    """A partial copy of rank 1's shard on node 0 lists two of its items (the rest of its bytes
    are holes): those two are read from it, the others from their copies in rank 0's shard."""
    expected, copies = save_with_lost_shard(store)
    header, payload = store.metadata.read(STEP)
    md = pickle.loads(payload)
    moved = sorted(((i.fqn, loc) for i, loc in md.storage_data.items() if i.fqn != KEPT),
                   key=lambda kv: kv[1].offset)
    listed = set(sorted(fqn for fqn, loc in moved if loc.is_tensor and loc.nbytes)[:2])
    end = max(loc.offset + loc.nbytes for _, loc in moved)
    shard = store.begin_shard(STEP, 1, end)
    shard.buffer.array[:] = 0
    with store.shards.open(STEP, 0) as source:
        for fqn, loc in moved:
            if fqn in listed:
                shard.buffer.array[loc.offset:loc.offset + loc.nbytes] = np.frombuffer(
                    source.read(copies[fqn].offset, loc.nbytes), np.uint8)
                shard.add_item(ManifestItem(key=fqn, offset=loc.offset, nbytes=loc.nbytes,
                                            checksum=loc.checksum))
    shard.commit(2, save_id=header.save_id, run_id=header.run_id)
    for fqn in listed:  # rank 0's copies of the listed items are damaged: they must not be read
        flip_byte(store.paths.data(STEP, 0), copies[fqn].offset)
    out = target()
    load_step(out, MemoryStorageReader(STEP, store, node=0), None)
    same(expected, out)


def test_a_missing_metadata_is_named_not_an_assertion(store):
    save_with_lost_shard(store)
    os.unlink(store.paths.metadata(STEP))
    with pytest.raises(ShardNotFoundError, match="step 4 has no global metadata on this node"):
        load_step(target(), MemoryStorageReader(STEP, store, node=0), None)
