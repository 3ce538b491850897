"""The node-local tmpfs store of one job: write, commit, list, read, verify, retire.

Commit protocol for a shard (step S, owner rank r):
  1. bytes go into ``rank-r.data.partial`` (a recycled buffer when the pool has one);
  2. the manifest with per-item checksums goes to ``rank-r.manifest.tmp``;
  3. rename data.partial -> data, then manifest.tmp -> manifest. The manifest rename is the
     commit point: listing only ever reports shards whose manifest exists, so whatever a
     crash leaves behind is invisible and gc removes it.
The global metadata of a step is one self-verifying file renamed into place the same way.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator


from .._faults import crash_point
from .._ratelimit import RateLimitedLog
from ..config import (local_dir_errors, resolve_job_id, resolve_local_dir, resolve_memory_limit,
                      warn_if_not_memory)
from ..errors import CapacityError, CorruptShardError, ShardNotFoundError
from . import buffers, copier, layout
from .buffers import NO_ROOM, MappedFile, MappingCache
from .checksum import checksum
from .identity import Lineage
from .layout import ItemLocation
from .manifest import Manifest, ManifestItem, MetadataHeader, decode_metadata, encode_metadata

log = logging.getLogger(__name__)
# Listings run every few hundred ms (the replicator polls): say so about a damaged copy now and
# then, not each time.
_damage_log = RateLimitedLog(log, interval=300.0)

ALIGN = 64
# Retired buffers kept per owner rank; one is enough for steady state, two absorb a save that
# overlaps a retirement.
POOL_PER_RANK = 2
# Buffers prepared in the background reserve their pages in pieces of this size.
_PREPARE_PIECE = 64 << 20
# A recycled buffer is shrunk when it is this much larger than needed.
_SHRINK_SLACK = 64 << 20


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class StepState:
    """What this node holds of one step."""

    step: int
    has_metadata: bool = False
    committed_ranks: set[int] = field(default_factory=set)
    required_ranks: list[int] | None = None  # from the metadata header, when present
    world_size: int | None = None
    total_bytes: int | None = None
    header: MetadataHeader | None = None  # the metadata's verified header, when present
    shard_saves: dict[int, str] = field(default_factory=dict)  # owner -> save id of its shard
    damaged: dict[int, str] = field(default_factory=dict)  # owner -> why its copy is unusable

    @property
    def save_id(self) -> str | None:
        """The save the metadata here describes (None without metadata)."""
        return self.header.save_id if self.header is not None else None

    def ranks_of(self, save_id: str | None) -> set[int]:
        """Owners whose committed shard here belongs to the save ``save_id``."""
        return {r for r in self.committed_ranks if self.shard_saves.get(r) == save_id}

    @property
    def complete(self) -> bool:
        """Metadata and every needed rank's shard of that same save are committed here."""
        return (self.has_metadata and self.required_ranks is not None
                and set(self.required_ranks) <= self.ranks_of(self.save_id))


class ShardWriter:
    """An uncommitted shard: a mapped buffer being filled, then committed or aborted."""

    def __init__(self, store: "LocalStore", step: int, rank: int, buffer: MappedFile, path: str):
        self.store, self.step, self.rank = store, step, rank
        self.buffer = buffer
        self.partial_path = path
        self.items: list[ManifestItem] = []
        self.data_bytes = buffer.size
        self.cursor = 0  # next free offset for items copied in by write_data
        self._committed = False

    def append_bytes(self, data) -> tuple[int, int]:
        """Append an item (bytes or any contiguous buffer) after the mapped region; returns
        (offset, checksum)."""
        offset = align(self.data_bytes)
        view = memoryview(data).cast("B")
        fd = os.open(self.partial_path, os.O_WRONLY)
        try:
            buffers.reserve(fd, view.nbytes, offset)  # a full tmpfs refuses before any byte
            done = 0
            while done < view.nbytes:  # one write stops short of 2 GiB
                done += os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            if e.errno in NO_ROOM:
                raise self.store._no_room(view.nbytes) from e
            raise
        finally:
            os.close(fd)
        self.data_bytes = offset + view.nbytes
        return offset, checksum(view)

    def add_item(self, item: ManifestItem) -> None:
        self.items.append(item)

    def commit(self, world_size: int = 1, *, save_id: str = "", run_id: str = "") -> Manifest:
        manifest = Manifest(job_id=self.store.job_id, step=self.step, rank=self.rank,
                            data_bytes=self.data_bytes, items=self.items, world_size=world_size,
                            save_id=save_id, run_id=run_id)
        self.store._commit_shard(self.partial_path, manifest)
        self._committed = True
        return manifest

    def verify(self, manifest: Manifest) -> None:
        """Check the buffer against a manifest made elsewhere (a replica, on arrival)."""
        for it in manifest.items:
            if checksum(self.buffer.array[it.offset:it.offset + it.nbytes]) != it.checksum:
                raise CorruptShardError(f"replica of step {manifest.step} rank {manifest.rank}: "
                                        f"checksum mismatch in {it.key!r} on arrival")

    def commit_manifest(self, manifest: Manifest) -> None:
        """Commit under a manifest made elsewhere (a replica received from its owner)."""
        if manifest.data_bytes != self.buffer.size or (manifest.step, manifest.rank) != (self.step, self.rank):
            raise ValueError("manifest does not describe this buffer")
        self.store._commit_shard(self.partial_path, manifest)
        self._committed = True

    def reassign(self, rank: int) -> None:
        """Make this uncommitted shard ``rank``'s (same step, same buffer: only its name moves)."""
        partial = self.store.data_path(self.step, rank) + layout.PARTIAL
        self.store._discard(partial)  # debris of an earlier attempt at that shard
        os.rename(self.partial_path, partial)  # same inode: the mapping stays valid
        self.partial_path, self.rank = partial, rank

    def abort(self) -> None:
        if not self._committed:
            self.store._discard(self.partial_path)
            self.store._remove_step_if_empty(self.step)


