"""MemoryStorageReader: a DCP StorageReader over the node's tmpfs store.

Recovery path end: DCP asks for items -> each is located through the global metadata
(rank, offset, checksum, and the copies data parallelism kept of it in other ranks' shards)
-> it is read from the nearest place that holds it: a shard on this node (its owner's, a
replica, or another rank's shard holding a copy), else streamed from the other nodes that
hold one, through ``remote``, spread over them -> bytes are verified and copied into the
state dict in one pass. Items for device memory go through a small ring of page-locked
buffers (``ring.py``), verified on the device where they were checksummed there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import pickle
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._gc import pausing_gc
from ..errors import CopyId, CorruptShardError, MLCheckpointError, ShardNotFoundError
from ..integrity import copier, digests
from ..integrity.checksum import as_byte_tensor
from ..integrity.verify import (
    Listing,
    digest_item,
    digests_agree,
    integrity_error,
)
from ..store.layout import ItemLocation, parse_step
from ..store.local_store import LocalStore, ShardSource
from ..store.manifest import ManifestItem
from . import ring, serialized
from .remote import Place, RemoteReads, fetch_items, places_of

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)
HERE = "here"  # a read from this node's shard (the other reads name a copy group, or None)


def _stored_dtype(metadata: Metadata | None, fqn: str) -> torch.dtype:
    assert metadata is not None, "set_up_storage_reader runs before any read"
    md = metadata.state_dict_metadata[fqn]
    if not isinstance(md, TensorStorageMetadata):
        raise CorruptShardError(f"item {fqn!r} is not a tensor in the checkpoint's metadata")
    return md.properties.dtype


def _chunk_key(index: MetadataIndex) -> tuple[str, tuple[int, ...]]:
    """Where a stored tensor chunk's size is kept (``_chunk_sizes``)."""
    return index.fqn, tuple(index.offset or ())


def _fits_directly(target: torch.Tensor, req: ReadItem, metadata: Metadata | None,
                   device: str = "cpu") -> bool:
    """Whether a whole stored item can be copied raw into ``target`` (same dtype and size,
    dense, on ``device``'s type)."""
    dtype = _stored_dtype(metadata, req.storage_index.fqn)
    return (copier.raw_copyable(target) and target.device.type == device
            and target.is_contiguous() and not target.is_conj()
            and not target.is_neg() and target.dtype == dtype
            and target.numel() == math.prod(req.lengths))


def _copy_view(target: torch.Tensor, view: torch.Tensor, non_blocking: bool = False) -> None:
    """Copy (and cast) the stored part ``view`` into ``target``, reshaping where DCP's
    request and the target disagree only in shape. ``non_blocking`` (a device target, from a
    page-locked mapping): the caller synchronizes before anyone reads ``target``."""
    target.copy_(view.reshape(target.shape) if target.shape != view.shape else view,
                 non_blocking=non_blocking)


def _load_stored_as_dcp(planner: LoadPlanner, req: ReadItem, raw: bytes) -> None:
    """Hand a verified item that is not raw tensor bytes to the planner, as DCP's reader does:
    a byte item as it is, a tensor as ``serialized`` stored it."""
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(raw))
    else:
        serialized.load_into(planner, req, raw)


