"""Where each item of a save goes in the shard buffer, and the copy + hash that fills it.

``MemoryStorageWriter.write_data`` builds one ``Placement`` per shard: ``keep_planned`` drops
the staged bytes that DCP's final plan does not give this rank, ``place`` decides each
item's offset (an item ``stage`` already copied keeps its staged region; byte items and late
tensors are appended), ``confirm_restaged`` checks PROCESS-mode tensors against the region
they were staged in, ``copy_and_hash`` runs every copy and checksum on the copier's threads,
``finish_device`` the copies of device tensors (checksummed on the device, ``device_staging``),
and ``record`` writes the manifest entry and DCP's WriteResult.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..integrity import copier, digests
from ..integrity.verify import digests_agree
from ..store.layout import ItemLocation
from ..store.local_store import ShardWriter, align
from ..store.manifest import ManifestItem
from . import device_staging, serialized, staging
from .device_staging import DeviceCopies, Digests

log = logging.getLogger(__name__)


def item_key(index: MetadataIndex) -> str:
    """The manifest key of a DCP item: its FQN, with the chunk offset for a sharded tensor."""
    offset = "" if index.offset is None else ",".join(map(str, index.offset))
    return f"{index.fqn}@{offset}" if index.offset is not None else index.fqn


def recorded_items(metadata: Metadata, rank: int) -> list[tuple[ManifestItem, ItemLocation]]:
    """The items ``rank``'s shard of a save holds, as the save's metadata records them: its
    primaries and the copies data parallelism kept in it of other ranks' items, each as
    ``record`` listed it in the shard's manifest (offset order), with its location (whose
    places say where else its bytes are). What rebuilds a shard that is whole on no node."""
    dtypes: dict[str, str] = {}
    shapes: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            dtypes[fqn] = str(md.properties.dtype).removeprefix("torch.")
            for chunk in md.chunks:
                shapes[(fqn, tuple(chunk.offsets))] = list(chunk.sizes)
    out = []
    for index, loc in metadata.storage_data.items():
        if not isinstance(loc, ItemLocation):
            continue
        offsets = [loc.offset] if loc.rank == rank else []
        offsets += [offset for r, offset in loc.copies if r == rank and r != loc.rank]
        tensor = loc.is_tensor and index.fqn in dtypes
        for offset in offsets:
            item = ManifestItem(
                key=item_key(index), offset=offset, nbytes=loc.nbytes, checksum=loc.checksum,
                kind="tensor" if tensor else "bytes", dtype=dtypes[index.fqn] if tensor else None,
                shape=shapes.get((index.fqn, tuple(index.offset or ()))) if tensor else None,
                algorithm=loc.algorithm)
            out.append((item, loc))
    return sorted(out, key=lambda pair: pair[0].offset)


@dataclass
class Placed:
    """A write item with its place in the shard; ``span`` is the copy/hash still to run."""

    item: WriteItem
    offset: int
    nbytes: int
    tensor: torch.Tensor | None = None  # also keeps the source alive until it is copied
    span: copier.Span | None = None
    digest: int = 0
    twin: copier.Span | None = None  # the tensor whose bytes ``span`` should already hold
    raw: bool = True  # False: stored as DCP stores it (byte items; tensors not raw_copyable)
    algorithm: str = digests.XXH3  # of ``digest`` (or of the span that takes it)


def copy_and_hash(placed: list[Placed]) -> int:
    """Run the copies and checksums ``place`` left to do, all at once on the copier; returns
    the bytes the host copied or hashed."""
    todo = [(p, p.span) for p in placed if p.span is not None]
    for (p, span), digest in zip(todo, copier.process([span for _, span in todo]), strict=True):
        assert span.algorithm is not None  # (every span here is hashed)
        p.digest, p.algorithm = digest, span.algorithm
    return sum(span.nbytes for _, span in todo)


def _append_tensor(shard: ShardWriter, t: torch.Tensor) -> tuple[int, int]:
    """Append a tensor's bytes after the mapped region, like a byte item."""
    return shard.append_bytes(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy())


