"""Stage: copy a state dict straight into a tmpfs shard buffer, the first phase of a save.

``stage_now`` and ``stage_overlapped`` return a ``Staged``: the one value the commit
(``MemoryStorageWriter.write_data``) consumes. Below them, ``stage_into`` lays the state dict
out in the buffer and copies it; given ``defer``, the tensors it names are only placed, and
``copy_deferred`` copies them later, on the staging thread (see dcp/snapshot.py for
which tensors may wait). Which tensors are staged at all, and in what order, follows the
prediction of DCP's plan (``dcp/plans.py``; ``lay_out``). Tensors in device memory take the
CUDA branch (``dcp/device_staging.py``): copied straight into the page-locked buffer, their
checksums computed on the device.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Callable, Hashable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from ..errors import CapacityError, StagingError
from ..integrity import copier
from ..store.local_store import LocalStore, ShardWriter, align
from . import device_staging, serialized
from .device_staging import DeviceCopies, Digests, call_event, side_stream
from .errors import entry_error
from .plans import NO_PREDICTION, Prediction
from .snapshot import Snapshotter, storage_ptr

Leaf = torch.Tensor
# ``lay_out``'s offset of a leaf snapshotted in process memory instead of the shard buffer.
PRIVATE = -1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def plain_cpu(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be copied raw from its address."""
    return (copier.raw_copyable(t) and t.device.type == "cpu" and t.is_contiguous()
            and not t.is_conj() and not t.is_neg())


def leaves_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor leaf of a nested dict/list/tuple, in the order ``stage_into`` walks
    them. Copies nothing."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = obj.values()
    elif not isinstance(obj, (list, tuple)) or hasattr(obj, "_fields"):
        return []
    return [t for v in obj for t in leaves_of(v)]


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor leaf (DTensor: its local shard) of ``obj``, in ``leaves_of``'s order."""
    return [_local(t) for t in leaves_of(obj)]


def lay_out(leaves: list[torch.Tensor], prediction: Prediction,
            skip: Callable[[torch.Tensor], bool],
            private: Callable[[torch.Tensor], bool] | None = None
            ) -> tuple[list[int | None], int]:
    """Each leaf's offset in the shard buffer, and the bytes staged: the leaves predicted
    planned first, in order, then the others (which the commit cuts off, without moving a
    byte, if the plan leaves them out); None for a leaf that ``skip`` leaves out of the
    buffer altogether (its source is copied at the commit if the plan does want it).

    Those others for which ``private`` (given their local tensor) says so are ``PRIVATE``
    instead: snapshotted in process memory, so that the buffer, and the room tmpfs must have,
    holds only what this rank is predicted to write after DCP's de-duplication. With
    ``private`` and no prediction, every raw leaf counts as one of the others."""
    offsets: list[int | None] = [None] * len(leaves)
    end = 0
    # Only raw tensors take room in the buffer: the others are snapshotted DCP's way.
    raw = [copier.raw_copyable(_local(t)) for t in leaves]
    wanted = [r and prediction.wanted(t) for r, t in zip(raw, leaves)]
    if private is not None and prediction.planned is None:
        wanted = [False] * len(leaves)
    head = [i for i, w in enumerate(wanted) if w]
    tail = [i for i, w in enumerate(wanted) if raw[i] and not w and not skip(leaves[i])]
    for i in tail:
        if private is not None and private(_local(leaves[i])):
            offsets[i] = PRIVATE
    for i in head + [i for i in tail if offsets[i] is None]:
        offsets[i] = end
        local = _local(leaves[i])
        end += align(local.numel() * local.element_size())
    return offsets, end


def _host(t: torch.Tensor) -> bool:
    return not device_staging.on_device(t)


def _everything(_: torch.Tensor) -> bool:
    return True


def staged_bytes(tensors: list[torch.Tensor]) -> int:
    """The buffer region the raw tensors take (the others are committed DCP's way)."""
    return sum(align(t.numel() * t.element_size()) for t in tensors if copier.raw_copyable(t))