class MemoryStorageReader(StorageReader):
    """Loads one checkpoint step from the node's tmpfs store with ``dcp.load``.

    Every byte is checked against the checksum recorded at save time before it is used; a
    mismatch raises CorruptShardError naming the copy. Each item is read from this node when
    any shard here holds it (its owner's shard, a replica, or a copy data parallelism kept in
    another rank's shard, ``ItemLocation.copies``, as that shard's manifest lists it);
    otherwise it is streamed from another node that holds one of its places through
    ``remote`` (recovery's ``Holders``, when replication is on), straight into the
    destination tensors, the reads spread over the holders and, when a holder fails, read
    from another. An item no node holds is a ShardNotFoundError.
    """

    def __init__(self, step: int, store: LocalStore | None = None, *, job_id: str | None = None,
                 local_dir: str | None = None, remote: RemoteReads | None = None,
                 node: int | None = None, save_id: str | None = None,
                 refusals: Refusals | None = None):
        super().__init__()
        self.step = parse_step(step)
        # Every copy this load refuses is heard once (a resume passes one for all its loads).
        self.refusals = Refusals() if refusals is None else refusals
        self.save_id = save_id  # recovery's choice: copies of any other save count as absent
        self.store = store if store is not None else LocalStore(local_dir, job_id)
        self.remote = remote
        self.node = node  # this node's rank, to name a bad local copy
        self.bytes_read = 0
        self._metadata: Metadata | None = None
        self._chunk_sizes: dict[tuple[str, tuple[int, ...]], torch.Size] = {}

    @property
    def checkpoint_id(self) -> str:
        return f"mlcheckpoint://{self.store.job_id}/{self.step}"

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.step = parse_step(checkpoint_id)
        self._metadata = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    @pausing_gc
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The step's global metadata, from this node's store (recovery fetches it first on a
        node that lacks it, ``Recovery._fetch``). Without a usable one here, what is returned
        raises the ShardNotFoundError or CorruptShardError that says so at its first use
        (``_Unreadable``)."""
        try:
            _, payload = self.store.metadata.read(self.step, self.save_id)
        except (ShardNotFoundError, CorruptShardError) as e:
            return cast(Metadata, _Unreadable(e))
        metadata = pickle.loads(payload)
        if not isinstance(metadata, Metadata):
            raise CorruptShardError(f"metadata of step {self.step} is not a DCP Metadata")
        return metadata

    @pausing_gc
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if isinstance(metadata, _Unreadable):
            raise metadata.error
        self._metadata = metadata
        self._chunk_sizes = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._chunk_sizes[(fqn, tuple(chunk.offsets))] = chunk.sizes

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _location(self, index: MetadataIndex) -> ItemLocation:
        assert self._metadata is not None
        loc = self._metadata.storage_data[index]
        if not isinstance(loc, ItemLocation):
            raise CorruptShardError(f"item {index} was not written by mlcheckpoint")
        return loc

    @pausing_gc
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with _Shards(self._open_local, self._refuse_listed) as shards:
            here, elsewhere = self._where_to_read(plan.items, shards)
            for rank, reads in sorted(here.items()):
                source = shards.here(rank)
                assert source is not None  # _where_to_read found the item in it
                self._read_local(rank, reads, source, planner)
            if elsewhere:
                if self.remote is None:
                    req, loc = elsewhere[0]
                    raise ShardNotFoundError(f"step {self.step}: {self._nowhere(req, loc)} on this "
                                             "node, and no other node is asked (replication is off)")
                self._read_elsewhere(self.remote, elsewhere, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _where_to_read(self, items: list[ReadItem], shards: _Shards
                       ) -> tuple[dict[int, list[tuple[ReadItem, ItemLocation]]],
                                  list[tuple[ReadItem, ItemLocation]]]:
        """Which requests a shard of this node serves (per shard: each request and where in
        the shard its bytes lie), and which must come from other nodes (with the item's
        location). An item is read here when any of its places is here, its primary first:
        its owner's shard, or a copy data parallelism kept in another rank's shard, as that
        shard's manifest lists it (a partial replica lists only some of its owner's items)."""
        here: dict[int, list[tuple[ReadItem, ItemLocation]]] = defaultdict(list)
        elsewhere: list[tuple[ReadItem, ItemLocation]] = []
        from_copies: dict[int, set[int]] = defaultdict(set)  # owner -> ranks its copies are read from
        for req in items:
            loc = self._location(req.storage_index)
            place = next((p for p in places_of(loc) if shards.holds(p, loc)), None)
            if place is None:
                elsewhere.append((req, loc))
                continue
            if place != (loc.rank, loc.offset):
                from_copies[loc.rank].add(place[0])
                loc = dataclasses.replace(loc, rank=place[0], offset=place[1], copies=())
            here[loc.rank].append((req, loc))
        for owner, ranks in sorted(from_copies.items()):  # layout words: ResumeInfo.summary says it
            log.debug("mlcheckpoint: step %d: reading items of rank %d's shard from their copies "
                     "in the shards of ranks %s on this node", self.step, owner, sorted(ranks))
        return here, elsewhere

    def _nowhere(self, req: ReadItem, loc: ItemLocation) -> str:
        """Which item is missing, and where it was looked for (for an error)."""
        if loc.copies:
            return (f"item {req.storage_index.fqn!r} is neither in rank {loc.rank}'s shard nor in "
                    f"any of its copies (kept in the shards of ranks {[r for r, _ in loc.copies]})")
        return f"item {req.storage_index.fqn!r} is not in rank {loc.rank}'s shard"

    def _refuse_listed(self, rank: int, item: str, why: str) -> None:
        """This node's copy of ``rank``'s shard lists ``item`` otherwise than the step's
        metadata records it (its manifest was rewritten, or belongs to other bytes): it is
        not read, and that is said (``Refusals``)."""
        self.refusals.note(self.step, rank, self.node, f"item {item!r}", f"its manifest disagrees "
                           f"with the step's metadata: {why}")

    def _open_local(self, rank: int) -> ShardSource:
        """This node's copy of ``rank``'s shard; a damaged copy is named, so recovery can
        refuse it alone and read another."""
        try:
            return self.store.shards.open(self.step, rank, self.save_id)
        except CorruptShardError as e:
            raise CorruptShardError(str(e), copy=CopyId(self.step, rank, self.node)) from None

    def _read_local(self, rank: int, reads: list[tuple[ReadItem, ItemLocation]],
                    source: ShardSource, planner: LoadPlanner) -> None:
        """Verify and copy every item of one mapped shard; the copies and hashes run together
        on the copier's threads, then the items are handed to the planner."""
        spans: list[copier.Span] = []
        checked: list[tuple[ReadItem, ItemLocation]] = []
        later: list[tuple[ReadItem, torch.Tensor, ItemLocation | None]] = []  # (req, target, loc)
        to_device: list[tuple[ReadItem, torch.Tensor, ItemLocation]] = []
        seen: set[tuple[int, int]] = set()
        for req, loc in reads:
            self.bytes_read += loc.nbytes
            if req.type == LoadItemType.BYTE_IO or not loc.is_tensor:
                raw = source.read(loc.offset, loc.nbytes)
                if not digests_agree(loc.checksum, digest_item(raw, digests.of(loc))):
                    self._corrupt(rank, req, self.node)
                _load_stored_as_dcp(planner, req, raw)
                continue
            target = planner.resolve_tensor(req).detach()
            if self._through_ring(target):  # device memory: through the ring, below
                to_device.append((req, target, loc))
                later.append((req, target, None))
                continue
            first = (loc.offset, loc.nbytes) not in seen
            seen.add((loc.offset, loc.nbytes))
            direct = first and self._whole_item(req) and _fits_directly(target, req, self._metadata)
            if first:
                spans.append(source.span(loc.offset, loc.nbytes,
                                         target.data_ptr() if direct else None, digests.of(loc)))
                checked.append((req, loc))
            later.append((req, target, None if direct else loc))
        for (req, loc), digest in zip(checked, copier.process(spans), strict=True):
            if not digests_agree(loc.checksum, digest):
                self._corrupt(rank, req, self.node)
        for req, target, stored in later:
            if stored is not None:  # resharded or cast: torch copies from the mapping
                end = stored.offset + stored.nbytes
                _copy_view(target, self._stored_view(req, source.mapping(end).array[stored.offset:end]))
        if to_device:
            self._read_to_device(rank, to_device, source)
        for req, target, _ in later:
            planner.commit_tensor(req, target)

    def _read_to_device(self, rank: int, reads: list[tuple[ReadItem, torch.Tensor, ItemLocation]],
                        source: ShardSource) -> None:
        """Bring the stored items that device targets ask for through the ring (``ring.py``),
        each verified: a whole item straight into its target's bytes; one resharded or cast
        into a device buffer of its own, then copied into each target asking for a part of it,
        one such item at a time (its buffer freed before the next one's is made: at most one
        stored item's bytes of device memory beside the ring's). Every byte has landed, on
        every device the targets are on, when this returns.

        A target's bytes are replaced before their checksum is known: a bad item raises
        CorruptShardError and recovery reruns the whole load from another copy."""
        by_item: dict[tuple[int, int], list[tuple[ReadItem, torch.Tensor]]] = defaultdict(list)
        stored: dict[tuple[int, int], ItemLocation] = {}
        for req, target, loc in reads:
            by_item[(loc.offset, loc.nbytes)].append((req, target))
            stored[(loc.offset, loc.nbytes)] = loc
        devices = {t.device for _, t, _ in reads}
        for device in devices:
            whole: list[tuple[ring.RingRead, ReadItem]] = []
            parts: list[tuple[np.ndarray, ItemLocation, ReadItem, list[tuple[ReadItem, torch.Tensor]]]] = []
            for key, wanting in by_item.items():
                if wanting[0][1].device != device:
                    continue
                loc = stored[key]
                req, target = wanting[0]
                span = source.span(loc.offset, loc.nbytes, None)  # checks it lies in the shard
                src = source.mapping(loc.offset + loc.nbytes).array[loc.offset:loc.offset + loc.nbytes]
                assert span.nbytes == src.size
                if len(wanting) == 1 and self._whole_item(req) and \
                        _fits_directly(target, req, self._metadata, device.type):
                    whole.append((ring.RingRead(src, as_byte_tensor(target), digests.of(loc),
                                                loc.checksum), req))
                else:
                    parts.append((src, loc, req, wanting))
            loader = ring.Ring(ring.mover_for(device))
            for bad in loader.load([r for r, _ in whole]):
                self._corrupt(rank, whole[bad][1], self.node)
            for src, loc, req, wanting in parts:  # one at a time: a buffer each, made here
                buffer = torch.empty(loc.nbytes, dtype=torch.uint8, device=device)
                for bad in loader.load([ring.RingRead(src, buffer, digests.of(loc), loc.checksum)]):
                    self._corrupt(rank, req, self.node)
                for want, target in wanting:  # on the current stream, after the ring's copies
                    _copy_view(target, self._stored_view(want, buffer))
                del buffer  # freed (stream-ordered) before the next one is made
        for device in devices:
            if device.type == "cuda":  # each device the targets are on, not the current one only
                torch.cuda.synchronize(device)  # every copy has landed before the commits

    def _through_ring(self, target: torch.Tensor) -> bool:
        """Whether ``target`` is loaded through the ring: a target in CUDA memory. (Another
        accelerator's targets take the host's path: verified there, then copied by torch.)"""
        return target.device.type == "cuda"

    def _read_elsewhere(self, remote: RemoteReads, reads: list[tuple[ReadItem, ItemLocation]],
                        planner: LoadPlanner) -> None:
        """Stream the items this node holds no place of from other nodes, into the targets
        where possible, verify them, and hand them to the planner."""
        item_of = [(loc.rank, loc.offset) for _, loc in reads]  # a stored item, by its primary place
        uses = Counter(item_of)
        wanted = dict(zip(item_of, reads, strict=True))  # item -> (a request of it, its location)
        sinks: dict[Place, np.ndarray] = {}
        targets: dict[int, torch.Tensor] = {}
        direct: set[int] = set()
        for i, (req, loc) in enumerate(reads):
            if req.type == LoadItemType.BYTE_IO or not loc.is_tensor:
                continue
            target = planner.resolve_tensor(req).detach()
            targets[i] = target
            if uses[item_of[i]] == 1 and self._whole_item(req) and _fits_directly(target, req, self._metadata):
                sinks[item_of[i]] = as_byte_tensor(target).numpy()  # bytes land in the model directly
                direct.add(i)
        for item, (_, loc) in wanted.items():
            sinks.setdefault(item, np.empty(loc.nbytes, dtype=np.uint8))
        came = fetch_items(remote, self.step, {item: loc for item, (_, loc) in wanted.items()},
                           sinks, lambda item: self._nowhere(*wanted[item]))
        for item, (rank, node, digest) in came.items():  # (the rank whose shard it came from)
            req, loc = wanted[item]
            if not digests_agree(loc.checksum, digest.result()[0]):
                self._corrupt(rank, req, node)
        for i, (req, loc) in enumerate(reads):
            sink = sinks[item_of[i]]
            if req.type == LoadItemType.BYTE_IO or not loc.is_tensor:
                _load_stored_as_dcp(planner, req, sink.tobytes())
            elif i in direct:
                planner.commit_tensor(req, targets[i])
            else:
                _copy_view(targets[i], self._stored_view(req, sink))
                planner.commit_tensor(req, targets[i])
            self.bytes_read += loc.nbytes

    def _whole_item(self, req: ReadItem) -> bool:
        """Whether ``req`` asks for all of the stored item (no resharding)."""
        return (not any(req.storage_offsets)
                and tuple(req.lengths) == tuple(self._chunk_sizes[_chunk_key(req.storage_index)]))

    def _stored_view(self, req: ReadItem, src: np.ndarray | torch.Tensor) -> torch.Tensor:
        """The part of a stored item that ``req`` asks for, as a tensor view of ``src`` (its
        bytes: a uint8 array, or a uint8 tensor on a device)."""
        dtype = _stored_dtype(self._metadata, req.storage_index.fqn)
        raw = src if isinstance(src, torch.Tensor) else torch.from_numpy(src)
        view = raw.view(dtype).view(self._chunk_sizes[_chunk_key(req.storage_index)])
        for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            view = view.narrow(dim, off, length)
        return view

    def _corrupt(self, rank: int, req: ReadItem, node: int | None) -> None:
        """Raise the CorruptShardError naming the copy of ``rank``'s shard on ``node`` that
        failed (for an item read from a copy: the shard that holds the copy)."""
        if node == self.node:
            where = f"node {node} ({self.store.paths.data(self.step, rank)})"
        else:
            where = f"node {node} (job {self.store.job_id})"
        item = f"item {req.storage_index.fqn!r}"
        owner = self._location(req.storage_index).rank
        if owner != rank:
            item += f" (its copy; its primary is in rank {owner}'s shard)"
        error = integrity_error(f"step {self.step} rank {rank}'s shard on {where}", item,
                                CopyId(self.step, rank, node))
        self.refusals.note(self.step, rank, node, item, str(error), read_elsewhere=False,
                           level=logging.ERROR)
        raise error


