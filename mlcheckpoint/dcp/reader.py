"""MemoryStorageReader: a DCP StorageReader over the node's tmpfs store.

Recovery path end: DCP asks for items -> each is located through the global metadata
(rank, offset, checksum) -> the owner rank's shard is mapped here (or first fetched from a
node that holds it) -> bytes are verified and copied into the state dict in one pass.
"""

from __future__ import annotations

import io
import logging
import pickle
from collections import defaultdict
from torch.futures import Future
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ..errors import CorruptShardError, ShardNotFoundError
from ..store.checksum import checksum, verify_into
from ..store.layout import ItemLocation
from ..store.local_store import LocalStore
from .writer import parse_step

log = logging.getLogger(__name__)

# fetch(step, rank) makes rank's shard of step present in the local store (rank=None: metadata).
Fetcher = Callable[[int, "int | None"], None]


class MemoryStorageReader(StorageReader):
    """Loads one checkpoint step from the node's tmpfs store with ``dcp.load``.

    Every byte is checked against the checksum recorded at save time before it is used; a
    mismatch raises CorruptShardError. Shards that live on another node are pulled in with
    ``fetch`` (set by CheckpointManager when replication is on).
    """

    def __init__(self, step: int, store: LocalStore | None = None, *, job_id: str | None = None,
                 local_dir: str | None = None, fetch: Fetcher | None = None):
        super().__init__()
        self.step = parse_step(step)
        self.store = store if store is not None else LocalStore(local_dir, job_id)
        self.fetch = fetch
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

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            _, payload = self.store.read_metadata(self.step)
        except ShardNotFoundError:
            if self.fetch is None:
                raise
            self.fetch(self.step, None)
            _, payload = self.store.read_metadata(self.step)
        metadata = pickle.loads(payload)
        if not isinstance(metadata, Metadata):
            raise CorruptShardError(f"metadata of step {self.step} is not a DCP Metadata")
        return metadata

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

    def _map(self, rank: int):
        try:
            return self.store.map_shard(self.step, rank)
        except ShardNotFoundError:
            if self.fetch is None:
                raise
            self.fetch(self.step, rank)
            return self.store.map_shard(self.step, rank)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_rank: dict[int, list[ReadItem]] = defaultdict(list)
        for req in plan.items:
            by_rank[self._location(req.storage_index).rank].append(req)
        verified: set[tuple[int, int, int]] = set()
        for rank, reqs in sorted(by_rank.items()):
            _, buf = self._map(rank)
            for req in reqs:
                loc = self._location(req.storage_index)
                src = buf.array[loc.offset:loc.offset + loc.nbytes]
                first = (rank, loc.offset, loc.nbytes) not in verified
                verified.add((rank, loc.offset, loc.nbytes))
                if req.type == LoadItemType.BYTE_IO:
                    if checksum(src) != loc.checksum:
                        self._corrupt(rank, req)
                    planner.load_bytes(req, io.BytesIO(src.tobytes()))
                else:
                    self._read_tensor(req, loc, src, planner, verify=first, rank=rank)
                self.bytes_read += loc.nbytes
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_tensor(self, req: ReadItem, loc: ItemLocation, src, planner: LoadPlanner, *,
                     verify: bool, rank: int) -> None:
        assert self._metadata is not None
        idx = req.storage_index
        dtype = self._metadata.state_dict_metadata[idx.fqn].properties.dtype
        sizes = self._chunk_sizes[(idx.fqn, tuple(idx.offset))]
        stored = torch.from_numpy(src).view(dtype).view(sizes)
        view = stored
        for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            view = view.narrow(dim, off, length)
        target = planner.resolve_tensor(req).detach()
        whole = view.numel() == stored.numel()
        if (verify and whole and target.device.type == "cpu" and target.is_contiguous()
                and target.dtype == dtype and target.numel() == stored.numel()):
            ok = verify_into(target, src, loc.checksum)  # one pass: hash and copy per chunk
        else:
            ok = (not verify) or checksum(src) == loc.checksum
            if ok:
                target.copy_(view.reshape(target.shape) if target.shape != view.shape else view)
        if not ok:
            self._corrupt(rank, req)
        planner.commit_tensor(req, target)

    def _corrupt(self, rank: int, req: ReadItem) -> None:
        msg = (f"checksum mismatch reading {req.storage_index.fqn!r} of step {self.step} from "
               f"rank {rank}'s shard in {self.store.job_dir}")
        log.error(msg)
        raise CorruptShardError(msg)