@dataclass
class Staged:
    """What staging hands to the commit: one rank's state dict in its tmpfs shard buffer, or
    the error that stopped it. ``MemoryStorageWriter.write_data`` consumes it.

    Made once, by ``stage_now``, ``stage_overlapped`` or ``failed``; only ``staged_at`` is set
    later, by an overlapped stage's copy on the staging thread.
    """

    step: int
    rank: int  # the rank the buffer was taken for
    nbytes: int = 0  # the staged region, at the start of the buffer
    shard: ShardWriter | None = None  # None in DCP's checkpoint process: reopened by name
    views: Any = None  # the state dict as views of the buffer: what DCP saves
    digests: Digests = field(default_factory=dict)  # checksums taken while copying
    overlapped_bytes: int = 0  # copied on the staging thread after the call returned
    # Tensor bytes the host copied or hashed (device tensors: none; set once staged).
    host_bytes: int = 0
    copying: Future[None] | None = None  # overlapped: the staging thread's copy
    failure: BaseException | None = None  # a stage that failed before it took a buffer
    staged_at: float = 0.0  # time.perf_counter() once every byte was in the buffer
    plan_key: Hashable = None  # the state dict's structure (``plans.Prediction.key``)
    skipped_bytes: int = 0  # tensor bytes left out: predicted to be another rank's to write
    # No buffer: tmpfs had no room for the whole state and no plan was known, so every
    # tensor was snapshotted in process memory; the commit puts in tmpfs what DCP's plan
    # gives this rank (and checks the room for that alone).
    private: bool = False
    # Lets the guards go (``Snapshotter.submit_held``): a stage that left tensors out holds
    # them until the commit has copied those the plan wants after all.
    hold: Callable[[], None] | None = None

    @classmethod
    def failed(cls, step: int, rank: int, error: BaseException) -> Staged:
        """A stage that failed at the call (e.g. CapacityError): its commit fails on every
        rank, rather than leaving the other ranks waiting in DCP's collectives."""
        return cls(step, rank, views={}, failure=error, staged_at=time.perf_counter())

    def result(self) -> Any:
        """The views to save, once every byte is in place (waits for an overlapped copy,
        whether or not it failed: ``error()`` says)."""
        if self.copying is not None:
            # exception() also returns once the copy is cancelled (a close that did not wait);
            # concurrent.futures.wait would not.
            with contextlib.suppress(CancelledError):
                self.copying.exception()
        return self.views

    def error(self) -> BaseException | None:
        """Why this stage failed (the commit raises it), or None; call after ``result``."""
        if self.failure is not None or self.copying is None or not self.copying.done():
            return self.failure
        if self.copying.cancelled():
            return StagingError(f"the snapshot of step {self.step} was cancelled")
        return self.copying.exception()

    def release(self) -> None:
        """Let the guards go: the sources of the tensors left out may change now (called
        once the commit copied those the plan wants, or gave up; idempotent)."""
        if self.hold is not None:
            self.hold()

    def for_another_process(self) -> Staged:
        """What DCP's checkpoint process (PROCESS mode) needs: where the region is and its
        checksums, and how it failed; not the mapping, the views or the Future."""
        return dataclasses.replace(self, shard=None, views=None, copying=None,
                                   failure=self.error(), hold=None)


def stage_now(store: LocalStore, step: int, rank: int, state_dict: dict[str, Any],
              prediction: Prediction = NO_PREDICTION) -> Staged:
    """Copy ``state_dict`` into a new shard buffer of (``step``, ``rank``), with checksums.

    Every tensor is copied (the caller may change any of them once this returns); those that
    ``prediction`` says another rank writes go last, where the commit cuts them off.
    """
    shard, layout, nbytes = _take_buffer(store, step, rank, state_dict, None, prediction,
                                         skip=lambda _: False)
    return Staged(step, rank, nbytes, shard, layout.staged, layout.digests,
                  staged_at=time.perf_counter(), plan_key=prediction.key,
                  host_bytes=layout.host_bytes, private=shard is None)


def stage_overlapped(store: LocalStore, step: int, rank: int, state_dict: dict[str, Any],
                     snapshots: Snapshotter, deferrable: set[int] | None,
                     prediction: Prediction = NO_PREDICTION, leave_out: bool = False) -> Staged:
    """Place ``state_dict`` in a new shard buffer and copy now every tensor whose storage is
    not in ``deferrable`` (None: defer every tensor); ``snapshots``' staging thread copies the
    rest (``copying``). Everything that is not a tensor is captured now.

    With ``leave_out``, a deferrable tensor that ``prediction`` says another rank writes is
    not staged at all: the guards then wait (``Staged.hold``) until the commit has copied
    those of them that DCP's plan gives this rank after all, so the snapshot stays exact.
    Without it, such tensors are staged last, for the commit to cut off.

    A failed copy fails ``copying``; the snapshotter raises it at the next guard point and the
    commit on this rank, so that the step fails on every rank.
    """
    def defer(t: torch.Tensor) -> bool:
        return deferrable is None or storage_ptr(t) in deferrable

    def skip(leaf: torch.Tensor) -> bool:
        return leave_out and defer(_local(leaf))

    shard, layout, nbytes = _take_buffer(store, step, rank, state_dict, defer, prediction, skip)
    staged = Staged(step, rank, nbytes, shard, layout.staged, layout.digests,
                    overlapped_bytes=sum(c.nbytes for c in layout.deferred),
                    plan_key=prediction.key, skipped_bytes=layout.skipped_bytes,
                    private=shard is None)

    def copy_rest(copied: Callable[[], None]) -> None:  # on the staging thread
        copy_deferred(layout, copied)
        staged.host_bytes = layout.host_bytes
        staged.staged_at = time.perf_counter()

    if layout.skipped_bytes:
        staged.copying, staged.hold = snapshots.submit_held(copy_rest, label=step)
    else:
        staged.copying = snapshots.submit(copy_rest, label=step)
    # A copy cancelled before it ran (a close that does not wait) never waits for the call's
    # device copies: done here, before the buffer is given back.
    staged.copying.add_done_callback(lambda f: layout.at_call.settle() if f.cancelled() else None)
    return staged


