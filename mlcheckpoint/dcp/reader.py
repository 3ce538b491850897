"""MemoryStorageReader: a DCP StorageReader over the node's tmpfs store.

Recovery path end: DCP asks for items -> each is located through the global metadata
(rank, offset, checksum) -> the owner rank's shard is read here (or streamed from a node that
holds it, through ``remote``; or, when no node holds it, one of the item's copies that data
parallelism kept in another rank's shard) -> bytes are verified and copied into the state
dict in one pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import pickle
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from typing import TYPE_CHECKING, Any

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
from ..errors import CopyId, CorruptShardError, ShardNotFoundError
from ..integrity import copier
from ..integrity.checksum import as_byte_tensor
from ..integrity.verify import Listing, digest_item, digests_agree, integrity_error
from ..store.coverage import group_of
from ..store.layout import ItemLocation
from ..store.local_store import LocalStore, ShardSource
from . import serialized
from .remote import RemoteReads
from .writer import parse_step

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


def _fits_directly(target: torch.Tensor, req: ReadItem, metadata: Metadata | None) -> bool:
    """Whether a whole stored item can be copied raw into ``target`` (same dtype and size,
    dense, on the CPU)."""
    dtype = _stored_dtype(metadata, req.storage_index.fqn)
    return (copier.raw_copyable(target) and target.device.type == "cpu"
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
    mismatch raises CorruptShardError. A shard this node lacks is streamed from a node that
    holds it through ``remote`` (recovery's ``Holders``, when replication is on), straight
    into the destination tensors. An item whose shard is neither here nor held by another
    node is read from one of its copies (``ItemLocation.copies``: one here first, else one
    another node holds), checked against the same checksum; without either it is a
    ShardNotFoundError.
    """

    def __init__(self, step: int, store: LocalStore | None = None, *, job_id: str | None = None,
                 local_dir: str | None = None, remote: RemoteReads | None = None,
                 node: int | None = None, save_id: str | None = None):
        super().__init__()
        self.step = parse_step(step)
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
        # Recovery fetched it first on a node that lacked it (Recovery._fetch).
        _, payload = self.store.read_metadata(self.step, self.save_id)
        metadata = pickle.loads(payload)
        if not isinstance(metadata, Metadata):
            raise CorruptShardError(f"metadata of step {self.step} is not a DCP Metadata")
        return metadata

    @pausing_gc
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
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
        with _Shards(self._open_local, self.remote, self.step) as shards:
            by_source = self._where_to_read(plan.items, shards)
            for rank, group in sorted(by_source, key=lambda key: (key[0], repr(key[1]))):
                reads = by_source[(rank, group)]
                source = shards.here(rank) if group == HERE else None
                if source is not None:
                    self._read_local(rank, reads, source, planner)
                elif self.remote is None:
                    raise shards.why_absent(rank)
                else:
                    self._read_remote(self.remote, rank, reads, planner,
                                      None if group == HERE else group)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _where_to_read(self, items: list[ReadItem], shards: _Shards
                       ) -> dict[tuple[int, Any], list[tuple[ReadItem, ItemLocation]]]:
        """Per shard to read and where (``HERE``, or another node holding the shard whole, or,
        with a copy group, a partial replica holding it), the requests it serves and where in
        it each one lies: the item's own location, or, when neither this node's shard of its
        owner nor another node's holds it, one of its copies (one here first, else one another
        node holds). A partial replica holds only the items its manifest lists."""
        reads: dict[tuple[int, Any], list[tuple[ReadItem, ItemLocation]]] = defaultdict(list)
        from_copies: dict[int, set[int]] = defaultdict(set)  # owner -> ranks its copies are read from
        for req in items:
            loc = self._location(req.storage_index)
            group = group_of(loc)
            if shards.holds_here(loc):
                reads[(loc.rank, HERE)].append((req, loc))
            elif loc.copies and (self._local_copy(loc, shards) is not None
                                 or not shards.elsewhere(loc.rank, group)):
                # a copy here is nearer than the owner's shard on another node
                owner, loc = loc.rank, self._copy_to_read(req, loc, shards)
                from_copies[owner].add(loc.rank)
                reads[(loc.rank, HERE if shards.holds_here(loc) else None)].append((req, loc))
            else:  # (held nowhere: the read fails, naming the shard no node holds)
                reads[(loc.rank, group)].append((req, loc))
        for owner, ranks in sorted(from_copies.items()):
            log.info("mlcheckpoint: rank %d's shard of step %d is on no node: reading its items "
                     "from their copies in the shards of ranks %s", owner, self.step, sorted(ranks))
        return reads

    @staticmethod
    def _local_copy(loc: ItemLocation, shards: _Shards) -> ItemLocation | None:
        """Where a shard on this node holds a copy of the item at ``loc`` (None: none does)."""
        for rank, offset in loc.copies:
            copy = dataclasses.replace(loc, rank=rank, offset=offset, copies=())
            if shards.holds_here(copy):
                return copy
        return None

    def _copy_to_read(self, req: ReadItem, loc: ItemLocation, shards: _Shards) -> ItemLocation:
        """The location of a copy of the item at ``loc`` to read instead: same bytes, same
        checksum, in another rank's shard (one here first)."""
        local = self._local_copy(loc, shards)
        if local is not None:
            return local
        held = [c for c in loc.copies if shards.elsewhere(c[0])]
        if not held:
            raise ShardNotFoundError(
                f"step {self.step}: rank {loc.rank}'s shard is on no node, nor is any copy of item "
                f"{req.storage_index.fqn!r} (kept in the shards of ranks {[r for r, _ in loc.copies]})")
        rank, offset = held[0]
        return dataclasses.replace(loc, rank=rank, offset=offset, copies=())

    def _open_local(self, rank: int) -> ShardSource:
        """This node's copy of ``rank``'s shard; a damaged copy is named, so recovery can
        refuse it alone and read another."""
        try:
            return self.store.open_shard(self.step, rank, self.save_id)
        except CorruptShardError as e:
            raise CorruptShardError(str(e), copy=CopyId(self.step, rank, self.node)) from None

    def _read_local(self, rank: int, reads: list[tuple[ReadItem, ItemLocation]],
                    source: ShardSource, planner: LoadPlanner) -> None:
        """Verify and copy every item of one mapped shard; the copies and hashes run together
        on the copier's threads, then the items are handed to the planner."""
        spans: list[copier.Span] = []
        checked: list[tuple[ReadItem, ItemLocation]] = []
        later: list[tuple[ReadItem, torch.Tensor, ItemLocation | None]] = []  # (req, target, loc)
        seen: set[tuple[int, int]] = set()
        for req, loc in reads:
            self.bytes_read += loc.nbytes
            if req.type == LoadItemType.BYTE_IO or not loc.is_tensor:
                raw = source.read(loc.offset, loc.nbytes)
                if not digests_agree(loc.checksum, digest_item(raw)):
                    self._corrupt(rank, req, self.node)
                _load_stored_as_dcp(planner, req, raw)
                continue
            first = (loc.offset, loc.nbytes) not in seen
            seen.add((loc.offset, loc.nbytes))
            target = planner.resolve_tensor(req).detach()
            direct = first and self._whole_item(req) and _fits_directly(target, req, self._metadata)
            if first:
                spans.append(source.span(loc.offset, loc.nbytes,
                                         target.data_ptr() if direct else None))
                checked.append((req, loc))
            later.append((req, target, None if direct else loc))
        for (req, loc), digest in zip(checked, copier.process(spans), strict=True):
            if not digests_agree(loc.checksum, digest):
                self._corrupt(rank, req, self.node)
        to_device = [s for _, t, s in later if s is not None and t.device.type != "cpu"]
        if to_device:  # page-locked once: the copies below run at the DMA engine's rate
            source.mapping(max(s.offset + s.nbytes for s in to_device)).register_for_device_copies()
        for req, target, stored in later:
            if stored is not None:  # resharded, cast or on a device: torch copies from the mapping
                end = stored.offset + stored.nbytes
                src = source.mapping(end).array[stored.offset:end]
                _copy_view(target, self._stored_view(req, src), non_blocking=target.device.type != "cpu")
        if to_device:
            torch.accelerator.synchronize()  # every device copy has landed before the commits
        for req, target, _ in later:
            planner.commit_tensor(req, target)

    def _read_remote(self, remote: RemoteReads, rank: int, reads: list[tuple[ReadItem, ItemLocation]],
                     planner: LoadPlanner, group: tuple[int, ...] | None = None) -> None:
        """Stream the items of a shard held elsewhere, into the targets where possible."""
        uses = Counter((loc.offset, loc.nbytes) for _, loc in reads)
        sinks: dict[tuple[int, int], np.ndarray] = {}
        targets: dict[int, torch.Tensor] = {}
        direct: set[int] = set()
        for i, (req, loc) in enumerate(reads):
            key = (loc.offset, loc.nbytes)
            if req.type == LoadItemType.BYTE_IO or not loc.is_tensor:
                continue
            target = planner.resolve_tensor(req).detach()
            targets[i] = target
            if uses[key] == 1 and self._whole_item(req) and _fits_directly(target, req, self._metadata):
                sinks[key] = as_byte_tensor(target).numpy()  # bytes land in the model directly
                direct.add(i)
        for _, loc in reads:
            sinks.setdefault((loc.offset, loc.nbytes), np.empty(loc.nbytes, dtype=np.uint8))
        ranges = sorted(sinks)
        # Each range is hashed on the copier's threads as soon as it lands, while the next
        # ones arrive; a retry from another holder refills the sinks and hashes them again.
        hashing: dict[tuple[int, int], ConcurrentFuture] = {}

        def landed(i: int) -> None:
            sink = sinks[ranges[i]]
            hashing[ranges[i]] = copier.hash_later(copier.Span(src=sink.ctypes.data, nbytes=sink.nbytes))

        nodes = remote.read_ranges(self.step, rank, ranges, [sinks[k] for k in ranges], landed,
                                   group)
        came_from = dict(zip(ranges, nodes, strict=True))  # ranges may come from several nodes
        checks = {loc.offset: (req, loc) for req, loc in reads}
        for req, loc in checks.values():
            if not digests_agree(loc.checksum, hashing[(loc.offset, loc.nbytes)].result()[0]):
                self._corrupt(rank, req, came_from[(loc.offset, loc.nbytes)])
        for i, (req, loc) in enumerate(reads):
            sink = sinks[(loc.offset, loc.nbytes)]
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

    def _stored_view(self, req: ReadItem, src: np.ndarray) -> torch.Tensor:
        """The part of a stored item that ``req`` asks for, as a tensor view of ``src``."""
        dtype = _stored_dtype(self._metadata, req.storage_index.fqn)
        view = torch.from_numpy(src).view(dtype).view(self._chunk_sizes[_chunk_key(req.storage_index)])
        for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            view = view.narrow(dim, off, length)
        return view

    def _corrupt(self, rank: int, req: ReadItem, node: int | None) -> None:
        """Raise the CorruptShardError naming the copy of ``rank``'s shard on ``node`` that
        failed (for an item read from a copy: the shard that holds the copy)."""
        if node == self.node:
            where = f"node {node} ({self.store.data_path(self.step, rank)})"
        else:
            where = f"node {node} (job {self.store.job_id})"
        item = f"item {req.storage_index.fqn!r}"
        owner = self._location(req.storage_index).rank
        if owner != rank:
            item += f" (its copy: rank {owner}'s shard is on no node)"
        error = integrity_error(f"step {self.step} rank {rank}'s shard on {where}", item,
                                CopyId(self.step, rank, node))
        log.error("%s", error)
        raise error