class ShardSource:
    """A committed shard open for reading, through this process's mapping of it when it has
    one (warm page tables: a plain memcpy) or else through the file (``pread``: a process
    that reads a shard once, like a resume, skips building page tables for it)."""

    def __init__(self, store: "LocalStore", manifest: Manifest, path: str, fd: int,
                 st: os.stat_result):
        self.store, self.manifest, self.path, self.fd = store, manifest, path, fd
        self.mapped = store.mappings.lookup(st)

    def span(self, offset: int, nbytes: int, dst: int | None):
        """The copier span that verifies (and, with ``dst``, copies) ``nbytes`` at ``offset``."""
        if dst is not None and (self.mapped is None or offset + nbytes > self.mapped.size):
            return copier.Span(src=offset, nbytes=nbytes, dst=dst, fd=self.fd)
        return copier.Span(src=self.mapping(offset + nbytes).base_ptr + offset, nbytes=nbytes, dst=dst)

    def mapping(self, end: int) -> MappedFile:
        """A mapping of the shard that covers its first ``end`` bytes."""
        if self.mapped is None or self.mapped.size < end:
            self.mapped = self.store.mappings.map(self.path, self.manifest.data_bytes)
        return self.mapped

    def read(self, offset: int, nbytes: int) -> bytes:
        return os.pread(self.fd, nbytes, offset)

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> "ShardSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalStore:
    """All checkpoint files of one job on this node, under ``<local_dir>/<job_id>``.

    Safe to use from several processes of the same node at once (each rank writes its own
    shards; step-level bookkeeping takes a file lock). Never touches another job's directory.
    """

    def __init__(self, local_dir: str | os.PathLike | None = None, job_id: str | None = None, *,
                 memory_limit_bytes: int | None = None, create: bool = True):
        self.local_dir = resolve_local_dir(local_dir)
        self.job_id = resolve_job_id(job_id)
        self.job_dir = os.path.join(self.local_dir, self.job_id)
        self.steps_dir = os.path.join(self.job_dir, layout.STEPS)
        self.pool_dir = os.path.join(self.job_dir, layout.POOL)
        self.memory_limit_bytes = resolve_memory_limit(memory_limit_bytes)
        self.mappings = MappingCache()
        self._verified_headers: dict[str, tuple[tuple, MetadataHeader]] = {}
        self._manifest_ids: dict[str, tuple[tuple, str, int]] = {}
        if create:
            with local_dir_errors(self.local_dir):
                os.makedirs(self.local_dir, mode=0o700, exist_ok=True)
                for d in (self.job_dir, self.steps_dir, self.pool_dir):
                    os.makedirs(d, mode=0o700, exist_ok=True)
                os.chmod(self.job_dir, 0o700)
            warn_if_not_memory(self.local_dir)

    # The mapping cache is per process; a pickled store (DCP's PROCESS mode) starts empty.
    def __getstate__(self):
        state = self.__dict__.copy()
        state["mappings"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.mappings = MappingCache()

    def close(self) -> None:
        self.mappings.clear()

    # ------------------------------------------------------------------ paths
    def step_dir(self, step: int) -> str:
        return os.path.join(self.steps_dir, layout.step_dirname(step))

    def data_path(self, step: int, rank: int) -> str:
        return os.path.join(self.step_dir(step), layout.data_name(rank))

    def manifest_path(self, step: int, rank: int) -> str:
        return os.path.join(self.step_dir(step), layout.manifest_name(rank))

    def metadata_path(self, step: int) -> str:
        return os.path.join(self.step_dir(step), layout.METADATA)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Job-wide lock for step-level bookkeeping shared by the ranks of a node."""
        fd = os.open(os.path.join(self.job_dir, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ write path
    def begin_shard(self, step: int, rank: int, nbytes: int) -> ShardWriter:
        """Get a mapped buffer of ``nbytes`` for (step, rank), recycled when possible.

        Raises CapacityError before writing anything if tmpfs or the memory limit has no room.
        """
        partial = self.data_path(step, rank) + layout.PARTIAL
        self._discard(partial)  # debris of an earlier attempt at the same shard
        try:
            # The ranks of a node share one tmpfs: its space is checked and reserved in one
            # step, so two ranks cannot both pass the check and then both write into it.
            with self.locked():
                self._claim(step, rank, nbytes, partial)
            buffer = self.mappings.map(partial, nbytes)
        except BaseException as e:  # leave nothing behind, as a refused shard does
            no_room = isinstance(e, OSError) and e.errno in NO_ROOM
            if no_room:  # a buffer whose pages could not be had is no buffer to recycle
                self._unlink(partial)
            self._discard(partial)
            self._remove_step_if_empty(step)
            if no_room:
                raise self._no_room(nbytes) from e
            raise
        return ShardWriter(self, step, rank, buffer, partial)

    def _claim(self, step: int, rank: int, nbytes: int, partial: str) -> None:
        """Check capacity, then put at ``partial`` a buffer of ``nbytes`` whose pages are all
        allocated (OSError ENOSPC when they cannot be). Runs under the node's lock."""
        candidate = self._pool_candidate(rank, nbytes)
        # Capacity first: a refused shard must leave nothing behind, not even its step folder.
        self._preflight(nbytes, reusable=candidate[1] if candidate else 0)
        os.makedirs(self.step_dir(step), mode=0o700, exist_ok=True)
        # An empty shard (a rank with no tensor bytes) has no pages to reuse: the pooled buffers
        # stay for saves that do.
        recycled = self._take_from_pool(rank, nbytes, partial) if nbytes else None
        flags = os.O_RDWR if recycled else os.O_RDWR | os.O_CREAT | os.O_EXCL
        fd = os.open(partial, flags, 0o600)
        try:
            if recycled is None:
                os.ftruncate(fd, nbytes)
            buffers.reserve(fd, nbytes)  # never SIGBUS when the pages are first touched
        finally:
            os.close(fd)

    def reopen_shard(self, step: int, rank: int, nbytes: int) -> ShardWriter:
        """Continue an uncommitted shard that was staged earlier (possibly by another process)."""
        partial = self.data_path(step, rank) + layout.PARTIAL
        if not os.path.exists(partial):
            raise ShardNotFoundError(f"no staged buffer for step {step} rank {rank}: {partial}")
        shard = ShardWriter(self, step, rank, self.mappings.map(partial, nbytes), partial)
        shard.cursor = nbytes  # the staged region is taken
        return shard

    def _commit_shard(self, partial: str, manifest: Manifest) -> None:
        data = self.data_path(manifest.step, manifest.rank)
        mpath = self.manifest_path(manifest.step, manifest.rank)
        tmp = mpath + layout.TMP
        crash_point("before_manifest", manifest.step, manifest.rank)
        with open(tmp, "wb", opener=_private) as f:
            f.write(manifest.to_bytes())
        # Re-saving a committed step: uncommit the old shard before its data is replaced.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mpath)
        os.replace(partial, data)
        crash_point("mid_commit", manifest.step, manifest.rank)
        os.replace(tmp, mpath)  # commit point

    def write_metadata(self, step: int, payload: bytes, *, world_size: int, ranks: Iterable[int],
                       total_bytes: int, save_id: str = "", lineage: Lineage | None = None) -> None:
        """Commit the global DCP metadata of a step (atomic; replaces an older save's)."""
        header = MetadataHeader(job_id=self.job_id, step=step, world_size=world_size,
                                ranks=sorted(set(ranks)), total_bytes=total_bytes,
                                payload_bytes=len(payload), checksum=checksum(payload),
                                save_id=save_id, **(lineage or Lineage()).header_fields())
        self._install_metadata(step, encode_metadata(header, payload))

    def write_metadata_file(self, step: int, raw: bytes) -> None:
        """Install an encoded metadata file (e.g. received from a peer) after verifying it."""
        header, _ = decode_metadata(raw)
        if header.step != step or header.job_id != self.job_id:
            raise ValueError(f"metadata is for {header.job_id}/{header.step}, not {self.job_id}/{step}")
        self._install_metadata(step, raw)

    def _install_metadata(self, step: int, raw: bytes) -> None:
        os.makedirs(self.step_dir(step), mode=0o700, exist_ok=True)
        path = self.metadata_path(step)
        tmp = f"{path}.{secrets.token_hex(4)}{layout.TMP}"
        with open(tmp, "wb", opener=_private) as f:
            f.write(raw)
        os.replace(tmp, path)

    # ------------------------------------------------------------------ read path
    def read_manifest(self, step: int, rank: int) -> Manifest:
        path = self.manifest_path(step, rank)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise ShardNotFoundError(f"step {step} rank {rank} is not committed on this node") from None
        try:
            m = Manifest.from_bytes(raw)
        except (ValueError, TypeError, KeyError) as e:
            raise CorruptShardError(f"unreadable manifest {path}: {e}") from e
        if (m.job_id, m.step, m.rank) != (self.job_id, step, rank):
            raise CorruptShardError(f"manifest {path} names {m.job_id}/{m.step}/{m.rank}")
        return m

    def map_shard(self, step: int, rank: int) -> tuple[Manifest, MappedFile]:
        """Map a committed shard (not verified; see ``verify_shard``)."""
        with self.open_shard(step, rank) as source:  # checks the data file is whole
            return source.manifest, self.mappings.map(source.path, source.manifest.data_bytes)

    def open_shard(self, step: int, rank: int, save_id: str | None = None) -> "ShardSource":
        """Open a committed shard for reading (not verified: readers check each item).

        With ``save_id``, a shard of another save of this step counts as absent
        (ShardNotFoundError). A damaged shard raises CorruptShardError.
        """
        m = self.read_manifest(step, rank)
        if save_id is not None and m.save_id != save_id:
            raise ShardNotFoundError(f"step {step} rank {rank} here belongs to save {m.save_id!r}, "
                                     f"not {save_id!r}")
        path = self.data_path(step, rank)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptShardError(f"{path} is missing though its manifest is committed") from None
        st = os.fstat(fd)
        if st.st_size < m.data_bytes:
            os.close(fd)
            raise CorruptShardError(f"{path} is truncated: {st.st_size} of {m.data_bytes} bytes")
        return ShardSource(self, m, path, fd, st)

    def verify_shard(self, step: int, rank: int, recorded: Iterable[ItemLocation] = ()) -> Manifest:
        """Check every item's checksum; raises CorruptShardError naming the first bad item.

        Checked against the manifest and against ``recorded``: the item locations the step's
        metadata holds for this rank (what a resume checks, so a manifest rewritten to match
        damaged bytes does not pass). A shard of another save than the metadata here fails.
        """
        m, buf = self.map_shard(step, rank)
        expected = [(it.offset, it.nbytes, it.checksum, f"item {it.key!r}") for it in m.items]
        expected += [(loc.offset, loc.nbytes, loc.checksum, f"metadata item at offset {loc.offset}")
                     for loc in recorded]
        with contextlib.suppress(ShardNotFoundError):
            header, _ = self.read_metadata(step)
            if header.save_id != m.save_id:
                raise CorruptShardError(f"step {step} rank {rank}: the shard belongs to save "
                                        f"{m.save_id!r}, the metadata to {header.save_id!r}")
        for offset, nbytes, digest, what in expected:
            if offset + nbytes > buf.size:
                raise CorruptShardError(f"step {step} rank {rank}: {what} lies past the shard's "
                                        f"{buf.size} bytes")
            if checksum(buf.array[offset:offset + nbytes]) != digest:
                raise CorruptShardError(
                    f"checksum mismatch in step {step} rank {rank} {what} "
                    f"({self.data_path(step, rank)})")
        return m

    def read_metadata(self, step: int, save_id: str | None = None) -> tuple[MetadataHeader, bytes]:
        """The verified metadata of a step; with ``save_id``, another save's counts as absent."""
        raw = self.read_metadata_file(step)
        try:
            header, payload = decode_metadata(raw)
        except (ValueError, TypeError, KeyError) as e:
            raise CorruptShardError(f"metadata of step {step} is corrupt: {e}") from e
        if save_id is not None and header.save_id != save_id:
            raise ShardNotFoundError(f"metadata of step {step} here belongs to save "
                                     f"{header.save_id!r}, not {save_id!r}")
        return header, payload

    def read_metadata_file(self, step: int) -> bytes:
        try:
            with open(self.metadata_path(step), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise ShardNotFoundError(f"step {step} has no global metadata on this node") from None

    # ------------------------------------------------------------------ inventory
    def steps(self) -> list[int]:
        try:
            names = os.listdir(self.steps_dir)
        except FileNotFoundError:
            return []
        return sorted(s for s in map(layout.parse_step_dirname, names) if s is not None)

    def step_state(self, step: int) -> StepState:
        st = StepState(step)
        try:
            names = os.listdir(self.step_dir(step))
        except FileNotFoundError:
            return st
        for name in names:
            r = layout.parse_manifest_name(name)
            if r is not None:
                try:
                    st.shard_saves[r] = self._manifest_identity(step, r)
                except ShardNotFoundError:
                    continue  # retired between the listing and the read
                except CorruptShardError as e:
                    st.damaged[r] = str(e)
                    _damage_log.warning(self.manifest_path(step, r), "ignoring step %d rank %d "
                                        "here: %s", step, r, e)
                    continue
                st.committed_ranks.add(r)
        if layout.METADATA in names:
            try:
                header = self._metadata_header(step)
            except ShardNotFoundError:
                pass  # retired between the listing and the read
            except CorruptShardError as e:
                log.warning("ignoring metadata of step %d: %s", step, e)
            else:
                st.has_metadata = True
                st.header = header
                st.required_ranks = header.ranks
                st.world_size = header.world_size
                st.total_bytes = header.total_bytes
        return st

    def _metadata_header(self, step: int) -> MetadataHeader:
        """The verified header of a step's metadata. The whole file is checksummed once per
        version (inode, size, mtime): listings run often (the replicator polls) and metadata of
        a large model is megabytes."""
        path = self.metadata_path(step)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ShardNotFoundError(f"step {step} has no global metadata on this node") from None
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._verified_headers.get(path)
        if cached is not None and cached[0] == version:
            return cached[1]
        header, _ = self.read_metadata(step)
        self._verified_headers[path] = (version, header)
        return header

    def _manifest_identity(self, step: int, rank: int) -> str:
        """The save id a committed shard's manifest names, once its data file is checked whole.

        Cached per manifest version like metadata headers: the replicator lists often. A
        shard whose manifest is unreadable or whose data file is missing or short raises
        CorruptShardError, so it is never counted as held.
        """
        path = self.manifest_path(step, rank)
        try:
            st = os.stat(path)
            data_size = os.stat(self.data_path(step, rank)).st_size
        except FileNotFoundError:
            if os.path.exists(path):
                raise CorruptShardError(f"{self.data_path(step, rank)} is missing though its "
                                        f"manifest is committed") from None
            raise ShardNotFoundError(f"step {step} rank {rank} is not committed here") from None
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._manifest_ids.get(path)
        if cached is None or cached[0] != version:
            m = self.read_manifest(step, rank)
            cached = self._manifest_ids[path] = (version, m.save_id, m.data_bytes)
        if data_size < cached[2]:
            raise CorruptShardError(f"{self.data_path(step, rank)} is truncated: {data_size} of "
                                    f"{cached[2]} bytes")
        return cached[1]

    def inventory(self) -> dict[int, StepState]:
        return {s: self.step_state(s) for s in self.steps()}

    def complete_steps(self) -> list[int]:
        """Steps whose metadata and every needed shard are committed here, oldest first."""
        return [s for s, st in self.inventory().items() if st.complete]

    def usage_bytes(self) -> int:
        """Bytes held by this job's files on this node (committed, in flight and pooled)."""
        total = 0
        for root, _dirs, files in os.walk(self.job_dir):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(root, name)).st_blocks * 512
        return total

    # ------------------------------------------------------------------ capacity
    def _preflight(self, nbytes: int, reusable: int) -> None:
        needed = nbytes - reusable
        if needed <= 0:
            return
        free = self._free_bytes()
        if needed > free:
            raise CapacityError(
                f"checkpoint shard needs {needed / 2**20:.1f} MiB more but {self.local_dir} has "
                f"only {free / 2**20:.1f} MiB free; enlarge the tmpfs, lower keep=, or set "
                f"MLCHECKPOINT_LOCAL_DIR to a larger one", needed=needed, available=free)
        if self.memory_limit_bytes is not None:
            used = self.usage_bytes()
            room = self.memory_limit_bytes - used
            if needed > room:
                raise CapacityError(
                    f"checkpoint shard needs {needed / 2**20:.1f} MiB more but job {self.job_id} "
                    f"already uses {used / 2**20:.1f} MiB of its {self.memory_limit_bytes / 2**20:.1f}"
                    f" MiB memory limit", needed=needed, available=max(room, 0))

    def _free_bytes(self) -> int:
        vfs = os.statvfs(self.job_dir)
        return vfs.f_bavail * vfs.f_frsize

    def _no_room(self, needed: int) -> CapacityError:
        """The error for space that ran out after the check passed: another rank of this node
        or another program took it meanwhile."""
        free = self._free_bytes()
        return CapacityError(
            f"checkpoint data needs {needed / 2**20:.1f} MiB but {self.local_dir} ran out of "
            f"space while reserving it ({free / 2**20:.1f} MiB free now; other ranks of this node "
            f"or other programs use the rest); enlarge the tmpfs, lower keep=, or set "
            f"MLCHECKPOINT_LOCAL_DIR to a larger one", needed=needed, available=free)

    # ------------------------------------------------------------------ recycling
    def _pool_candidate(self, rank: int, nbytes: int) -> tuple[str, int] | None:
        ranked = self._pool_ranked(rank, nbytes)
        return (ranked[0][-2], ranked[0][-1]) if ranked else None

    def _pool_ranked(self, rank: int, nbytes: int) -> list[tuple]:
        candidates = []
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.pool_dir):
                owner = layout.parse_pool_name(e.name)
                if owner is None:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    size = e.stat().st_size
                    fits = size >= nbytes
                    # prefer: own rank, fits, least slack / largest shortfall filled
                    candidates.append(((owner != rank), (not fits), abs(size - nbytes), e.path, size))
        return sorted(candidates)

    def _take_from_pool(self, rank: int, nbytes: int, dest: str) -> str | None:
        """Move the best pooled buffer to ``dest``: own rank first, then any, fitting first."""
        for *_, path, size in self._pool_ranked(rank, nbytes):
            try:
                os.rename(path, dest)  # atomic: a rank racing for the same file gets ENOENT
            except FileNotFoundError:
                continue
            if size < nbytes or size - nbytes > max(_SHRINK_SLACK, nbytes // 4):
                self.mappings.forget(dest)
                os.truncate(dest, nbytes)
            return dest
        return None

    def prewarm(self, rank: int, nbytes: int, keep: int) -> int:
        """Get ready, in advance, the buffers ``rank``'s next saves will need.

        A steady state holds ``keep`` committed shards plus one being written; until retention
        starts recycling, each new save would touch fresh tmpfs pages (0.35-0.8 GB/s here,
        against 15 GB/s into a warm buffer). This makes the missing ones now (pooled files
        whose pages are allocated and mapped in this process), off the save path. It never
        goes past the capacity checks a save would make, and stops quietly at the first that
        fails. Returns how many buffers it made.
        """
        made = 0
        for _ in range(keep + 1):
            # Re-counted before each buffer: a save running meanwhile takes one of its own.
            in_use = sum(1 for step in self.steps()
                         if os.path.exists(self.data_path(step, rank))
                         or os.path.exists(self.data_path(step, rank) + layout.PARTIAL))
            own = [c for c in self._pool_ranked(rank, nbytes) if not c[0]]
            ready = sum(1 for c in own if not c[1])
            if in_use + ready >= keep + 1 or len(own) >= POOL_PER_RANK:
                break
            name = layout.pool_name(rank, secrets.token_hex(8))
            tmp = os.path.join(self.pool_dir, name + layout.PARTIAL)  # gc's if we die here
            try:
                with self.locked():
                    self._preflight(2 * nbytes, reusable=0)  # a save's worth must stay free
                    fd = _private(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
                try:
                    os.ftruncate(fd, nbytes)
                    # Reserved a piece at a time, each under the node's lock like a save's whole
                    # buffer: a save that comes meanwhile waits for one piece, not for the
                    # buffer, and if it takes the room, this preparation stops (ENOSPC) instead.
                    for start in range(0, nbytes, _PREPARE_PIECE):
                        with self.locked():
                            buffers.reserve(fd, min(_PREPARE_PIECE, nbytes - start), start)
                finally:
                    os.close(fd)
                self.mappings.map(tmp, nbytes)  # populated: the pages exist from now on
            except (CapacityError, OSError) as e:
                self._unlink(tmp)
                if isinstance(e, OSError) and e.errno not in NO_ROOM:
                    raise
                log.debug("not preparing more buffers for rank %d: %s", rank, e)
                break
            os.rename(tmp, os.path.join(self.pool_dir, name))  # same inode: the mapping stays
            made += 1
        if made:
            log.debug("prepared %d buffer(s) of %d bytes for rank %d", made, nbytes, rank)
        return made

    def _to_pool(self, path: str, rank: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_size == 0:  # an empty shard's file: nothing to recycle, and
                self._unlink(path)          # pooling it would evict a warm buffer of this rank
                return
        dest = os.path.join(self.pool_dir, layout.pool_name(rank, secrets.token_hex(8)))
        try:
            os.rename(path, dest)
        except FileNotFoundError:
            return
        mine = []
        for e in os.scandir(self.pool_dir):
            if layout.parse_pool_name(e.name) == rank:
                # Another rank of this node may take (rename) a pooled file at any moment.
                with contextlib.suppress(FileNotFoundError):
                    mine.append((e.stat().st_mtime, e.path))
        for _, extra in sorted(mine, reverse=True)[POOL_PER_RANK:]:
            self._unlink(extra)

    def _unlink(self, path: str) -> None:
        self.mappings.forget(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def _discard(self, partial: str) -> None:
        """Drop an uncommitted buffer: into the pool if it is a data buffer, else delete."""
        if not os.path.exists(partial):
            return
        name = os.path.basename(partial)
        if name.endswith(".data" + layout.PARTIAL):
            rank = int(name[len("rank-"):len("rank-") + 5])
            self._to_pool(partial, rank)
        else:
            self._unlink(partial)

    # ------------------------------------------------------------------ retention and gc
    def retire_shard(self, step: int, rank: int) -> None:
        """Uncommit a shard (manifest first) and recycle its buffer."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.manifest_path(step, rank))
        self._to_pool(self.data_path(step, rank), rank)
        self._remove_step_if_empty(step)

    def _remove_step_if_empty(self, step: int, keep_metadata: bool = False) -> None:
        with self.locked():
            d = self.step_dir(step)
            try:
                names = os.listdir(d)
            except FileNotFoundError:
                return
            if any(n != layout.METADATA for n in names) or (keep_metadata and names):
                return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, layout.METADATA))
            with contextlib.suppress(OSError):
                os.rmdir(d)

    def apply_retention(self, ranks: Iterable[int], keep: int, protected: Iterable[int] = ()) -> list[int]:
        """Keep the newest ``keep`` complete steps of each owner rank in ``ranks``.

        A step counts as complete for rank r when the step's metadata and r's shard of the
        same save are both committed here. Steps newer than the oldest kept one (e.g. a save in
        flight) and ``protected`` steps are never touched. Steps a resume set aside go once a
        newer step is complete here. Returns the steps retired.
        """
        if keep < 1:
            raise ValueError("keep must be >= 1")
        protected = set(protected)
        inv = self.inventory()
        retired: set[int] = set()
        for rank in ranks:
            complete = [s for s, st in inv.items() if rank in st.ranks_of(st.save_id)]
            if len(complete) <= keep:
                continue
            oldest_kept = sorted(complete)[-keep]
            for s, st in inv.items():
                if s < oldest_kept and s not in protected and rank in st.committed_ranks:
                    self.retire_shard(s, rank)
                    retired.add(s)
                    log.debug("retired step %d rank %d", s, rank)
            # Metadata that outlived every shard of its step (e.g. pushed by the coordinator).
            for s, st in inv.items():
                if s < oldest_kept and s not in protected and not st.committed_ranks:
                    self._remove_step_if_empty(s)
        newest_complete = max((s for s, st in inv.items() if st.complete), default=None)
        for step, path in self.orphans():
            if newest_complete is not None and step < newest_complete:
                log.info("removing step %d set aside at an earlier resume: step %d is complete",
                         step, newest_complete)
                shutil.rmtree(path, ignore_errors=True)
        return sorted(retired)

    def gc(self, ranks: Iterable[int] | None = None, min_age_s: float = 0.0) -> list[str]:
        """Remove what crashes left behind: uncommitted buffers, temp files, orphan metadata.

        ``ranks`` limits the sweep of in-flight files to those owners (a rank cleaning up after
        itself while other ranks of the node may be saving); ``min_age_s`` spares files younger
        than that. Returns the removed paths.
        """
        owners = None if ranks is None else set(ranks)
        now = time.time()
        removed = []
        complete = set(self.complete_steps())
        newest_complete = max(complete, default=-1)
        for step in self.steps():
            d = self.step_dir(step)
            with contextlib.suppress(FileNotFoundError):
                names = set(os.listdir(d))
                committed = {layout.parse_manifest_name(n) for n in names} - {None}
                for name in names:
                    path = os.path.join(d, name)
                    owner = _owner_of(name)
                    if owners is not None and owner is not None and owner not in owners:
                        continue
                    debris = (name.endswith(layout.PARTIAL) or name.endswith(layout.TMP)
                              or (name.endswith(".data") and owner not in committed))
                    if not debris:
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        if now - os.stat(path).st_mtime < min_age_s:
                            continue
                    if name.endswith(".data" + layout.PARTIAL) or name.endswith(".data"):
                        self._to_pool(path, owner)
                    else:
                        self._unlink(path)
                    removed.append(path)
                if owners is None and step < newest_complete and step not in complete and not committed:
                    self._remove_step_if_empty(step)
                elif not committed:
                    self._remove_step_if_empty(step, keep_metadata=True)  # nothing left in it
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.pool_dir):  # buffers whose preparation was cut short
                owner = layout.parse_pool_name(e.name.removesuffix(layout.PARTIAL))
                if not e.name.endswith(layout.PARTIAL) or owner is None:
                    continue
                if owners is not None and owner not in owners:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if now - e.stat().st_mtime < min_age_s:
                        continue
                self._unlink(e.path)
                removed.append(e.path)
        if removed:
            log.info("gc removed %d uncommitted file(s) of job %s", len(removed), self.job_id)
        return removed

    def settle(self, lineage: Lineage, loaded: int | None, set_aside: Iterable[int] = ()) -> list[int]:
        """After a resume: keep only what belongs to the job's history up to the loaded step.

        - Steps newer than ``loaded`` (all steps if None) are orphans of the failed run: the
          job continues from ``loaded`` and saves new checkpoints under the same numbers.
          They are dropped, except those in ``set_aside`` (complete steps that recovery did
          not load, e.g. because loading them failed): those move out of sight into
          ``orphans/`` (an operator may still want them; gc removes them once the job has a
          complete step past them), never deleted.
        - In older steps, every file of a save outside ``lineage`` (another run of this job)
          and every unreadable shard is removed.
        Returns the steps dropped or set aside.
        """
        aside = set(set_aside)
        gone = []
        for step in self.steps():
            if loaded is not None and step <= loaded:
                self._drop_foreign(step, lineage)
                continue
            gone.append(step)
            if step in aside:
                self._set_aside(step)
            else:
                self._drop_step(step)
        return gone

    def _drop_foreign(self, step: int, lineage: Lineage) -> None:
        st = self.step_state(step)
        for rank in sorted(st.committed_ranks | st.damaged.keys()):
            try:
                keep = (rank not in st.damaged
                        and lineage.admits(self.read_manifest(step, rank).run_id, step))
            except ShardNotFoundError:
                continue
            except CorruptShardError:
                keep = False
            if not keep:
                log.info("dropping step %d rank %d here: not part of this job's history or damaged",
                         step, rank)
                self.retire_shard(step, rank)
        if st.header is not None and not lineage.admits(st.header.run_id, step):
            self._unlink(self.metadata_path(step))
        self._remove_step_if_empty(step, keep_metadata=True)  # a replaced node's shards come later

    def _drop_step(self, step: int) -> None:
        d = self.step_dir(step)
        with self.locked(), contextlib.suppress(FileNotFoundError):
            names = os.listdir(d)
            for name in names:  # uncommit everything first
                if layout.parse_manifest_name(name) is not None:
                    self._unlink(os.path.join(d, name))
            for name in os.listdir(d):
                owner = _owner_of(name)
                if owner is not None and name.endswith(".data"):
                    self._to_pool(os.path.join(d, name), owner)
                else:
                    self._unlink(os.path.join(d, name))
            os.rmdir(d)

    def _set_aside(self, step: int) -> None:
        dest = os.path.join(self.job_dir, layout.ORPHANS, layout.orphan_dirname(step, secrets.token_hex(4)))
        os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
        with self.locked(), contextlib.suppress(FileNotFoundError):
            os.rename(self.step_dir(step), dest)
            log.warning("step %d is complete but was not resumed; kept out of the way in %s "
                        "until the job has a newer complete step", step, dest)

    def orphans(self) -> list[tuple[int, str]]:
        """(step, path) of steps set aside by ``settle``."""
        root = os.path.join(self.job_dir, layout.ORPHANS)
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return []
        found = ((layout.parse_orphan_dirname(n), os.path.join(root, n)) for n in names)
        return sorted((step, path) for step, path in found if step is not None)

    @contextlib.contextmanager
    def fetch_lock(self, step: int, owner: int | None) -> Iterator[None]:
        """Serialise fetches of one shard among the processes of this node."""
        os.makedirs(os.path.join(self.job_dir, "locks"), mode=0o700, exist_ok=True)
        stripe = (step * 1009 + (-1 if owner is None else owner)) % 64  # bounded set of files
        fd = os.open(os.path.join(self.job_dir, "locks", f"fetch-{stripe:02d}.lock"),
                     os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def destroy(self) -> None:
        """Delete every file of this job on this node."""
        self.mappings.clear()
        shutil.rmtree(self.job_dir, ignore_errors=True)


def _owner_of(name: str) -> int | None:
    if name.startswith("rank-") and len(name) > 10 and name[5:10].isdigit():
        return int(name[5:10])
    return None


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)