def _take_buffer(store: LocalStore, step: int, rank: int, state_dict: dict[str, Any],
                 defer: Callable[[torch.Tensor], bool] | None, prediction: Prediction,
                 skip: Callable[[torch.Tensor], bool]) -> tuple[ShardWriter | None, Layout, int]:
    """The shard buffer of the stage, and the state dict laid out and copied into it.

    Every tensor goes in the (recycled, already touched) buffer when tmpfs has the room: the
    tensors predicted planned (``plans.py``) first, the others after them, for the commit to
    cut off without moving a byte. When tmpfs lacks that room, the room asked is what this
    rank will write after DCP's de-duplication: the others, which the plan gives another rank,
    are snapshotted in process memory (``PRIVATE``) instead (those in device memory only when
    that is still too much: they reach the buffer by DMA). The fast path stays the common one:
    fresh process memory costs page faults at every save, the recycled buffer does not.
    Without a prediction (a first save, a new structure) and no room for every tensor, none
    goes in the buffer: every tensor is snapshotted in process memory, and the commit
    reserves what the plan gives this rank (None is returned for the buffer)."""
    leaves = leaves_of(state_dict)
    shard: ShardWriter | None
    if prediction.planned is not None:
        offsets, nbytes = lay_out(leaves, prediction, skip)
        for private in (_host, _everything):
            try:
                shard = store.begin_shard(step, rank, nbytes)
                break
            except CapacityError:
                offsets, fewer = lay_out(leaves, prediction, skip, private=private)
                if fewer == nbytes and private is _everything:
                    raise  # the tensors this rank is to write do not fit
                nbytes = fewer
        else:
            shard = store.begin_shard(step, rank, nbytes)
    else:
        offsets, nbytes = lay_out(leaves, prediction, skip)
        try:
            shard = store.begin_shard(step, rank, nbytes)
        except CapacityError:
            offsets, nbytes = lay_out(leaves, prediction, skip, private=_everything)
            shard = None
    try:
        on_device = [_local(t) for t in leaves if device_staging.on_device(_local(t))]
        if shard is not None and on_device:
            shard.page_lock(on_device[0].device.index)  # the rank's device
        buffer = shard.buffer.tensor if shard is not None else torch.empty(0, dtype=torch.uint8)
        layout = stage_into(state_dict, buffer, defer, offsets)
    except BaseException:
        if shard is not None:
            shard.abort()
        raise
    if shard is not None:
        shard.cursor = nbytes  # the staged region is taken
    return shard, layout, nbytes


@dataclass
class _Copy:
    """A tensor copy still to run: ``src`` into ``dst`` (a view of the buffer)."""

    src: torch.Tensor  # also keeps the source alive until it is copied
    dst: torch.Tensor
    offset: int
    nbytes: int
    ptr: int  # src's address when it was placed: a tensor resized or replaced since is refused


@dataclass
class Layout:
    """A state dict placed in a buffer: ``staged`` holds views of it. ``digests`` has the
    checksums taken so far; ``deferred`` the copies ``copy_deferred`` still runs; ``unhashed``
    the regions torch copied on the host (strided sources) that no checksum covers yet;
    ``at_call`` the device copies of the call, whose checksums the device is computing."""

    staged: Any
    base: int
    digests: Digests = field(default_factory=dict)
    deferred: list[_Copy] = field(default_factory=list)
    unhashed: list[tuple[int, int]] = field(default_factory=list)  # (offset, nbytes)
    at_call: DeviceCopies = field(default_factory=DeviceCopies)
    ready: Any = None  # CUDA event after the call-time device copies, on the caller's stream
    skipped_bytes: int = 0  # tensors left out of the buffer (``lay_out``)
    host_bytes: int = 0  # tensor bytes the host copied or hashed