class Refusals:
    """The copies a load refused, each heard once, on the rank that refused it: one line
    naming the step, the shard's rank, the node, the item and why (not one per item or per
    retry of the load), and their count (``ResumeInfo.refused_copies``). One resume shares
    one among its readers."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, int, int | None]] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def __getstate__(self) -> dict[str, Any]:  # a reader pickles (a lock does not)
        return {"_seen": set(self._seen)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._seen, self._lock = state["_seen"], threading.Lock()

    def note(self, step: int, rank: int, node: int | None, item: str, why: str, *,
             read_elsewhere: bool = True, level: int = logging.WARNING) -> None:
        """``rank``'s shard of ``step`` on ``node`` is refused for ``item`` ("item 'fqn'"),
        because ``why``."""
        with self._lock:
            if (step, rank, node) in self._seen:
                return
            self._seen.add((step, rank, node))
        then = "; reading its items from another place" if read_elsewhere else ""
        log.log(level, "mlcheckpoint: refused the copy of rank %d's shard of step %d on node %s "
                "(%s): %s%s", rank, step, node, item, why, then)


class _Unreadable:
    """What ``read_metadata`` returns when this node has no usable metadata of the step.

    DCP's load catches whatever ``read_metadata`` raises and fails with an AssertionError of
    its own ("metadata is None"), which hides ours. So the error travels in this object to
    ``set_up_storage_reader``, DCP's next call in the same collective step, which raises it:
    every rank sees the error that names what is missing. Any other use raises it too."""

    __slots__ = ("error",)

    def __init__(self, error: MLCheckpointError):
        self.error = error

    def __getattr__(self, name: str) -> Any:
        raise self.error


class _Shards:
    """The shards of this node one ``read_data`` reads: each opened at most once, closed
    together at the end, with the items its manifest lists."""

    def __init__(self, open_local: Callable[[int], ShardSource],
                 refused: Callable[[int, str, str], None]):
        self._open_local = open_local
        self._refused = refused  # (rank, item, why): a listed item whose record disagrees
        self._opened: dict[int, ShardSource | None] = {}
        self._listed: dict[int, Listing[ManifestItem]] = {}  # rank -> its manifest's items
        self._stack = contextlib.ExitStack()

    def here(self, rank: int) -> ShardSource | None:
        """This node's copy of ``rank``'s shard, open (None: not here)."""
        if rank not in self._opened:
            try:
                self._opened[rank] = self._stack.enter_context(self._open_local(rank))
            except ShardNotFoundError:
                self._opened[rank] = None
        return self._opened[rank]

    def holds(self, place: Place, loc: ItemLocation) -> bool:
        """Whether this node's copy of the shard of ``place``'s rank lists the item ``loc``
        describes at ``place``'s offset (same size, same checksum)."""
        rank, offset = place
        source = self.here(rank)
        if source is None:
            return False
        if rank not in self._listed:
            self._listed[rank] = Listing(source.manifest.items)
        listing = self._listed[rank]
        if not listing.lists(offset):
            return False
        why = listing.disagreement(loc, offset)
        if why is not None:
            self._refused(rank, listing.listed(offset).key, why)
        return why is None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
