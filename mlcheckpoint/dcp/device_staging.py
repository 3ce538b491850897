"""The CUDA branch of staging: device tensors go straight into the page-locked tmpfs buffer, and
their checksums are computed on the device, so the host reads none of their bytes.

A ``DeviceCopies`` batch enqueues, on one stream per device, each tensor's device-to-host copy
into its region of the shard buffer, then the checksums of the sources (``integrity/wsum.py``'s
tensor ops: a few kernels for the whole batch), then one small copy of those checksums to the
host, and an event. ``wait`` blocks on that event and returns the checksums: what the commit
records, with the algorithm ``integrity/digests.py`` gives device items.

Which stream: a copy taken at the call (a tensor the next forward may change) runs on the
caller's current stream, so everything the caller enqueues afterwards runs after it; an
overlapped copy runs on the device's side stream (``side_stream``), ordered after the caller's
stream at the call by an event (``Layout.ready``), while the next forward and backward run.

``on_device`` says which tensors take this branch. Tests route CPU tensors through it (no
stream, no event: the copies and checksums run at once), so the bookkeeping of a device save
(its checksums, their algorithm, the host's bytes) runs in CI without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..integrity import digests, wsum

log = logging.getLogger(__name__)

Digests = dict[int, tuple[int, int, str]]  # offset in the buffer -> (nbytes, checksum, algorithm)

_side_streams: dict[torch.device, torch.cuda.Stream] = {}  # one per device, made once


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The dedicated stream of the device-to-host snapshot copies on ``device``: made once and
    reused, not created per checkpoint."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


def current_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.current_stream(device)


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` (a plain tensor's local part) is staged through this branch: the one
    decision of ``digests.algorithm_for`` gives it the device's checksum (a tensor in CUDA
    memory; another accelerator's tensors are copied by torch and hashed by the host, as
    strided CPU tensors are)."""
    return digests.algorithm_for(t) == digests.WSUM


def call_event(tensors: list[torch.Tensor]) -> dict[torch.device, torch.cuda.Event] | None:
    """Per CUDA device some of ``tensors`` are on, an event on the caller's stream of that
    device, after what it enqueued so far (None where none is in CUDA memory): copies on
    another stream wait for the event of their device. (An event of the current device only
    would leave another device's copies unordered after their producers: a torn snapshot.)

    The producers are assumed on the caller's current streams; work on other streams, or a
    CUDA graph replayed without the guard's hooks, is not waited for."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    if not devices:
        return None
    events = {}
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))  # recorded on that device's stream
        events[device] = event
    return events


@dataclass
class _Batch:
    """The copies of one device, and what their enqueueing left to read back."""

    sources: list[torch.Tensor] = field(default_factory=list)
    targets: list[torch.Tensor] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    host_digests: torch.Tensor | None = None  # page-locked; valid once ``done`` completes
    done: torch.cuda.Event | None = None
    stream: torch.cuda.Stream | None = None  # where the copies were enqueued (``settle``)


class DeviceCopies:
    """Copies of device tensors into a page-locked host buffer, each item's checksum computed
    on the device from its source. ``add`` them, ``enqueue`` once, ``wait`` for the checksums.
    """

    def __init__(self) -> None:
        self._batches: dict[torch.device, _Batch] = {}

    def __bool__(self) -> bool:
        return bool(self._batches)

    @property
    def sources(self) -> list[torch.Tensor]:
        """The tensors still to be copied or waited for."""
        return [t for b in self._batches.values() for t in b.sources]

    def add(self, src: torch.Tensor, dst: torch.Tensor, offset: int, nbytes: int) -> None:
        """Copy ``src`` (in device memory) into ``dst`` (its view of the buffer, at ``offset``)."""
        batch = self._batches.setdefault(src.device, _Batch())
        batch.sources.append(src)
        batch.targets.append(dst)
        batch.offsets.append(offset)
        batch.sizes.append(nbytes)

    def enqueue(self, stream_of: Callable[[torch.device], torch.cuda.Stream] = current_stream,
                after: dict[torch.device, torch.cuda.Event] | None = None) -> None:
        """Enqueue every copy, then the checksums of the sources, on ``stream_of(device)``
        (after ``after``'s event of that device, recorded on the caller's stream); returns
        without waiting. Each device's work runs with that device current (``torch.cuda.
        device``), whichever thread enqueues it."""
        for device, batch in self._batches.items():
            if device.type == "cpu":  # a test's stand-in for device memory: at once
                for src, dst in zip(batch.sources, batch.targets):
                    dst.copy_(src)
                batch.host_digests = wsum.tensor_digests(batch.sources)
                continue
            with torch.cuda.device(device):
                stream = batch.stream = stream_of(device)
                if after is not None and device in after:
                    stream.wait_event(after[device])
                with torch.cuda.stream(stream):
                    # The sources are allocated on the caller's streams and read here; they stay
                    # referenced until ``wait`` (or ``settle``) has seen the copies complete, so
                    # no ``record_stream`` is needed to keep their memory from being reused.
                    for src, dst in zip(batch.sources, batch.targets):
                        dst.copy_(src, non_blocking=True)
                    computed = wsum.tensor_digests(batch.sources)
                    batch.host_digests = torch.empty(computed.shape, dtype=torch.int64, pin_memory=True)
                    batch.host_digests.copy_(computed, non_blocking=True)
                    # Blocking: the waiting thread sleeps rather than spin a core.
                    batch.done = torch.cuda.Event(blocking=True)
                    batch.done.record(stream)

    def wait(self) -> Digests:
        """Block until every copy and checksum has landed; each item's region -> (nbytes,
        checksum, algorithm). The sources are no longer read after this."""
        out: Digests = {}
        for device, batch in self._batches.items():
            assert batch.host_digests is not None, "enqueue() first"
            if batch.done is not None:
                with torch.cuda.device(device):
                    batch.done.synchronize()
            values = wsum.to_unsigned(batch.host_digests)
            for offset, nbytes, digest in zip(batch.offsets, batch.sizes, values, strict=True):
                out[offset] = (nbytes, digest, wsum.NAME)  # what this branch's engine computes
            batch.sources, batch.targets = [], []  # let the sources go
        return out

    def settle(self) -> None:
        """After a failure, before the buffer is given back: wait until the device no longer
        writes into it (every copy enqueued so far has completed), without raising (the
        failure is the error to report). Nothing to do for batches never enqueued."""
        for device, batch in self._batches.items():
            if batch.stream is None:
                continue
            try:
                with torch.cuda.device(device):
                    batch.stream.synchronize()
            except Exception as e:  # noqa: BLE001 - a broken device: the caller's error says more
                log.debug("mlcheckpoint: waiting for the device copies after a failure: %s", e)