def stage_into(obj: Any, buffer_tensor: torch.Tensor,
               defer: Callable[[torch.Tensor], bool] | None = None,
               offsets: list[int | None] | None = None) -> Layout:
    """Return the layout of ``obj`` in ``buffer_tensor`` (uint8): a copy of ``obj`` whose
    tensors are views of the buffer, with the checksums taken on the way.

    Tensors keep dtype, shape and DTensor sharding; other leaves are deep-copied now, so that
    training may mutate the originals once this returns. Every tensor is copied now unless
    ``defer(tensor)`` says it may wait for ``copy_deferred``. Contiguous CPU tensors go through
    the copier (checksummed in the same pass); strided ones are copied by torch and hashed
    later. Device tensors are copied into the (page-locked) buffer and checksummed on the
    device, both on the caller's stream, so what runs on that stream afterwards cannot change
    what they read (``device_staging.py``).

    ``offsets`` (from ``lay_out``, one per tensor leaf in walk order) places each tensor;
    a leaf whose offset is None stays out of the buffer: its view is the leaf itself. Without
    it, tensors are laid out one after the other.
    """
    layout = Layout(staged=None, base=buffer_tensor.data_ptr())
    next_offset, spans = 0, []
    copies: list[copier.Span] = []  # into process memory (``PRIVATE``): copied, not hashed
    places = iter(offsets) if offsets is not None else None

    def stage(t: torch.Tensor, key: str) -> torch.Tensor:
        nonlocal next_offset
        local = _local(t).detach()
        offset = next(places) if places is not None else next_offset
        if not copier.raw_copyable(local):  # DCP's own route, taken now: never deferred
            return _like(t, serialized.snapshot(local, key))  # (lay_out gave it no room)
        n = local.numel() * local.element_size()
        if offset is None:  # another rank's to write, as predicted: see Staged.hold
            layout.skipped_bytes += n
            return t
        if offset == PRIVATE:  # snapshotted in process memory (``lay_out``), copied now
            private = torch.empty(local.shape, dtype=local.dtype)
            if plain_cpu(local):  # on the copier's threads, with the others; not hashed
                copies.append(copier.Span(src=local.data_ptr(), nbytes=n,
                                          dst=private.data_ptr(), algorithm=None))
            else:
                private.copy_(local)
            layout.host_bytes += n
            return _like(t, private)
        next_offset = offset + align(n)
        dst = _region(buffer_tensor, offset, n, own_storage=isinstance(t, DTensor))
        dst = dst.view(local.dtype).view(local.shape)
        if defer is not None and n and defer(local):
            layout.deferred.append(_Copy(local, dst, offset, n, local.data_ptr()))
        elif device_staging.on_device(local):
            layout.at_call.add(local, dst, offset, n)
        elif plain_cpu(local):
            spans.append(copier.Span(src=local.data_ptr(), nbytes=n, dst=layout.base + offset))
        else:
            dst.copy_(local)
            layout.unhashed.append((offset, n))
            layout.host_bytes += n
        return _like(t, dst)

    try:
        layout.staged = _walk(obj, stage)  # the sources stay alive: ``obj`` holds them
    except _Uncopyable as e:
        key, value = _flat_entry(obj, e.path, e.value)
        raise entry_error(key, e.cause, value) from e.cause
    _add_digests(layout, spans, copier.process(spans + copies)[:len(spans)])
    try:
        if layout.at_call:
            layout.at_call.enqueue()
        if defer is None:
            layout.digests.update(layout.at_call.wait())
            layout.at_call = DeviceCopies()
        else:  # the staging thread's copies start after what the caller's streams did so far
            layout.ready = call_event([c.src for c in layout.deferred] + layout.at_call.sources)
    except BaseException:
        layout.at_call.settle()  # the caller gives the buffer back: no copy may still write it
        raise
    return layout


def copy_deferred(layout: Layout, copied: Callable[[], None] = lambda: None) -> None:
    """Run ``layout``'s deferred copies (on the staging thread) and take every missing
    checksum. ``copied`` is called once the bytes are in the buffer, before the hashing of
    what torch copied: from then on training may change the sources.

    Device tensors are copied on a stream of their own, ordered after the caller's stream at
    the time of ``stage_into``, straight into the page-locked tmpfs buffer, and checksummed on
    the device from their sources on the same stream; both complete on one event. One copy, no
    bounce buffer, and the host reads none of their bytes (``device_staging.py``).
    """
    device_copies = DeviceCopies()
    try:
        _copy_deferred(layout, device_copies, copied)
    except BaseException:
        # The buffer goes back to the pool with the failed step: first, every device copy
        # into it (the call's and these) must be over, or the next save's bytes get overwritten.
        layout.at_call.settle()
        device_copies.settle()
        raise


