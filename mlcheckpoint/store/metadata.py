"""The global DCP metadata of each step: one self-verifying file, renamed into place."""

from __future__ import annotations

import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TypeVar

from ..errors import CorruptShardError, ShardNotFoundError
from ..integrity.verify import digest_item
from .coverage import Group, StepItems
from .identity import Lineage
from .layout import JobPaths
from .locks import CommitLock
from .manifest import MetadataHeader, decode_metadata, encode_metadata, item_locations
from .shards import private

T = TypeVar("T")

KEPT_ITEMS = 8  # payloads whose items the process keeps unpickled (keep is a few steps)
# Files whose verified header and copy groups a store keeps: a job saving every step names a new
# file each step, and without a bound a long run would keep every step it ever saw.
KEPT_VERSIONS = 64


class _ParsedPayloads:
    """The items of metadata payloads, unpickled once per process and payload (its checksum).

    One save's metadata is installed twice on a node (its own write, then the coordinator's
    push of the same bytes) and read by several stores and threads of a rank; unpickling a few
    hundred items takes 15 ms or more, and several times that when it sets off the collector
    in a training process's heap. Keyed by the checksum of the bytes actually parsed, so a
    file replaced meanwhile is never filed under another payload's key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one parse at a time: racing threads parse once
        self._items: OrderedDict[tuple[int, int], StepItems] = OrderedDict()

    def items(self, known: MetadataHeader, read: Callable[[], tuple[MetadataHeader, bytes]]) -> StepItems:
        """The items of the payload ``known`` describes; ``read()`` (header and payload, both
        verified) only when they are not kept."""
        with self._lock:
            key = (known.checksum, known.payload_bytes)
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            header, payload = read()
            items = StepItems(item_locations(payload))
            self._items[(header.checksum, header.payload_bytes)] = items
            while len(self._items) > KEPT_ITEMS:
                self._items.popitem(last=False)
            return items


_parsed = _ParsedPayloads()


class MetadataFiles:
    """Write, install (from a peer) and read the metadata of this job's steps on this node."""

    def __init__(self, paths: JobPaths, job_id: str, commits: CommitLock):
        self.paths, self.job_id, self.commits = paths, job_id, commits
        self._verified_headers: dict[str, tuple[tuple, MetadataHeader]] = {}
        self._groups: dict[str, tuple[tuple, dict[int, list[Group]]]] = {}

    def write(self, step: int, payload: bytes, *, world_size: int, ranks: Iterable[int],
              total_bytes: int, save_id: str = "", lineage: Lineage | None = None,
              copy_modes: Iterable[str] = ()) -> None:
        """Commit the global DCP metadata of a step (atomic; replaces an older save's)."""
        header = MetadataHeader(job_id=self.job_id, step=step, world_size=world_size,
                                ranks=sorted(set(ranks)), total_bytes=total_bytes,
                                payload_bytes=len(payload), checksum=digest_item(payload),
                                save_id=save_id,
                                copy_modes=list(copy_modes),
                                **(lineage or Lineage()).header_fields())
        self.install(step, encode_metadata(header, payload))

    def write_file(self, step: int, raw: bytes) -> None:
        """Install an encoded metadata file (e.g. received from a peer) after verifying it."""
        header, _ = _decode(step, raw)
        if header.step != step or header.job_id != self.job_id:
            raise CorruptShardError(f"metadata is for {header.job_id}/{header.step}, "
                                    f"not {self.job_id}/{step}")
        self.install(step, raw)

    def install(self, step: int, raw: bytes) -> None:
        """Put an encoded metadata file in place (not verified here)."""
        os.makedirs(self.paths.step_dir(step), mode=0o700, exist_ok=True)
        tmp = self.paths.metadata_tmp(step, secrets.token_hex(4))
        with open(tmp, "wb", opener=private) as f:
            f.write(raw)
        with self.commits.committing():  # never while a retention pass looks and retires
            os.replace(tmp, self.paths.metadata(step))

    def read(self, step: int, save_id: str | None = None) -> tuple[MetadataHeader, bytes]:
        """The verified metadata of a step; with ``save_id``, another save's counts as absent."""
        header, payload = _decode(step, self.read_file(step))
        if save_id is not None and header.save_id != save_id:
            raise ShardNotFoundError(f"metadata of step {step} here belongs to save "
                                     f"{header.save_id!r}, not {save_id!r}")
        return header, payload

    def read_file(self, step: int) -> bytes:
        try:
            with open(self.paths.metadata(step), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise ShardNotFoundError(f"step {step} has no global metadata on this node") from None

    def header(self, step: int) -> MetadataHeader:
        """The verified header of a step's metadata. The whole file is checksummed once per
        version (inode, size, mtime): listings run often (the replicator polls) and metadata of
        a large model is megabytes."""
        return self._per_version(self._verified_headers, step, lambda: self.read(step)[0])

    def copy_groups(self, step: int) -> dict[int, list[Group]]:
        """Which other ranks' shards hold agreeing copies of each owner's items
        (``StepItems.groups``), from the items' locations: the one record of copies
        (``ItemLocation.copies``). Kept per version of the file like ``header`` (small, while
        the process keeps only a few payloads' ``items``). A payload that is not our DCP metadata (written by
        something else) knows no copies: every item counts in its owner's shard alone, which
        never counts a place too many."""
        def groups() -> dict[int, list[Group]]:
            try:
                return self.items(step).groups()
            except CorruptShardError:
                return {}
        return self._per_version(self._groups, step, groups)

    def items(self, step: int) -> StepItems:
        """Each owner's primary items of the step's save, by copy group (which items a
        partial replica must list to hold a group, and their bytes). Unpickled once per
        payload in this process (``_ParsedPayloads``)."""
        return _parsed.items(self.header(step), lambda: self.read(step))

    def _per_version(self, cache: dict[str, tuple[tuple, T]], step: int, compute: Callable[[], T]) -> T:
        """``compute()`` for the step's metadata file, once per version of it (inode, size,
        mtime); the values of at most ``KEPT_VERSIONS`` files, the oldest dropped first."""
        path = self.paths.metadata(step)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ShardNotFoundError(f"step {step} has no global metadata on this node") from None
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = cache.get(path)
        if cached is not None and cached[0] == version:
            return cached[1]
        value = compute()
        cache.pop(path, None)  # re-inserted: newest last
        cache[path] = (version, value)
        while len(cache) > KEPT_VERSIONS:  # a dict keeps insertion order
            del cache[next(iter(cache))]
        return value


def _decode(step: int, raw: bytes) -> tuple[MetadataHeader, bytes]:
    """Parse and verify a metadata file; a damaged one is a CorruptShardError."""
    try:
        return decode_metadata(raw)
    except (ValueError, TypeError, KeyError) as e:
        raise CorruptShardError(f"metadata of step {step} is corrupt: {e}") from e
