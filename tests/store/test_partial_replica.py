"""A partial replica in the store: only the items that lacked places, at the owner's offsets, in
a sparse file; what the inventory counts it for (the copy groups it holds whole, per item); the
room a save keeps for what replicas bring."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle

import numpy as np
import pytest
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from mlcheckpoint import CapacityError
from mlcheckpoint.integrity.checksum import checksum
from mlcheckpoint.integrity.verify import Listing
from mlcheckpoint.store import LocalStore
from mlcheckpoint.store.coverage import Held
from mlcheckpoint.store.layout import ItemLocation
from mlcheckpoint.store.manifest import Manifest, ManifestItem, decode_metadata

JOB = "partial-replica"
MiB = 1 << 20
PAGE = 4096


def owner_shard(nbytes: int = 4 * MiB, items: int = 4, rank: int = 0) -> tuple[Manifest, bytes]:
    """Rank ``rank``'s shard of step 3 as its own node committed it: ``items`` items."""
    data = np.random.default_rng(rank).bytes(nbytes)
    size = nbytes // items
    listed = [ManifestItem(f"item{k}", k * size, size, checksum(data[k * size:(k + 1) * size]))
              for k in range(items)]
    return Manifest(JOB, 3, rank, nbytes, listed, world_size=2, save_id="s1"), data


def land(store: LocalStore, m: Manifest, data: bytes) -> None:
    """Receive the replica ``m`` (whole or partial) as a sink does: a buffer for what it holds,
    filled at the items' offsets, verified and committed."""
    shard = store.begin_shard(m.step, m.rank, m.data_bytes, m.held_ranges() if m.partial else None)
    for offset, n in m.held_ranges():
        shard.buffer.array[offset:offset + n] = np.frombuffer(data[offset:offset + n], np.uint8)
    shard.verify(m)
    shard.commit_manifest(m)


def allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_a_partial_replica_takes_memory_for_its_items_only_and_is_never_pooled(store_dir):
    store = LocalStore(store_dir, JOB)
    try:
        m, data = owner_shard()
        part = m.only([m.items[1]])
        assert part.held_ranges() == [(MiB, MiB)] and part.held_bytes == MiB
        land(store, part, data)
        path = store.paths.data(3, 0)
        assert os.path.getsize(path) == m.data_bytes  # the owner's offsets, the rest holes
        assert MiB <= allocated(path) <= MiB + 2 * PAGE
        got = store.verify_shard(3, 0, [ItemLocation(0, it.offset, it.nbytes, it.checksum)
                                        for it in m.items])  # only its own items are checked
        assert got.partial and [it.key for it in got.items] == ["item1"]
        with store.shards.open(3, 0) as source:  # a reader's mapping leaves the holes alone
            source.span(MiB, MiB, None)
        assert allocated(path) <= MiB + 2 * PAGE
        store.shards.retire(3, 0)
        assert os.listdir(store.pool_dir) == []  # sparse: unlinked, not kept as a warm buffer
    finally:
        store.close()


def test_a_partial_manifest_lists_its_items_and_reads_as_before_without_the_mark():
    m, _ = owner_shard()
    part = m.only([m.items[3], m.items[1]])
    assert [it.offset for it in part.items] == [MiB, 3 * MiB]
    again = Manifest.from_bytes(part.to_bytes())
    assert again.partial and again.held_ranges() == [(MiB, MiB), (3 * MiB, MiB)]
    assert "partial" not in m.to_dict() and not Manifest.from_bytes(m.to_bytes()).partial
    listing = Listing(part.items)  # (the one check of whether a shard holds an item)
    assert listing.holds(ItemLocation(0, MiB, MiB, m.items[1].checksum))
    assert not listing.holds(ItemLocation(0, 0, MiB, m.items[0].checksum))
    assert not listing.holds(ItemLocation(0, MiB, MiB, m.items[1].checksum + 1))
    merged = m.only(list(m.items[1:3]))  # adjacent items: one range
    assert merged.held_ranges() == [(MiB, 2 * MiB)]
    with pytest.raises(TypeError):
        Manifest.from_dict({**part.to_dict(), "partial": "yes"})


def metadata(store: LocalStore, locations: dict[str, ItemLocation]) -> None:
    md = Metadata(state_dict_metadata={},
                  storage_data={MetadataIndex(k): loc for k, loc in locations.items()})
    store.metadata.write(3, pickle.dumps(md), world_size=2, ranks=[0, 1], total_bytes=0,
                         save_id="s1")


def test_the_inventory_counts_a_partial_replica_for_the_groups_it_holds_whole(store_dir):
    """Node 1 of a DDP pair: rank 1's own shard (with a copy of rank 0's model item) and a
    partial replica of rank 0 with its RNG state: every item of the step is here (whole).
    A partial replica listing the RNG state with another checksum holds nothing."""
    store = LocalStore(store_dir, JOB)
    try:
        m0, data0 = owner_shard(items=2)  # item0: the model (copied to rank 1), item1: RNG
        m1, data1 = owner_shard(items=1, rank=1)
        rng, model = m0.items[1], m0.items[0]
        metadata(store, {"model": ItemLocation(0, model.offset, model.nbytes, model.checksum,
                                               copies=((1, 0),)),
                         "rng0": ItemLocation(0, rng.offset, rng.nbytes, rng.checksum),
                         "rng1": ItemLocation(1, 0, m1.items[0].nbytes, m1.items[0].checksum)})
        land(store, m1, data1)
        assert not store.inventory.step_state(3).complete  # rank 0's RNG state is nowhere here
        land(store, m0.only([rng]), data0)
        st = store.inventory.step_state(3)
        assert st.partial == {0: Held(frozenset({rng.offset}), frozenset({()}))}
        assert st.committed_ranks == {0, 1}
        assert st.complete and store.inventory.complete_steps() == [3]
        store.shards.retire(3, 0)
        lying = m0.only([ManifestItem(rng.key, rng.offset, rng.nbytes, rng.checksum + 1)])
        shard = store.begin_shard(3, 0, m0.data_bytes, lying.held_ranges())
        shard.commit_manifest(lying)  # (as if its bytes had passed some other checksum)
        st = store.inventory.step_state(3)
        assert st.partial == {0: Held(frozenset(), frozenset())} and not st.complete
    finally:
        store.close()


