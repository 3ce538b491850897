"""Per-item checksum algorithms: what manifests and item locations record, that records made
before them (xxh3 only) still verify, that every verifier hashes each item with its own
algorithm, and that a name this version does not know is refused, from a file or a peer."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from helpers import payload

from mlcheckpoint import CorruptShardError
from mlcheckpoint.errors import ProtocolError
from mlcheckpoint.integrity import digests
from mlcheckpoint.integrity.verify import (
    Listing,
    StreamVerifier,
    digest_item,
    records_agree,
    same_layout,
    verify_region,
)
from mlcheckpoint.replication.core.checks import manifest_from_wire
from mlcheckpoint.store.layout import ItemLocation
from mlcheckpoint.store.manifest import Manifest, ManifestItem

JOB = "job-algorithms"
XXH3, WSUM = digests.XXH3, digests.WSUM

# A manifest as the versions before per-item algorithms wrote it, byte for byte (one item).
OLD_MANIFEST = ('{"job_id":"job-algorithms","step":3,"rank":0,"data_bytes":4096,"world_size":1,'
                '"created":1764000000.0,"algorithm":"xxh3_64/chunks-2MiB","format":1,"save_id":"s",'
                '"run_id":"r","items":[{"key":"w","offset":0,"nbytes":4096,"checksum":%d,'
                '"kind":"tensor","dtype":"uint8","shape":[4096]}]}')


def commit(store, step: int, data: bytes, algorithms: list[str]) -> Manifest:
    """A shard of ``data`` in as many equal items as ``algorithms``, item k under its own."""
    sw = store.begin_shard(step, 0, len(data))
    sw.buffer.array[:] = np.frombuffer(data, dtype=np.uint8)
    cut = len(data) // len(algorithms)
    for k, algorithm in enumerate(algorithms):
        part = data[k * cut:(k + 1) * cut]
        sw.add_item(ManifestItem(f"item{k}", k * cut, len(part), digest_item(part, algorithm),
                                 algorithm=digests.recorded_as(algorithm)))
    return sw.commit(save_id=f"s{step}")


def test_a_manifest_written_before_per_item_algorithms_still_verifies(store):
    data = payload(3, 0)
    sw = store.begin_shard(3, 0, len(data))
    sw.buffer.array[:] = np.frombuffer(data, dtype=np.uint8)
    sw.commit()  # the data file in place; its manifest is then replaced by an old one
    with open(store.paths.manifest(3, 0), "w") as f:
        f.write(OLD_MANIFEST % digest_item(data))
    m = store.verify_shard(3, 0)
    assert m.algorithm == XXH3 and m.items[0].algorithm is None
    # what this version writes for xxh3 items is that format still: no per-item field
    assert "algorithm" not in json.loads(m.to_bytes())["items"][0]
    assert Manifest.from_bytes(m.to_bytes()) == m


def test_an_old_item_location_reads_as_xxh3():
    """A location pickled before the field existed (DCP's metadata holds them) has none."""
    loc = ItemLocation(rank=0, offset=0, nbytes=100, checksum=7)
    del loc.__dict__["algorithm"]  # what an old pickle's state holds
    old = pickle.loads(pickle.dumps(loc))
    assert old.algorithm is None and digests.of(old) == XXH3
    data = np.frombuffer(payload(1, 1, 100), dtype=np.uint8)
    verify_region(data, [ItemLocation(0, 0, 100, digest_item(data))], "here")


def test_items_of_one_shard_verify_each_under_its_own_algorithm(store):
    data = payload(4, 0, 3 << 20)
    m = commit(store, 4, data, [WSUM, XXH3, WSUM])
    assert [it.algorithm for it in store.shards.read_manifest(4, 0).items] == [WSUM, None, WSUM]
    store.verify_shard(4, 0)
    # each checksum is its own algorithm's, and would fail under the other
    for it in m.items:
        other = XXH3 if digests.of(it) == WSUM else WSUM
        part = data[it.offset:it.offset + it.nbytes]
        assert digest_item(part, digests.of(it)) == it.checksum
        assert digest_item(part, other) != it.checksum
    with open(store.paths.data(4, 0), "r+b") as f:
        f.seek(m.items[2].offset + 5)
        byte = f.read(1)
        f.seek(m.items[2].offset + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptShardError, match="checksum mismatch in item 'item2'"):
        store.verify_shard(4, 0)


def test_a_stream_verifier_hashes_each_item_with_its_algorithm():
    """A replica arriving in order: a device-checksummed item is verified by the host engine."""
    data = np.frombuffer(payload(5, 0, 5 << 20), dtype=np.uint8)
    cuts = [0, 777, 3 << 20, data.size]
    items = [ManifestItem(f"i{k}", a, b - a, digest_item(data[a:b], alg), algorithm=digests.recorded_as(alg))
             for k, (a, b, alg) in enumerate(zip(cuts, cuts[1:], [XXH3, WSUM, WSUM]))]
    for flip in (None, 1000, (3 << 20) + 1):
        landed = np.zeros_like(data)
        v = StreamVerifier(landed, items, data.size, "replica on arrival")
        for start in range(0, data.size, 1 << 20):
            landed[start:start + (1 << 20)] = data[start:start + (1 << 20)]
            v.feed(min(start + (1 << 20), data.size))
        if flip is not None:
            landed[flip] ^= 1  # (after it was hashed: the next check hashes again)
            v = StreamVerifier(landed, items, data.size, "replica on arrival")
            with pytest.raises(CorruptShardError, match=f"checksum mismatch in 'i{1 if flip < 3 << 20 else 2}'"):
                v.check()
        else:
            v.check()


def test_a_record_naming_an_unknown_algorithm_is_corrupt_not_a_crash(store):
    data = np.frombuffer(payload(6, 0), dtype=np.uint8)
    with pytest.raises(CorruptShardError, match="unknown checksum algorithm 'crc7'"):
        verify_region(data, [ItemLocation(0, 0, 10, 0, algorithm="crc7")], "here")
    with pytest.raises(CorruptShardError, match="unknown checksum algorithm"):
        StreamVerifier(data, [ManifestItem("x", 0, 10, 0, algorithm="crc7")], data.size, "here")
    commit(store, 6, data.tobytes(), [XXH3])
    with open(store.paths.manifest(6, 0)) as f:
        raw = json.load(f)
    raw["items"][0]["algorithm"] = "crc7"
    with open(store.paths.manifest(6, 0), "w") as f:
        json.dump(raw, f)
    with pytest.raises(CorruptShardError, match="unreadable manifest"):
        store.verify_shard(6, 0)


@pytest.mark.parametrize("algorithm", ["crc7", 7, ["x"], "x" * 10000])
def test_a_peer_naming_an_unknown_algorithm_is_refused(algorithm):
    m = Manifest("j", 1, 0, 100, [ManifestItem("a", 0, 100, 1)]).to_dict()
    assert manifest_from_wire(m, "j", 1, 0).items[0].algorithm is None
    m["items"][0]["algorithm"] = WSUM
    assert manifest_from_wire(m, "j", 1, 0).items[0].algorithm == WSUM
    m["items"][0]["algorithm"] = algorithm
    with pytest.raises(ProtocolError, match="malformed manifest"):
        manifest_from_wire(m, "j", 1, 0)
    whole = Manifest("j", 1, 0, 100, [ManifestItem("a", 0, 100, 1)]).to_dict()
    whole["algorithm"] = algorithm
    with pytest.raises(ProtocolError, match="malformed manifest"):
        manifest_from_wire(whole, "j", 1, 0)


def test_a_manifest_wide_algorithm_applies_to_items_that_name_none():
    m = Manifest("j", 1, 0, 100, [ManifestItem("a", 0, 50, 1), ManifestItem("b", 50, 50, 2, algorithm=XXH3)])
    d = m.to_dict()
    d["algorithm"] = WSUM
    back = Manifest.from_dict(d)
    assert [digests.of(it) for it in back.items] == [WSUM, XXH3]


def test_equal_numbers_under_different_algorithms_are_not_the_same_bytes():
    a = ItemLocation(0, 0, 8, 1234)
    b = ItemLocation(1, 64, 8, 1234, algorithm=WSUM)
    assert records_agree(a, ItemLocation(1, 64, 8, 1234))
    assert not records_agree(a, b)
    assert not same_layout([ManifestItem("x", 0, 8, 1234)], [ManifestItem("x", 0, 8, 1234, algorithm=WSUM)])


def test_a_listing_holds_an_item_at_a_place_with_its_size_algorithm_and_checksum():
    # the one check of "does this shard hold item X" (reader, inventory, sender, receiver)
    listing = Listing([ManifestItem("a", 0, 8, 1234), ManifestItem("empty", 8, 0, 7),
                       ManifestItem("b", 8, 16, 99)])
    assert listing.holds(ItemLocation(1, 0, 8, 1234)) and listing.holds(ItemLocation(1, 8, 16, 99))
    assert listing.holds(ItemLocation(1, 8, 0, 7))  # two items at one offset: both are held
    assert not listing.holds(ItemLocation(1, 0, 8, 1235)) and not listing.lists(64)
    assert not listing.holds(ItemLocation(1, 0, 8, 1234, algorithm=WSUM))
    assert "checksum" in (listing.disagreement(ItemLocation(1, 0, 8, 1235)) or "")
    assert "8 bytes, the step 4" in (listing.disagreement(ItemLocation(1, 0, 4, 1234)) or "")
    # a copy of an item lies at another offset of another shard: asked at that offset
    assert listing.holds(ItemLocation(0, 512, 16, 99), offset=8)
    assert listing.listed(8).key == "empty"
