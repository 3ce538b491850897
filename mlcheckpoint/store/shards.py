"""Shard files: writing one (buffer, items, manifest, commit) and reading a committed one.

Commit protocol for a shard (step S, owner rank r):
  1. bytes go into ``rank-r.data.inflight`` (a recycled buffer when the pool has one);
  2. the manifest with per-item checksums goes to ``rank-r.manifest.tmp``;
  3. rename data.inflight -> data, then manifest.tmp -> manifest. The manifest rename is the
     commit point: listing only ever reports shards whose manifest exists, so whatever a
     crash leaves behind is invisible and gc removes it.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from .._faults import crash_point
from ..errors import CapacityError, CorruptShardError, ShardNotFoundError
from ..integrity import copier, digests
from ..integrity.verify import digest_item, verify_region
from . import buffers
from .buffers import NO_ROOM, MappedFile, MappingCache
from .layout import JobPaths, Kind, classify
from .locks import CommitLock, NodeLock
from .manifest import Manifest, ManifestItem
from .pool import BufferPool, Capacity

if TYPE_CHECKING:
    from typing_extensions import Self

ALIGN = 64


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ShardFiles:
    """The shards of one job on this node: begin, reopen and commit writes; open, map and read
    committed ones; retire them into the pool."""

    def __init__(self, paths: JobPaths, job_id: str, mappings: MappingCache, pool: BufferPool,
                 capacity: Capacity, lock: NodeLock, commits: CommitLock):
        self.paths, self.job_id, self.mappings = paths, job_id, mappings
        self.pool, self.capacity, self.lock, self.commits = pool, capacity, lock, commits

    # ------------------------------------------------------------------ write
    def begin(self, step: int, rank: int, nbytes: int,
              held: list[tuple[int, int]] | None = None) -> ShardWriter:
        """Get a mapped buffer of ``nbytes`` for (step, rank), recycled when possible; with
        ``held`` (a partial replica's item ranges), a fresh sparse file in which only those
        ranges take memory.

        Raises CapacityError before writing anything if tmpfs or the memory limit has no room.
        """
        inflight = self.paths.inflight(step, rank)
        self.pool.discard(inflight)  # debris of an earlier attempt at the same shard
        try:
            # The ranks of a node share one tmpfs: its space is checked and reserved in one
            # step, so two ranks cannot both pass the check and then both write into it.
            with self.lock.held():
                if held is None:
                    self._claim(step, rank, nbytes, inflight)
                else:
                    self._claim_sparse(step, rank, nbytes, held, inflight)
            buffer = self.mappings.map(inflight, nbytes, holes=held is not None)
        except BaseException as e:  # leave nothing behind, as a refused shard does
            no_room = isinstance(e, OSError) and e.errno in NO_ROOM
            if no_room:  # a buffer whose pages could not be had is no buffer to recycle
                self.pool.unlink(inflight)
            self.pool.discard(inflight)
            self.remove_step_if_empty(step)
            if no_room:
                raise self.capacity.no_room(nbytes, step) from e
            raise
        return ShardWriter(self, step, rank, buffer, inflight)

    def _claim(self, step: int, rank: int, nbytes: int, inflight: str) -> None:
        """Check capacity, then put at ``inflight`` a buffer of ``nbytes`` whose pages are all
        allocated (OSError ENOSPC when they cannot be). Runs under the node's lock."""
        # Capacity first: a refused shard must leave nothing behind, not even its step folder.
        # A buffer page-locked for a device rank's saves is reused for another's shard only
        # when nothing else makes room for it (``BufferPool._ranked``).
        def preflight(candidate: tuple[str, int] | None) -> None:
            self.capacity.preflight(nbytes, reusable=candidate[1] if candidate else 0, rank=rank,
                                    step=step)

        spare_locked = True
        candidate = self.pool.candidate(rank, nbytes, spare_locked)
        try:
            preflight(candidate)
        except CapacityError:
            spare_locked = False
            wider = self.pool.candidate(rank, nbytes, spare_locked)
            if wider == candidate:
                raise
            preflight(wider)
        os.makedirs(self.paths.step_dir(step), mode=0o700, exist_ok=True)
        # An empty shard (a rank with no tensor bytes) has no pages to reuse: the pooled buffers
        # stay for saves that do.
        recycled = self.pool.take(rank, nbytes, inflight, spare_locked) if nbytes else None
        flags = os.O_RDWR if recycled else os.O_RDWR | os.O_CREAT | os.O_EXCL
        fd = os.open(inflight, flags, 0o600)
        try:
            if recycled is None:
                os.ftruncate(fd, nbytes)
            buffers.reserve(fd, nbytes)  # never SIGBUS when the pages are first touched
        finally:
            os.close(fd)

    def _claim_sparse(self, step: int, rank: int, nbytes: int, held: list[tuple[int, int]],
                      inflight: str) -> None:
        """Put at ``inflight`` a file of ``nbytes`` whose pages exist only in the ``held``
        ranges (a partial replica's items; never a pooled buffer, whose pages are all there).
        Runs under the node's lock."""
        self.capacity.preflight(sum(n for _, n in held), reusable=0, rank=rank)
        os.makedirs(self.paths.step_dir(step), mode=0o700, exist_ok=True)
        fd = os.open(inflight, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            for offset, n in held:
                buffers.reserve(fd, n, offset)
        finally:
            os.close(fd)

    def reopen(self, step: int, rank: int, nbytes: int) -> ShardWriter:
        """Continue an uncommitted shard that was staged earlier (possibly by another process)."""
        inflight = self.paths.inflight(step, rank)
        if not os.path.exists(inflight):
            raise ShardNotFoundError(f"no staged buffer for step {step} rank {rank}: {inflight}")
        shard = ShardWriter(self, step, rank, self.mappings.map(inflight, nbytes), inflight)
        shard.cursor = nbytes  # the staged region is taken
        return shard

    def install(self, inflight: str, manifest: Manifest) -> None:
        """Commit the buffer at ``inflight`` under ``manifest`` (the manifest rename commits)."""
        data = self.paths.data(manifest.step, manifest.rank)
        mpath = self.paths.manifest(manifest.step, manifest.rank)
        tmp = self.paths.manifest_tmp(manifest.step, manifest.rank)
        crash_point("before_manifest", manifest.step, manifest.rank)
        # Nothing past the data stays in tmpfs (a stage trimmed to its plan, a recycled buffer
        # with slack): the file holds what replication sends and recovery reads, no more.
        if os.stat(inflight).st_size > manifest.data_bytes:
            self.mappings.unpin_beyond(inflight, manifest.data_bytes)
            os.truncate(inflight, manifest.data_bytes)
        with open(tmp, "wb", opener=private) as f:
            f.write(manifest.to_bytes())
        with self.commits.committing():  # never while a retention pass looks and retires
            # Re-saving a committed step: uncommit the old shard before its data is replaced.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(mpath)
            os.replace(inflight, data)
            crash_point("mid_commit", manifest.step, manifest.rank)
            os.replace(tmp, mpath)  # commit point

    # ------------------------------------------------------------------ read
    def read_manifest(self, step: int, rank: int) -> Manifest:
        path = self.paths.manifest(step, rank)
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

    def open(self, step: int, rank: int, save_id: str | None = None) -> ShardSource:
        """Open a committed shard for reading (not verified: readers check each item).

        With ``save_id``, a shard of another save of this step counts as absent
        (ShardNotFoundError). A damaged shard raises CorruptShardError.
        """
        m = self.read_manifest(step, rank)
        if save_id is not None and m.save_id != save_id:
            raise ShardNotFoundError(f"step {step} rank {rank} here belongs to save {m.save_id!r}, "
                                     f"not {save_id!r}")
        path = self.paths.data(step, rank)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptShardError(f"{path} is missing though its manifest is committed") from None
        st = os.fstat(fd)
        if st.st_size < m.data_bytes:
            os.close(fd)
            raise CorruptShardError(f"{path} is truncated: {st.st_size} of {m.data_bytes} bytes")
        return ShardSource(self.mappings, m, path, fd, st)

    def map(self, step: int, rank: int) -> tuple[Manifest, MappedFile]:
        """Map a committed shard (not verified)."""
        with self.open(step, rank) as source:  # checks the data file is whole
            m = source.manifest
            return m, self.mappings.map(source.path, m.data_bytes, holes=m.partial)

    # ------------------------------------------------------------------ retire
    def retire(self, step: int, rank: int, *, keep_metadata: bool = False) -> None:
        """Uncommit a shard (manifest first) and recycle its buffer. The step's folder goes
        with its last shard, metadata included, unless ``keep_metadata`` (a shard refused as
        damaged while other nodes still hold the step: this node needs the metadata to load
        it from them)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.paths.manifest(step, rank))
        self.pool.recycle(self.paths.data(step, rank), rank)
        self.remove_step_if_empty(step, keep_metadata=keep_metadata)

    def remove_step_if_empty(self, step: int, keep_metadata: bool = False) -> None:
        """Remove a step folder that holds nothing but (unless ``keep_metadata``) metadata."""
        with self.lock.held():
            d = self.paths.step_dir(step)
            try:
                names = os.listdir(d)
            except FileNotFoundError:
                return
            if any(classify(n).kind is not Kind.METADATA for n in names) or (keep_metadata and names):
                return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.paths.metadata(step))
            with contextlib.suppress(OSError):
                os.rmdir(d)


class ShardWriter:
    """An uncommitted shard: a mapped buffer being filled, then committed or aborted."""

    def __init__(self, files: ShardFiles, step: int, rank: int, buffer: MappedFile, path: str):
        self.files, self.step, self.rank = files, step, rank
        self.buffer = buffer
        self.inflight_path = path
        self.items: list[ManifestItem] = []
        self.data_bytes = buffer.size
        self.region = buffer.size  # the mapped part of the data: items past it are appended
        self.cursor = 0  # next free offset for items copied in by write_data
        self._committed = False

    def page_lock(self, device: int | None) -> None:
        """This shard takes copies from device memory (CUDA device ``device``, the rank's):
        page-lock its buffer, and from now on page-lock the buffers prepared for this rank as
        they are made and keep them for its saves (``BufferPool``). Any thread: the
        registration runs under ``device``."""
        self.files.pool.device_ranks[self.rank] = device
        self.buffer.register_for_device_copies(device)

    def trim(self, end: int) -> None:
        """End the data at ``end`` (within the mapping): what lies past it is no part of the
        shard, items still to come are appended after it, and the commit gives its pages
        back. For a stage that holds bytes the save's plan does not take."""
        if not 0 <= end <= self.region or self.data_bytes != self.region:
            raise ValueError(f"cannot trim a shard of {self.data_bytes} bytes to {end}")
        self.data_bytes = self.region = self.cursor = end

    def append_bytes(self, data) -> tuple[int, int]:
        """Append an item (bytes or any contiguous buffer) after the mapped region; returns
        (offset, checksum)."""
        offset = align(self.data_bytes)
        view = memoryview(data).cast("B")
        fd = os.open(self.inflight_path, os.O_WRONLY)
        try:
            buffers.reserve(fd, view.nbytes, offset)  # a full tmpfs refuses before any byte
            done = 0
            while done < view.nbytes:  # one write stops short of 2 GiB
                done += os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            if e.errno in NO_ROOM:
                raise self.files.capacity.no_room(view.nbytes, self.step) from e
            raise
        finally:
            os.close(fd)
        self.data_bytes = offset + view.nbytes
        return offset, digest_item(view)

    def add_item(self, item: ManifestItem) -> None:
        self.items.append(item)

    def commit(self, world_size: int = 1, *, save_id: str = "", run_id: str = "") -> Manifest:
        manifest = Manifest(job_id=self.files.job_id, step=self.step, rank=self.rank,
                            data_bytes=self.data_bytes, items=self.items, world_size=world_size,
                            save_id=save_id, run_id=run_id)
        self.files.install(self.inflight_path, manifest)
        self._committed = True
        return manifest

    def verify(self, manifest: Manifest) -> None:
        """Check the buffer against a manifest made elsewhere (a replica, on arrival)."""
        verify_region(self.buffer.array, manifest.items,
                      f"replica of step {manifest.step} rank {manifest.rank} on arrival")

    def commit_manifest(self, manifest: Manifest) -> None:
        """Commit under a manifest made elsewhere (a replica received from its owner)."""
        if manifest.data_bytes != self.buffer.size or (manifest.step, manifest.rank) != (self.step, self.rank):
            raise ValueError("manifest does not describe this buffer")
        self.files.install(self.inflight_path, manifest)
        self._committed = True

    def reassign(self, rank: int) -> None:
        """Make this uncommitted shard ``rank``'s (same step, same buffer: only its name moves)."""
        inflight = self.files.paths.inflight(self.step, rank)
        self.files.pool.discard(inflight)  # debris of an earlier attempt at that shard
        os.rename(self.inflight_path, inflight)  # same inode: the mapping stays valid
        self.inflight_path, self.rank = inflight, rank

    def abort(self, keep_metadata: bool = False) -> None:
        """Drop the buffer unless committed, and the step's folder if nothing else is left in
        it (its metadata too, unless ``keep_metadata``)."""
        if not self._committed:
            self.files.pool.discard(self.inflight_path)
            self.files.remove_step_if_empty(self.step, keep_metadata)


class ShardSource:
    """A committed shard open for reading, through this process's mapping of it (warm page
    tables in the process that saved it: a plain memcpy).

    A process without one (a resume) maps it unpopulated: the copier's threads fault the pages
    in as they hash and copy them, in parallel, in the same pass. Here that beat ``pread``
    into the targets, which copies page by page in the kernel and leaves the hash a second
    pass over bytes already out of cache (1 GiB on 2 cores: 0.12 s against 0.19 s)."""

    def __init__(self, mappings: MappingCache, manifest: Manifest, path: str, fd: int,
                 st: os.stat_result):
        self.mappings, self.manifest, self.path, self.fd = mappings, manifest, path, fd
        self.mapped = mappings.lookup(st)
        self._earlier: list = []  # arrays of mappings replaced while reading (see mapping())

    def span(self, offset: int, nbytes: int, dst: int | None,
             algorithm: str = digests.DEFAULT) -> copier.Span:
        """The copier span that verifies under ``algorithm`` (and, with ``dst``, copies)
        ``nbytes`` at ``offset``."""
        if not 0 <= offset <= offset + nbytes <= self.manifest.data_bytes:
            raise CorruptShardError(f"item at [{offset}, {offset + nbytes}) lies outside the "
                                    f"{self.manifest.data_bytes} bytes of {self.path}")
        return copier.Span(src=self.mapping(offset + nbytes).base_ptr + offset, nbytes=nbytes,
                           dst=dst, algorithm=algorithm)

    def mapping(self, end: int) -> MappedFile:
        """A mapping of the shard that covers its first ``end`` bytes (kept in the cache: a
        later save that recycles this file finds its page tables built)."""
        if self.mapped is None or self.mapped.size < end:
            if self.mapped is not None:
                # Spans taken from the mapping the cache is about to replace (the writer's,
                # which ends before the items write_data appended) still point into it: held
                # here, it stays mapped until this source is done (see MappedFile.release).
                self._earlier.append(self.mapped.array)
            self.mapped = self.mappings.map(self.path, self.manifest.data_bytes, populate=False,
                                            holes=self.manifest.partial)
        return self.mapped

    def read(self, offset: int, nbytes: int) -> bytes:
        return os.pread(self.fd, nbytes, offset)

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def private(path: str, flags: int) -> int:
    """``open``'s opener for a file of the job directory: this user's alone."""
    return os.open(path, flags, 0o600)