def test_a_save_keeps_room_for_what_the_replicas_bring(store_dir):
    store = LocalStore(store_dir, JOB, memory_limit_bytes=8 * MiB)
    try:
        store.capacity.expect_replicas([0], 1, arriving=lambda: None)  # not known yet:
        with pytest.raises(CapacityError, match="replicas=1") as e:  # a shard of its size
            store.begin_shard(2, 0, 6 * MiB)
        assert e.value.needed >= 12 * MiB
        store.capacity.expect_replicas([0], 1, arriving=lambda: 64 << 10)  # an RNG state
        store.begin_shard(1, 0, 6 * MiB).abort()  # 6 MiB and 64 KiB fit in 8 MiB
    finally:
        store.close()


def test_copies_are_recorded_once_and_metadata_naming_copy_groups_in_its_header_still_reads(store_dir):
    """The metadata records each item's copies in its location alone; the copy groups every
    rule counts in are derived from them. A file written when the header also carried the
    groups (a step left in tmpfs by the previous version) reads, its groups from the
    locations, whatever its header said."""
    store = LocalStore(store_dir, JOB)
    try:
        m0, _ = owner_shard(items=2)
        model, rng = m0.items
        metadata(store, {"model": ItemLocation(0, model.offset, model.nbytes, model.checksum,
                                               copies=((1, 0),)),
                         "rng0": ItemLocation(0, rng.offset, rng.nbytes, rng.checksum)})
        raw = store.metadata.read_file(3)
        assert "copy_groups" not in json.loads(raw[:raw.index(b"\n")])  # once: in the locations
        assert store.inventory.step_state(3).copy_groups == {0: [(), (1,)]}
        header, payload = decode_metadata(raw)
        old = json.dumps({**dataclasses.asdict(header), "copy_groups": {"0": [[]]}}).encode()
        store.metadata.write_file(3, old + b"\n" + payload)
        assert store.metadata.read(3)[0].save_id == "s1"
        assert store.inventory.step_state(3).copy_groups == {0: [(), (1,)]}
    finally:
        store.close()


def test_one_payload_is_unpickled_once_per_process_and_a_new_one_afresh(store_dir, monkeypatch):
    """A save's metadata is installed twice on a node (its own write, then the coordinator's
    push of the same bytes) and read by several stores of a rank: its items are unpickled
    once (15 ms and more at a real model's size, in the training process). A file with other
    bytes at the same step is parsed again and its items are the new ones."""
    from mlcheckpoint.store import metadata as metadata_files

    monkeypatch.setattr(metadata_files, "_parsed", metadata_files._ParsedPayloads())  # nothing kept
    parsed: list[int] = []
    real = metadata_files.item_locations
    monkeypatch.setattr(metadata_files, "item_locations", lambda payload: parsed.append(1) or real(payload))
    first, second = LocalStore(store_dir, JOB), LocalStore(store_dir, JOB)
    try:
        m0, _ = owner_shard(items=2)
        model, rng = m0.items
        locations = {"model": ItemLocation(0, model.offset, model.nbytes, model.checksum, copies=((1, 0),)),
                     "rng0": ItemLocation(0, rng.offset, rng.nbytes, rng.checksum)}
        metadata(first, locations)
        assert first.inventory.step_state(3).copy_groups == {0: [(), (1,)]}
        first.metadata.write_file(3, first.metadata.read_file(3))  # the same bytes, a new inode
        assert first.inventory.step_state(3).copy_groups == second.inventory.step_state(3).copy_groups == {0: [(), (1,)]}
        assert second.metadata.items(3).nbytes(0, [(1,)]) == model.nbytes
        assert len(parsed) == 1
        del locations["model"]  # another save of the step: its own items
        metadata(second, locations)
        assert first.inventory.step_state(3).copy_groups == {} and first.metadata.items(3).nbytes(0, [()]) == rng.nbytes
        assert len(parsed) == 2
    finally:
        first.close()
        second.close()


def test_a_long_run_keeps_the_headers_and_groups_of_a_bounded_number_of_steps(store_dir, monkeypatch):
    """Every step is a new metadata file: a store keeps the verified headers and copy groups of
    the newest ``KEPT_VERSIONS`` files it read, not of every step of the run."""
    from mlcheckpoint.store import metadata as metadata_files

    monkeypatch.setattr(metadata_files, "KEPT_VERSIONS", 3)
    store = LocalStore(store_dir, JOB)
    try:
        for step in range(6):
            store.metadata.write(step, f"meta-of-{step}".encode(), world_size=1, ranks=[0], total_bytes=0)
            assert store.metadata.header(step).step == step
            assert store.metadata.copy_groups(step) == {}  # not our DCP metadata: no copies
        kept = [store.metadata.paths.metadata(s) for s in (3, 4, 5)]
        assert list(store.metadata._verified_headers) == kept
        assert list(store.metadata._groups) == kept
        assert store.metadata.header(0).step == 0  # dropped, read again
    finally:
        store.close()
