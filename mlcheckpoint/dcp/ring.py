"""Resume into device memory through a small ring of page-locked buffers.

Page-locking a whole shard's mapping for the copies costs the host ~1-2 GB/s before the first
byte moves. Instead a few page-locked buffers (``SLOTS`` of ``SLOT_BYTES``), made once per
process, are filled from the tmpfs mapping by the copier's threads and copied to the device
in turn: while one slot's host-to-device copy runs, the next slot is filled, and a slot is
filled again only once its last copy has completed. Each item is verified: a wsum64 item
(saved from device memory) on the device, after its bytes landed, with a few tensor ops for
all items at once; an xxh3 item by the host, chunk by chunk as it fills the slots (the host
reads those bytes anyway).

The device side is a ``Mover``: ``CudaMover`` (a stream of its own, events) in a job, a
``HostMover`` stand-in with CPU "device" tensors in tests, so the ring's scheduling (pieces,
order, slot reuse, verification per item) runs in CI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..integrity import copier, digests, wsum
from ..integrity.checksum import CHUNK_BYTES
from ..integrity.verify import digests_agree

SLOTS = 3
SLOT_BYTES = 16 * CHUNK_BYTES  # 32 MiB: whole chunks, so a piece's chunk digests are an item's


@dataclass
class RingRead:
    """One stored item to bring into device memory, whole: its bytes in the shard's mapping
    (``source``, uint8), where they go (``target``, a flat uint8 tensor of as many bytes on
    the device) and what was recorded of them at save time."""

    source: np.ndarray
    target: torch.Tensor
    algorithm: str
    checksum: int


class Mover(Protocol):
    """The device side of the ring."""

    def buffers(self, slots: int, slot_bytes: int) -> list[torch.Tensor]:
        """``slots`` host buffers of ``slot_bytes`` (page-locked for the device: made once)."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start copying ``src`` (a slot's bytes) into ``dst`` (device bytes); a token for
        ``wait``."""
        ...

    def wait(self, token: Any) -> None:
        """Return once the copy of ``token`` has read its slot."""
        ...

    def digests(self, targets: list[torch.Tensor]) -> list[int]:
        """wsum64 of each target, computed on the device after every copy issued so far."""
        ...


# The page-locked slots of this process, by (slots, bytes each): made once, kept for later resumes.
_cuda_slots: dict[tuple[int, int], list[torch.Tensor]] = {}


class CudaMover:
    """Host-to-device copies on a stream of their own; slots page-locked once per process."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def buffers(self, slots: int, slot_bytes: int) -> list[torch.Tensor]:
        key = (slots, slot_bytes)
        if key not in _cuda_slots:
            _cuda_slots[key] = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True)
                                for _ in range(slots)]
        return _cuda_slots[key]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, token: Any) -> None:
        token.synchronize()

    def digests(self, targets: list[torch.Tensor]) -> list[int]:
        with torch.cuda.stream(self.stream):
            return wsum.to_unsigned(wsum.tensor_digests(targets).cpu())


class HostMover:
    """The ring's device side with CPU tensors standing in for device memory (tests): copies
    run at once, the digests on the host's tensor-op engine (the device's code)."""

    def buffers(self, slots: int, slot_bytes: int) -> list[torch.Tensor]:
        return [torch.empty(slot_bytes, dtype=torch.uint8) for _ in range(slots)]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        dst.copy_(src)
        return None

    def wait(self, token: Any) -> None:
        pass

    def digests(self, targets: list[torch.Tensor]) -> list[int]:
        return wsum.to_unsigned(wsum.tensor_digests(targets))


def mover_for(device: torch.device) -> Mover:
    """The device side for targets on ``device``."""
    return CudaMover(device) if device.type == "cuda" else HostMover()


class Ring:
    """Copies whole stored items into device memory through ``slots`` buffers of
    ``slot_bytes`` (a multiple of ``CHUNK_BYTES``), verifying each one."""

    def __init__(self, mover: Mover, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES):
        if slots < 2 or slot_bytes <= 0 or slot_bytes % CHUNK_BYTES:
            raise ValueError(f"a ring needs 2 slots or more of whole {CHUNK_BYTES}-byte chunks")
        self.mover = mover
        self.slots = mover.buffers(slots, slot_bytes)
        self.slot_bytes = slot_bytes
        self.pieces_copied = 0  # for tests and benchmarks: host-to-device copies issued

    def load(self, reads: Sequence[RingRead]) -> list[int]:
        """Copy every read into its target and verify it; returns the indices of the reads
        whose bytes fail their checksum (empty: all good). The targets hold the bytes once
        this returns; a failed read's target holds the bad bytes."""
        for r in reads:
            if r.target.numel() != r.source.size or r.target.dtype != torch.uint8:
                raise ValueError(f"a ring target of {r.target.numel()} bytes for {r.source.size}")
            digests.check(r.algorithm)
        pieces = [(i, begin, min(self.slot_bytes, r.source.size - begin))
                  for i, r in enumerate(reads) for begin in range(0, r.source.size, self.slot_bytes)]
        # xxh3 items: their chunks' digests, taken by the host as it fills the slots
        chunk_digests = {i: np.zeros(-(-r.source.size // CHUNK_BYTES), dtype=np.uint64)
                         for i, r in enumerate(reads) if r.algorithm != digests.WSUM}
        in_flight: list[Any] = [None] * len(self.slots)
        for n, (i, begin, size) in enumerate(pieces):
            k = n % len(self.slots)
            if in_flight[k] is not None:
                self.mover.wait(in_flight[k])  # its last copy has read it: it may be refilled
            slot = self.slots[k]
            self._fill(slot, reads[i], begin, size, chunk_digests.get(i))
            in_flight[k] = self.mover.copy(reads[i].target[begin:begin + size], slot[:size])
            self.pieces_copied += 1
        for token in in_flight:
            if token is not None:
                self.mover.wait(token)
        bad = []
        for i, chunks in chunk_digests.items():
            r = reads[i]
            digest = (digests.combine(r.algorithm, chunks, r.source.size) if r.source.size
                      else digests.digest_at(r.algorithm, r.source.ctypes.data, 0))
            if not digests_agree(r.checksum, digest):
                bad.append(i)
        on_device = [i for i, r in enumerate(reads) if r.algorithm == digests.WSUM]
        if on_device:
            got = self.mover.digests([reads[i].target for i in on_device])
            bad += [i for i, d in zip(on_device, got, strict=True)
                    if not digests_agree(reads[i].checksum, d)]
        return sorted(bad)

    def _fill(self, slot: torch.Tensor, read: RingRead, begin: int, size: int,
              chunk_digests: np.ndarray | None) -> None:
        """Copy ``size`` bytes of ``read`` from ``begin`` into ``slot``, on the copier's
        threads, a chunk per span; an xxh3 read's chunks are hashed in the same pass."""
        src, dst = read.source.ctypes.data + begin, slot.data_ptr()
        algorithm = None if chunk_digests is None else digests.XXH3
        spans = [copier.Span(src=src + at, nbytes=min(CHUNK_BYTES, size - at), dst=dst + at,
                             algorithm=algorithm) for at in range(0, size, CHUNK_BYTES)]
        got = copier.process(spans)
        if chunk_digests is not None:
            first = begin // CHUNK_BYTES
            chunk_digests[first:first + len(got)] = got