class Placement:
    """Places the items of one save in ``shard``.

    Args:
        shard: this rank's shard, staged or fresh.
        staged_digests: offset -> (nbytes, checksum, algorithm) that ``stage`` took while copying.
        restaged_bytes: the staged region's size when this runs in DCP's checkpoint process
            (PROCESS mode) on a buffer reopened by name; None otherwise.
    """

    def __init__(self, shard: ShardWriter, staged_digests: Digests, restaged_bytes: int | None):
        self.shard = shard
        self._staged_digests = staged_digests
        self._restaged_bytes = restaged_bytes
        self._moved: dict[int, int] = {}  # staged offset -> offset after ``keep_planned``
        self._device = DeviceCopies()  # device tensors placed here, copied by ``finish_device``
        self._on_device: dict[int, Placed] = {}  # their offset -> what they are placed as
        self.host_bytes = 0  # tensor and byte items' bytes the host copied, hashed or moved

    def keep_planned(self, resolved: list[tuple[WriteItem, Any]]) -> None:
        """Keep in the staged region only the tensors of this rank's final plan (``resolved``:
        each item with what the planner resolved it to), moved down over the gaps that the
        others leave, and end the shard's data after them (``ShardWriter.trim``). When the
        stage followed the plan (``dcp/plans.py``), nothing moves: the unplanned bytes, if
        any, lie at the end and are cut off."""
        regions: dict[int, int] = {}
        for item, data in resolved:
            if item.type != WriteItemType.BYTE_IO and copier.raw_copyable(data):
                t = data.detach()
                nbytes = t.numel() * t.element_size()
                at = self._staged_offset(t, nbytes)
                if at is not None and nbytes:
                    regions[at] = max(nbytes, regions.get(at, 0))
        base, end, moved = self.shard.buffer.base_ptr, 0, {}
        for at, nbytes in sorted(regions.items()):
            if at < end:  # views that overlap (not ours): leave the region as it is
                return
            if at != end:
                ctypes.memmove(base + end, base + at, nbytes)
                self.host_bytes += nbytes
                moved[at] = end
            end = align(end + nbytes)
        self._moved = moved
        self._staged_digests = {moved.get(at, at): d for at, d in self._staged_digests.items()
                                if at in regions}
        self.shard.trim(end)
        if moved:
            log.debug("moved %d staged tensors of step %d over bytes the plan left out",
                      len(moved), self.shard.step)

    def _staged_offset(self, t: torch.Tensor, nbytes: int) -> int | None:
        """Where the stage put ``t``'s bytes (before ``keep_planned`` moved them), if it did."""
        at = self.shard.buffer.contains(t)
        return at if at is not None else self._restaged_offset(t, nbytes)

    def place(self, item: WriteItem, data: Any) -> Placed:
        """Decide where ``item`` (``data`` is what the planner resolved it to) goes; the tensor
        copies run later, all at once."""
        shard = self.shard
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO)
            raw = data.getvalue()
            offset, digest = shard.append_bytes(raw)
            self.host_bytes += len(raw)
            return Placed(item, offset, len(raw), digest=digest, raw=False)
        assert isinstance(data, torch.Tensor)
        t = data.detach()
        if not copier.raw_copyable(t):
            return self._place_serialized(item, t)
        nbytes = t.numel() * t.element_size()
        base = shard.buffer.base_ptr
        staged_at, twin = shard.buffer.contains(t), None  # staged: the bytes are in place
        if staged_at is None:  # PROCESS mode: a copy of a staged view; confirmed before use
            staged_at = self._restaged_offset(t, nbytes)
            twin = copier.Span(src=t.data_ptr(), nbytes=nbytes) if staged_at is not None else None
        if staged_at is not None:
            staged_at = self._moved.get(staged_at, staged_at)
        if staged_at is not None and staged_at + nbytes > shard.region:  # cut off: not staged
            staged_at = twin = None
        if staged_at is not None:  # hash the staged region unless staging did
            known = self._staged_checksum(staged_at, nbytes)
            if known is None:
                span = copier.Span(src=base + staged_at, nbytes=nbytes)
                return Placed(item, staged_at, nbytes, t, span, twin=twin)
            if twin is not None:  # compared under the algorithm the staged bytes were hashed with
                twin = dataclasses.replace(twin, algorithm=known[1])
            return Placed(item, staged_at, nbytes, t, digest=known[0], twin=twin, algorithm=known[1])
        if shard.cursor + nbytes > shard.region:
            offset, digest = _append_tensor(shard, t)  # a tensor DCP produced after staging
            self.host_bytes += nbytes
            return Placed(item, offset, nbytes, t, digest=digest)
        offset = shard.cursor
        shard.cursor = align(offset + nbytes)
        dst = shard.buffer.tensor[offset:offset + nbytes]
        if device_staging.on_device(t):  # straight into the page-locked buffer; hashed on the device
            shard.page_lock(t.device.index)
            placed = Placed(item, offset, nbytes, t, algorithm=digests.WSUM)  # (set again when it lands)
            self._device.add(t, dst.view(t.dtype).view(t.shape), offset, nbytes)
            self._on_device[offset] = placed
            return placed
        if staging.plain_cpu(t):
            span = copier.Span(src=t.data_ptr(), nbytes=nbytes, dst=base + offset)
        else:  # a strided view: torch copies it now; the hash comes with the rest
            dst.view(t.dtype).view(t.shape).copy_(t)
            self.host_bytes += nbytes
            span = copier.Span(src=base + offset, nbytes=nbytes)
        return Placed(item, offset, nbytes, t, span)

    def finish_device(self) -> None:
        """Copy the device tensors ``place`` placed, on the current stream, with their
        checksums computed on the device, and wait for both."""
        if not self._device:
            return
        self._device.enqueue()
        for offset, (_, digest, algorithm) in self._device.wait().items():
            placed = self._on_device[offset]
            placed.digest, placed.algorithm = digest, algorithm
        self._device, self._on_device = DeviceCopies(), {}

    def _place_serialized(self, item: WriteItem, t: torch.Tensor) -> Placed:
        """A tensor without raw bytes (a subclass, a quantized tensor): appended as the bytes
        DCP's FileSystemWriter writes for it, checksummed as they are written."""
        raw = serialized.serialize(t, item.index.fqn)
        offset, digest = self.shard.append_bytes(raw)
        return Placed(item, offset, len(raw), t, digest=digest, raw=False)

    def confirm_restaged(self, placed: list[Placed]) -> None:
        """Compare each PROCESS-mode tensor with the staged region it was taken for (by
        checksum; the region's was usually taken while staging). Where they differ the tensor
        is appended like any late tensor: the region may hold another item's staged bytes, so
        it is never overwritten."""
        twins = [(p, p.twin) for p in placed if p.twin is not None]
        if not twins:
            return
        unhashed = [(p, p.span) for p, _ in twins if p.span is not None]  # staged by torch: no checksum yet
        taken = copier.process([twin for _, twin in twins] + [span for _, span in unhashed])
        self.host_bytes += sum(twin.nbytes for _, twin in twins)
        for (p, span), digest in zip(unhashed, taken[len(twins):], strict=True):
            assert span.algorithm is not None
            p.digest, p.algorithm = digest, span.algorithm
            self.host_bytes += span.nbytes
        for (p, _), sent in zip(twins, taken[:len(twins)], strict=True):
            if not digests_agree(p.digest, sent):
                log.warning("staged bytes of %s differ from the tensor DCP sent; writing it anew",
                            p.item.index.fqn)
                assert p.tensor is not None  # twins are tensors
                p.offset, p.digest = _append_tensor(self.shard, p.tensor)
                p.algorithm = digests.XXH3
            p.span = p.twin = None

    def record(self, p: Placed, rank: int) -> WriteResult:
        """Add ``p`` to the shard's manifest; DCP's WriteResult carries its ItemLocation."""
        t = p.tensor if p.raw else None
        algorithm = digests.recorded_as(p.algorithm)
        self.shard.add_item(ManifestItem(
            key=item_key(p.item.index), offset=p.offset, nbytes=p.nbytes, checksum=p.digest,
            kind="tensor" if t is not None else "bytes",
            dtype=str(t.dtype).removeprefix("torch.") if t is not None else None,
            shape=list(t.shape) if t is not None else None, algorithm=algorithm))
        loc = ItemLocation(rank=rank, offset=p.offset, nbytes=p.nbytes, checksum=p.digest,
                           is_tensor=t is not None, algorithm=algorithm)
        return WriteResult(index=p.item.index, size_in_bytes=p.nbytes, storage_data=loc)

    def _staged_checksum(self, offset: int, nbytes: int) -> tuple[int, str] | None:
        """The checksum ``stage`` took of the region at ``offset`` and its algorithm, if it
        took one of this size."""
        known = self._staged_digests.get(offset)
        return (known[1], known[2]) if known is not None and known[0] == nbytes else None

    def _restaged_offset(self, t: torch.Tensor, nbytes: int) -> int | None:
        """Where a tensor DCP handed to its checkpoint process (PROCESS mode) was staged.

        DCP sends the staged views to that process through torch multiprocessing, which moves
        their storage (our whole staging buffer) into shared memory of its own. A view keeps
        its offset in that storage, so it names the staged region its bytes came from, and the
        bytes need not be written a second time. ``confirm_restaged`` checks the contents
        match before they are used.
        """
        staged = self._restaged_bytes
        if staged is None or not staging.plain_cpu(t) or t.untyped_storage().nbytes() < staged:
            return None
        offset = int(t.storage_offset()) * t.element_size()
        return offset if offset + nbytes <= staged else None