class _Shards:
    """Where the shards one ``read_data`` reads are: here (each opened at most once, closed
    together at the end), or held by another node (asked of ``remote`` once per shard)."""

    def __init__(self, open_local: Callable[[int], ShardSource], remote: RemoteReads | None,
                 step: int):
        self._open_local, self._remote, self._step = open_local, remote, step
        self._opened: dict[int, ShardSource | None] = {}
        self._absent: dict[int, ShardNotFoundError] = {}
        self._elsewhere: dict[tuple[int, Any], bool] = {}
        self._listings: dict[int, Listing] = {}
        self._stack = contextlib.ExitStack()

    def elsewhere(self, rank: int, group: tuple[int, ...] | None = None) -> bool:
        """Whether another node holds ``rank``'s shard whole, or, with ``group``, a partial
        replica of it holding that copy group."""
        if (rank, group) not in self._elsewhere:
            self._elsewhere[(rank, group)] = (self._remote is not None
                                              and self._remote.has_holders(self._step, rank, group))
        return self._elsewhere[(rank, group)]

    def holds_here(self, loc: ItemLocation) -> bool:
        """Whether this node's shard of ``loc.rank`` holds the item at ``loc``: a whole shard
        does; a partial replica, when its manifest lists it (same offset, size, checksum)."""
        source = self.here(loc.rank)
        if source is None:
            return False
        if not source.manifest.partial:
            return True
        if loc.rank not in self._listings:
            self._listings[loc.rank] = Listing(source.manifest.items)
        return self._listings[loc.rank].holds(loc)

    def here(self, rank: int) -> ShardSource | None:
        """This node's copy of ``rank``'s shard, open (None: not here)."""
        if rank not in self._opened:
            try:
                self._opened[rank] = self._stack.enter_context(self._open_local(rank))
            except ShardNotFoundError as e:
                self._opened[rank], self._absent[rank] = None, e
        return self._opened[rank]

    def why_absent(self, rank: int) -> ShardNotFoundError:
        return self._absent.get(rank) or ShardNotFoundError(
            f"step {self._step}: the shard of rank {rank} here is a partial replica without "
            "the items asked for, and no other node is asked")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
