"""Resume into device memory through a small ring of page-locked buffers.

Page-locking a whole shard's mapping for the copies costs the host ~1-2 GB/s before the first
byte moves. Instead a few page-locked buffers (``SLOTS`` of ``SLOT_BYTES``), made once per
process, are filled from the tmpfs mapping by the copier's threads and copied to the device
in turn: while one slot's host-to-device copy runs, the next slot is filled, and a slot is
filled again only once its last copy has completed. Small items share a slot. Each item is verified: a wsum64 item
(saved from device memory) on the device, after its bytes landed, with a few tensor ops for
all items at once; an xxh3 item by the host, chunk by chunk as it fills the slots (the host
reads those bytes anyway).

The device side is a ``Mover``: ``CudaMover`` (a stream of its own, events) in a job, a
``HostMover`` stand-in with CPU "device" tensors in tests, so the ring's scheduling (pieces,
order, slot reuse, verification per item) runs in CI.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..integrity import copier, digests, wsum
from ..integrity.checksum import CHUNK_BYTES
from ..integrity.verify import digests_agree

log = logging.getLogger(__name__)

SLOTS = 3
SLOT_BYTES = 16 * CHUNK_BYTES  # 32 MiB: whole chunks, so a piece's chunk digests are an item's


@dataclass
class RingTimes:
    """Where the process's ring loads spent their time, summed over every load (seconds):
    ``fill``: the copier's threads copying (and hashing xxh3 items) from the tmpfs mapping into
    slots; ``wait``: waiting for the device to finish reading a slot before it is filled again,
    and for the last copies; ``verify``: the device's checksums of the wsum64 items. What a
    benchmark reads to tell a host-bound ring from a device-bound one."""

    loads: int = 0
    bytes: int = 0
    fill: float = 0.0
    wait: float = 0.0
    verify: float = 0.0


_times_lock = threading.Lock()
times = RingTimes()  # this process's, since it started


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

    def start(self, targets: list[torch.Tensor]) -> None:
        """Before the first copy of a load: order the copies after everything the caller
        enqueued so far (the kernels that initialised ``targets`` among them)."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Start copying ``src`` (bytes of a slot) into ``dst`` (device bytes), after the
        copies started before it."""
        ...

    def fence(self) -> Any:
        """A token for ``wait``: done once every copy started so far has read its slot."""
        ...

    def wait(self, token: Any) -> None:
        ...

    def digests(self, targets: list[torch.Tensor]) -> list[int]:
        """wsum64 of each target, computed on the device after every copy started so far."""
        ...

    def finish(self) -> None:
        """After a load: what the caller enqueues from now on runs after the ring's work."""
        ...


# The page-locked slots of this process, by (slots, bytes each): made once, kept for later
# resumes. One load uses them at a time (resumes run on the training thread), and a load
# that fails waits for its copies before it returns (``Ring.load``), so a retry reuses them.
_cuda_slots: dict[tuple[int, int], list[torch.Tensor]] = {}