def _copy_deferred(layout: Layout, device_copies: DeviceCopies, copied: Callable[[], None]) -> None:
    spans = []
    for c in layout.deferred:
        if c.src.data_ptr() != c.ptr or c.src.numel() * c.src.element_size() != c.nbytes:
            raise StagingError(f"a tensor of {c.nbytes} bytes was resized or replaced before "
                               "its snapshot was taken; call ckpt.wait_staged() before changing "
                               "tensors outside optimizer.step()")
        if device_staging.on_device(c.src):
            device_copies.add(c.src, c.dst, c.offset, c.nbytes)
        elif plain_cpu(c.src):
            spans.append(copier.Span(src=c.ptr, nbytes=c.nbytes, dst=layout.base + c.offset))
        else:
            c.dst.copy_(c.src)
            layout.unhashed.append((c.offset, c.nbytes))
            layout.host_bytes += c.nbytes
    if device_copies:
        device_copies.enqueue(side_stream, after=layout.ready)
    _add_digests(layout, spans, copier.process(spans))
    if layout.at_call:  # the call's device copies: enqueued before ``ready`` was recorded
        layout.digests.update(layout.at_call.wait())
        layout.at_call = DeviceCopies()
    if device_copies:
        layout.digests.update(device_copies.wait())
    layout.deferred = []  # drop the references to the sources
    copied()
    hashed = [copier.Span(src=layout.base + off, nbytes=n) for off, n in layout.unhashed]
    _add_digests(layout, hashed, copier.process(hashed))
    layout.unhashed = []


def _add_digests(layout: Layout, spans: list[copier.Span], digests: list[int]) -> None:
    for s, d in zip(spans, digests, strict=True):
        assert s.algorithm is not None  # (staging's spans are all hashed)
        layout.digests[(s.dst if s.dst is not None else s.src) - layout.base] = (s.nbytes, d, s.algorithm)
        if s.dst is not None:  # copied and hashed here (a region only hashed was counted as copied)
            layout.host_bytes += s.nbytes


class _Uncopyable(Exception):
    """A value of the state dict that ``copy.deepcopy`` refused, at ``path``."""

    def __init__(self, path: tuple, value: Any, cause: Exception):
        super().__init__(path)
        self.path, self.value, self.cause = path, value, cause


def _flat_entry(state_dict: Any, path: tuple, value: Any) -> tuple[str, Any]:
    """The key DCP flattens ``value``, at ``path``, into, and that entry's value (torch's own
    flattening: e.g. a list without tensors is one entry)."""
    with contextlib.suppress(Exception):
        flat, paths = flatten_state_dict(state_dict)
        inside = [key for key, p in paths.items() if tuple(path[:len(p)]) == tuple(p)]
        if inside:
            key = max(inside, key=lambda key: len(paths[key]))
            return key, flat[key]
    return ".".join(map(str, path)), value


def _region(buffer_tensor: torch.Tensor, offset: int, n: int, own_storage: bool) -> torch.Tensor:
    """The ``n`` bytes at ``offset`` of the buffer. ``own_storage``: as a storage object of
    their own (the same memory): torch's multiprocessing pickler, which sends staged state
    to DCP's PROCESS-mode checkpoint process, crashes on two DTensors whose local tensors
    share one storage. (That process then appends those items anew, not knowing their place.)"""
    region = buffer_tensor[offset:offset + n]
    return torch.from_numpy(region.numpy()) if own_storage and n else region  # (empty: no bytes)


def _like(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` in ``t``'s place: a DTensor keeps its sharding."""
    return DTensor(local, t._spec, requires_grad=False) if isinstance(t, DTensor) else local


def _walk(obj: Any, fn: Callable[[torch.Tensor, str], torch.Tensor], path: tuple = ()) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor, key)`` (``key``: its dotted path,
    for errors) and every other leaf deep-copied (one that refuses: ``_Uncopyable``)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, ".".join(map(str, path)))
    if isinstance(obj, dict):  # a plain dict whatever the mapping type: DCP only needs Mapping
        return {k: _walk(v, fn, (*path, str(k))) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_walk(v, fn, (*path, i)) for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_walk(v, fn, (*path, i)) for i, v in enumerate(obj))
    try:
        return copy.deepcopy(obj)
    except Exception as e:  # named by its key below, not as a bare TypeError from copy
        raise _Uncopyable(path, obj, e) from e
