"""The global DCP metadata of each step: one self-verifying file, renamed into place."""

from __future__ import annotations

import os
import secrets
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

KEPT_ITEMS = 8  # steps whose items ``MetadataFiles.items`` keeps unpickled (keep is a few)


class MetadataFiles:
    """Write, install (from a peer) and read the metadata of this job's steps on this node."""

    def __init__(self, paths: JobPaths, job_id: str, commits: CommitLock):
        self.paths, self.job_id, self.commits = paths, job_id, commits
        self._verified_headers: dict[str, tuple[tuple, MetadataHeader]] = {}
        self._items: dict[str, tuple[tuple, StepItems]] = {}
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
        ``items`` keeps only a few steps'). A payload that is not our DCP metadata (written by
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
        version of the file, as ``header`` checks it once."""
        return self._per_version(self._items, step,
                                 lambda: StepItems(item_locations(self.read(step)[1])), keep=KEPT_ITEMS)

    def _per_version(self, cache: dict[str, tuple[tuple, T]], step: int, compute: Callable[[], T],
                     keep: int | None = None) -> T:
        """``compute()`` for the step's metadata file, once per version of it (inode, size,
        mtime); ``keep``: at most that many files' values, the oldest dropped first."""
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
        cache[path] = (version, value)
        while keep is not None and len(cache) > keep:  # a dict keeps insertion order
            del cache[next(iter(cache))]
        return value


def _decode(step: int, raw: bytes) -> tuple[MetadataHeader, bytes]:
    """Parse and verify a metadata file; a damaged one is a CorruptShardError."""
    try:
        return decode_metadata(raw)
    except (ValueError, TypeError, KeyError) as e:
        raise CorruptShardError(f"metadata of step {step} is corrupt: {e}") from e
