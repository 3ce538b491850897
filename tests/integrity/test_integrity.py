"""integrity/verify.py: its three entry points (a region, a stream as it lands, one item's
digest), the one wording of a failure and the one identity of a copy."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
from helpers import damage_shard, payload, put_shard

from mlcheckpoint.errors import CopyId, CorruptShardError
from mlcheckpoint.integrity.checksum import checksum
from mlcheckpoint.integrity.verify import (
    StreamVerifier,
    digest_item,
    integrity_error,
    verify_region,
)
from mlcheckpoint.store.manifest import ManifestItem

JOB = "job-integrity"


def items_of(data: np.ndarray, cuts: list[int]) -> list[ManifestItem]:
    """Items covering ``data`` between ``cuts``, each with its recorded checksum."""
    bounds = [0, *cuts, data.size]
    return [ManifestItem(f"item{i}", a, b - a, checksum(data[a:b]))
            for i, (a, b) in enumerate(itertools.pairwise(bounds))]


def test_digest_item_is_the_checksum_of_its_bytes_whatever_holds_them():
    data = np.frombuffer(payload(1, 0), dtype=np.uint8)
    assert digest_item(data) == digest_item(data.tobytes()) == checksum(data)


def test_verify_region_names_the_first_bad_item_and_the_copy():
    data = np.frombuffer(payload(2, 0, 8192), dtype=np.uint8).copy()
    items = items_of(data, [1000, 5000])
    verify_region(data, items, "here")
    data[6000] ^= 1
    with pytest.raises(CorruptShardError, match="here: checksum mismatch in 'item2'") as e:
        verify_region(data, items, "here", copy=CopyId(4, 1, 0))
    assert e.value.copy == CopyId(4, 1, 0) and e.value.copy.owner == 1


def test_verify_region_refuses_an_item_past_its_end():
    data = np.zeros(100, dtype=np.uint8)
    with pytest.raises(CorruptShardError, match="lies past the region's 100 bytes"):
        verify_region(data, [ManifestItem("x", 64, 64, 0)], "here")


@pytest.mark.parametrize("piece", [1, 777, 4096, 1 << 20])
def test_stream_verifier_checks_items_as_bytes_land_in_any_piece_size(piece):
    data = np.frombuffer(payload(3, 0, 10_000), dtype=np.uint8)
    items = items_of(data, [10, 4096, 4097])
    for flip in (None, 5000):
        landed = np.zeros_like(data)
        v = StreamVerifier(landed, items, data.size, "replica on arrival")
        for start in range(0, data.size, piece):
            stop = min(start + piece, data.size)
            landed[start:stop] = data[start:stop]
            if flip is not None and start <= flip < stop:
                landed[flip] ^= 1
            v.feed(stop)
        if flip is None:
            v.check()
        else:
            with pytest.raises(CorruptShardError, match="on arrival: checksum mismatch in 'item3'"):
                v.check()


def test_one_wording_for_every_integrity_failure(store):
    """A shard damaged on disk and a region damaged in memory fail with the same words."""
    put_shard(store, 1, 0)
    damage_shard(store, 1, 0, item="second", at=0)
    with pytest.raises(CorruptShardError) as on_disk:
        store.verify_shard(1, 0)
    built = integrity_error("step 1 rank 0 (somewhere)", "item 'second'")
    assert str(on_disk.value).split(": ", 1)[1] == str(built).split(": ", 1)[1]


def test_a_named_copy_survives_pickling():
    """DCP gathers exceptions across ranks: the copy a CorruptShardError names must arrive."""
    e = pickle.loads(pickle.dumps(integrity_error("there", "'w'", CopyId(7, None, 2))))
    assert isinstance(e, CorruptShardError) and e.copy == CopyId(7, None, 2)
    assert isinstance(e.copy, CopyId) and e.copy.node == 2
