"""Verification: the one place a checksum recorded at save time meets the bytes read back.

Three entry points:
  - ``verify_region``: every item of a region in memory (a mapped shard, a received buffer),
    hashed on the copier's threads;
  - ``StreamVerifier``: a stream of bytes verified as it lands, in order, while it is
    cache-hot (a replica arriving on one connection);
  - ``digest_item``: the checksum of one item's bytes (``verify_digests`` then compares
    digests hashed elsewhere, e.g. by the copier while it copies into the model, or by the
    device after a copy into device memory).
Each record names the algorithm its checksum was taken with (``digests.of``: xxh3 when it
names none, as every record before per-item algorithms); each entry point hashes with it.
A failure is always ``integrity_error``'s CorruptShardError, worded the same wherever it
happens, naming the bad copy (``errors.CopyId``) when the caller knows it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch

from ..errors import CopyId, CorruptShardError
from . import copier, digests
from .checksum import byte_array


class Recorded(Protocol):
    """An item whose place and checksum were recorded at save time (a ManifestItem, an
    ItemLocation)."""

    @property
    def offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def checksum(self) -> int: ...

    # and, optionally, ``algorithm``: str | None (``digests.of`` reads it)


R = TypeVar("R", bound=Recorded)


def integrity_error(where: str, what: str, copy: CopyId | None = None) -> CorruptShardError:
    """The error for bytes that fail their checksum: ``where`` names the copy (step, rank,
    node or path), ``what`` the item."""
    return CorruptShardError(f"{where}: checksum mismatch in {what}", copy=copy)


def digests_agree(recorded: int, digest: int) -> bool:
    """Whether bytes that hash to ``digest`` are the bytes recorded as ``recorded``."""
    return digest == recorded


def records_agree(a: Recorded, b: Recorded) -> bool:
    """Whether two records of an item's bytes (e.g. a primary and a data-parallel copy) say
    the same bytes: the same checksum under the same algorithm."""
    return digests.of(a) == digests.of(b) and digests_agree(a.checksum, b.checksum)


def same_layout(held: Iterable[Recorded], offered: Iterable[Recorded]) -> bool:
    """Whether two records of a shard (two manifests' items) name the same bytes: item by item,
    the same place, size, algorithm and checksum."""
    def layout(items: Iterable[Recorded]) -> list[tuple[int, int, str, int]]:
        return [(it.offset, it.nbytes, digests.of(it), it.checksum) for it in items]
    return layout(held) == layout(offered)


class Listing(Generic[R]):
    """The items a record of a shard lists (a manifest's), by place: the one check of whether
    that shard holds an item another record names (an ItemLocation of the step's metadata, an
    item a peer offers): listed at the same place with the same size, algorithm and checksum.
    A partial replica holds only the items its manifest lists; the reader, the planner's
    inventory, the sender's plan, the receiver's "have" and ``verify`` all ask this."""

    def __init__(self, items: Iterable[R]):
        self._at: dict[int, list[R]] = {}  # offset -> the items listed there
        for it in items:
            self._at.setdefault(it.offset, []).append(it)

    def lists(self, offset: int) -> bool:
        """Whether any item is listed at ``offset`` (what the record claims to hold there)."""
        return offset in self._at

    def listed(self, offset: int) -> R:
        """The (first) item listed at ``offset``; only for an offset ``lists`` names."""
        return self._at[offset][0]

    def disagreement(self, item: Recorded, offset: int | None = None) -> str | None:
        """Why the item listed at ``offset`` (default: ``item``'s own) is not the bytes
        ``item`` records (a data-parallel copy of it lies at another offset of another
        shard), or that nothing is listed there, in words; None when it is."""
        at = item.offset if offset is None else offset
        whys = [_disagreement(held, at, item.nbytes, item.checksum, digests.of(item))
                for held in self._at.get(at, ())]
        return None if None in whys else (whys[0] if whys else f"nothing is listed at offset {at}")

    def holds(self, item: Recorded, offset: int | None = None) -> bool:
        """Whether the shard holds ``item``'s bytes (at ``offset``, default its own)."""
        return self.disagreement(item, offset) is None  # (one naming nothing listed there too)

    def holds_all(self, items: Iterable[Recorded]) -> bool:
        return all(self.holds(it) for it in items)


def _disagreement(held: Recorded, offset: int, nbytes: int, checksum: int,
                  algorithm: str) -> str | None:
    """Why a shard's record of an item at ``offset`` does not name the bytes the step
    recorded (``nbytes``, ``checksum`` under ``algorithm``), in words; None when it does."""
    if held.offset != offset:
        return f"it records the item at offset {held.offset}, the step at {offset}"
    if held.nbytes != nbytes:
        return f"it records {held.nbytes} bytes, the step {nbytes}"
    if digests.of(held) != algorithm:
        return f"it records a {digests.of(held)} checksum, the step a {algorithm} one"
    if held.checksum != checksum:
        return (f"its checksum {held.checksum:#018x} is not the {checksum:#018x} the step "
                "recorded (the bytes or the manifest were changed after the save)")
    return None


def digest_item(data: Any, algorithm: str = digests.DEFAULT) -> int:
    """The checksum of one item's bytes (bytes, a uint8 array or a contiguous CPU tensor)
    under ``algorithm``."""
    arr = byte_array(data.reshape(-1).view(torch.uint8).numpy() if isinstance(data, torch.Tensor)
                     else data)
    return digests.digest_at(algorithm, arr.ctypes.data, arr.nbytes)


def known_algorithm(record: Recorded, where: str, describe: str,
                    copy: CopyId | None = None) -> str:
    """The algorithm of ``record``, which this version can compute: a record naming another
    (a damaged file, a newer writer) is a CorruptShardError, not a crash."""
    try:
        return digests.check(digests.of(record))
    except ValueError as e:
        raise CorruptShardError(f"{where}: {describe}: {e}", copy=copy) from None


def verify_digests(items: Sequence[R], digests: Iterable[int], where: str,
                   describe: Callable[[R], str] = lambda it: repr(getattr(it, "key", it)),
                   copy: CopyId | None = None) -> None:
    """Check each item's digest against the checksum recorded for it; raises
    ``integrity_error`` naming the first item that differs (``describe``: how to name it)."""
    for item, digest in zip(items, digests, strict=True):
        if not digests_agree(item.checksum, digest):
            raise integrity_error(where, describe(item), copy)


def region_digests(array: Any, items: Sequence[Recorded]) -> list[int]:
    """The checksums of ``items``' bytes in ``array`` (a uint8 array), each under its own
    algorithm, hashed on the copier's threads. The caller checks the items lie inside the
    array and their algorithms are known."""
    base = array.ctypes.data
    return copier.process([copier.Span(src=base + it.offset, nbytes=it.nbytes,
                                       algorithm=digests.of(it)) for it in items])


def verify_region(array: Any, items: Sequence[R], where: str,
                  describe: Callable[[R], str] = lambda it: repr(getattr(it, "key", it)),
                  copy: CopyId | None = None) -> None:
    """Verify every item of a region in memory (``array``, uint8): an item lying past its end,
    one recorded with an unknown algorithm and one whose bytes fail their checksum all raise
    CorruptShardError."""
    for it in items:
        if it.offset + it.nbytes > array.size:
            raise CorruptShardError(f"{where}: {describe(it)} lies past the region's "
                                    f"{array.size} bytes", copy=copy)
        known_algorithm(it, where, describe(it), copy)
    verify_digests(items, region_digests(array, items), where, describe, copy)


class StreamVerifier:
    """Verifies items as their bytes arrive in ``array``, in order, so no checksum pass trails
    the transfer: ``feed(upto)`` as bytes land, then ``check()``, which raises
    ``integrity_error`` naming the first bad item."""

    def __init__(self, array: Any, items: Iterable[Recorded], total: int, where: str):
        self.array, self.total, self.where = array, total, where
        self.items = sorted(items, key=lambda it: it.offset)
        for it in self.items:
            known_algorithm(it, where, repr(getattr(it, "key", it)))
        self.digests: list[int] = []  # of items[:len(digests)], complete
        self.done = 0  # bytes hashed
        self.h = self._next_hash()

    def _next_hash(self):
        """A streaming checksum for the next item to complete, under its algorithm."""
        n = len(self.digests)
        return digests.streaming(digests.of(self.items[n]) if n < len(self.items) else digests.DEFAULT)

    def feed(self, upto: int) -> None:
        """Bytes [0, upto) are in place: hash what is new."""
        while len(self.digests) < len(self.items):
            it = self.items[len(self.digests)]
            start, stop = max(self.done, it.offset), min(upto, it.offset + it.nbytes)
            if stop > start:
                self.h.update(self.array[start:stop])
                self.done = stop
            if upto < it.offset + it.nbytes:
                return
            self.digests.append(self.h.digest())
            self.h = self._next_hash()

    def check(self) -> None:
        """All bytes are in: verify every item."""
        self.feed(self.total)
        verify_digests(self.items, self.digests, self.where)