class CudaMover:
    """Host-to-device copies on a stream of their own; slots page-locked once per process.

    Every CUDA call runs with ``device`` current (``torch.cuda.device``), whatever the calling
    thread's current device: page-locking and events then use that device's context, never a
    new one on device 0."""

    def __init__(self, device: torch.device):
        self.device = device
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)

    def buffers(self, slots: int, slot_bytes: int) -> list[torch.Tensor]:
        key = (slots, slot_bytes)
        if key not in _cuda_slots:
            with torch.cuda.device(self.device):
                _cuda_slots[key] = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True)
                                    for _ in range(slots)]
        return _cuda_slots[key]

    def start(self, targets: list[torch.Tensor]) -> None:
        # The caller's stream may still hold kernels writing the targets (``init_weights()``
        # after ``to_empty``): the copies, and the checksums after them, wait for those.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in targets:  # allocated on the caller's stream, written on this one
            t.record_stream(self.stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def fence(self) -> Any:
        # A blocking event: the host thread sleeps in ``wait`` instead of spinning a core.
        done = torch.cuda.Event(blocking=True)
        done.record(self.stream)
        return done

    def wait(self, token: Any) -> None:
        token.synchronize()

    def digests(self, targets: list[torch.Tensor]) -> list[int]:
        with torch.cuda.stream(self.stream):
            return wsum.to_unsigned(wsum.tensor_digests(targets).cpu())

    def finish(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


class HostMover:
    """The ring's device side with CPU tensors standing in for device memory (tests): copies
    run at once, the digests on the host's tensor-op engine (the device's code)."""

    def buffers(self, slots: int, slot_bytes: int) -> list[torch.Tensor]:
        return [torch.empty(slot_bytes, dtype=torch.uint8) for _ in range(slots)]

    def start(self, targets: list[torch.Tensor]) -> None:
        pass  # one stream of work: the host's

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def fence(self) -> Any:
        return None

    def wait(self, token: Any) -> None:
        pass

    def digests(self, targets: list[torch.Tensor]) -> list[int]:
        return wsum.to_unsigned(wsum.tensor_digests(targets))

    def finish(self) -> None:
        pass


def mover_for(device: torch.device) -> Mover:
    """The device side for targets on ``device``."""
    return CudaMover(device) if device.type == "cuda" else HostMover()


# Where a piece goes in its slot: aligned, so each host-to-device copy starts on a boundary
# the copy engine likes.
PIECE_ALIGN = 512


class Ring:
    """Copies whole stored items into device memory through ``slots`` buffers of
    ``slot_bytes`` (a multiple of ``CHUNK_BYTES``; default ``SLOTS`` of ``SLOT_BYTES``),
    verifying each one.

    An item is cut into pieces of at most ``slot_bytes`` (whole chunks, from its start); a
    slot takes as many consecutive pieces as fit, so thousands of small items cost a few slot
    fills, not one each. A slot is filled by the copier's threads, then each of its pieces is
    copied to its target, then a fence; the slot is refilled once its fence has passed.
    """

    def __init__(self, mover: Mover, slots: int | None = None, slot_bytes: int | None = None):
        slots = SLOTS if slots is None else slots
        slot_bytes = SLOT_BYTES if slot_bytes is None else slot_bytes
        if slots < 2 or slot_bytes <= 0 or slot_bytes % CHUNK_BYTES:
            raise ValueError(f"a ring needs 2 slots or more of whole {CHUNK_BYTES}-byte chunks")
        self.mover = mover
        self.slots = mover.buffers(slots, slot_bytes)
        self.slot_bytes = slot_bytes
        self.fills = 0  # for tests and benchmarks: slot fills, each followed by its copies
        self.pieces_copied = 0  # host-to-device copies started

    def load(self, reads: Sequence[RingRead]) -> list[int]:
        """Copy every read into its target and verify it; returns the indices of the reads
        whose bytes fail their checksum (empty: all good). The targets hold the bytes once
        this returns; a failed read's target holds the bad bytes.

        The copies run after what the caller's current stream enqueued before the call, and
        what it enqueues after the call runs after them (``Mover.start``, ``finish``): the
        checksums see the bytes no earlier kernel will overwrite. Kernels of the targets on
        other streams are not waited for (the caller's producers are on its current stream).

        A bad item is found once its bytes are in the target: the caller refuses the copy
        and reruns the whole load from another (recovery does), so a target never keeps bad
        bytes; should every copy be bad, the targets are left partly overwritten.

        When it raises, every copy it started has completed first: the slots (shared by the
        process's loads) and the targets are no longer written by the device."""
        for r in reads:
            if r.target.numel() != r.source.size or r.target.dtype != torch.uint8:
                raise ValueError(f"a ring target of {r.target.numel()} bytes for {r.source.size}")
            digests.check(r.algorithm)
        # xxh3 items: their chunks' digests, taken by the host as it fills the slots
        chunk_digests = {i: np.zeros(-(-r.source.size // CHUNK_BYTES), dtype=np.uint64)
                         for i, r in enumerate(reads) if r.algorithm != digests.WSUM}
        fences: list[Any] = [None] * len(self.slots)
        fill = wait = 0.0
        self.mover.start([r.target for r in reads])
        try:
            for batch in self._slot_batches(reads):
                k = self.fills % len(self.slots)
                t0 = time.perf_counter()
                if fences[k] is not None:
                    self.mover.wait(fences[k])  # its copies have read it: it may be refilled
                t1 = time.perf_counter()
                slot = self.slots[k]
                self._fill(slot, reads, batch, chunk_digests)
                fill += time.perf_counter() - t1
                wait += t1 - t0
                for i, begin, size, at in batch:
                    self.mover.copy(reads[i].target[begin:begin + size], slot[at:at + size])
                    self.pieces_copied += 1
                fences[k] = self.mover.fence()
                self.fills += 1
            t0 = time.perf_counter()
            for fence in fences:
                if fence is not None:
                    self.mover.wait(fence)
            t1 = time.perf_counter()
            on_device = [i for i, r in enumerate(reads) if r.algorithm == digests.WSUM]
            got = self.mover.digests([reads[i].target for i in on_device]) if on_device else []
        except BaseException:
            self._settle()
            raise
        self.mover.finish()
        with _times_lock:
            times.loads += 1
            times.bytes += sum(r.source.size for r in reads)
            times.fill += fill
            times.wait += wait + t1 - t0
            times.verify += time.perf_counter() - t1
        bad = []
        for i, chunks in chunk_digests.items():
            r = reads[i]
            digest = (digests.combine(r.algorithm, chunks, r.source.size) if r.source.size
                      else digests.digest_at(r.algorithm, r.source.ctypes.data, 0))
            if not digests_agree(r.checksum, digest):
                bad.append(i)
        bad += [i for i, d in zip(on_device, got, strict=True)
                if not digests_agree(reads[i].checksum, d)]
        return sorted(bad)

    def _settle(self) -> None:
        """After a failure: wait until every copy started so far has completed (a failure of
        the device itself, which that wait would raise again, is left to the caller's error)."""
        try:
            self.mover.wait(self.mover.fence())
            self.mover.finish()
        except Exception as e:  # noqa: BLE001 - the load's own error is the one to raise
            log.debug("mlcheckpoint: waiting for the ring's copies after a failure: %s", e)

    def _slot_batches(self, reads: Sequence[RingRead]) -> list[list[tuple[int, int, int, int]]]:
        """The pieces, in order, grouped by slot fill: (read, begin, size, offset in the slot)."""
        batches: list[list[tuple[int, int, int, int]]] = []
        at = self.slot_bytes  # no slot open yet
        for i, r in enumerate(reads):
            for begin in range(0, r.source.size, self.slot_bytes):
                size = min(self.slot_bytes, r.source.size - begin)
                if at + size > self.slot_bytes:
                    batches.append([])
                    at = 0
                batches[-1].append((i, begin, size, at))
                at += -(-size // PIECE_ALIGN) * PIECE_ALIGN
        return batches

    def _fill(self, slot: torch.Tensor, reads: Sequence[RingRead],
              batch: list[tuple[int, int, int, int]], chunk_digests: dict[int, np.ndarray]) -> None:
        """Copy a slot's pieces into it on the copier's threads, a chunk per span; an xxh3
        read's chunks are hashed in the same pass."""
        spans, slots_of = [], []  # the spans; (read, its first chunk) of the hashed ones
        base = slot.data_ptr()
        for i, begin, size, at in batch:
            hashed = i in chunk_digests
            src = reads[i].source.ctypes.data + begin
            for off in range(0, size, CHUNK_BYTES):
                spans.append(copier.Span(src=src + off, nbytes=min(CHUNK_BYTES, size - off),
                                         dst=base + at + off, algorithm=digests.XXH3 if hashed else None))
                slots_of.append((i, (begin + off) // CHUNK_BYTES) if hashed else None)
        for where, got in zip(slots_of, copier.process(spans), strict=True):
            if where is not None:
                chunk_digests[where[0]][where[1]] = got
