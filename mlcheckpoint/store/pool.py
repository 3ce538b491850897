"""Room for shards: capacity checks against tmpfs and the memory limit, and the pool of
retired shard buffers that the next saves recycle (see buffers.py for why pages stay touched).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Callable
from typing import NamedTuple

from .._messages import plural
from ..errors import CapacityError
from . import buffers
from .buffers import NO_ROOM, MappingCache
from .layout import JobPaths, Kind, classify
from .locks import NodeLock

log = logging.getLogger(__name__)

# Retired buffers kept per owner rank; one is enough for steady state, two absorb a save that
# overlaps a retirement.
POOL_PER_RANK = 2
# Buffers prepared in the background reserve their pages in pieces of this size.
PREPARE_PIECE = 64 << 20
# A recycled buffer is shrunk when it is this much larger than needed.
SHRINK_SLACK = 64 << 20


class Capacity:
    """What the job may still put in tmpfs: the filesystem's free space and, when set, the
    job's memory limit.

    With replication, a node keeps other nodes' shards beside its own: ``replicas`` partners'
    replicas for each rank in ``replicating`` (``expect_replicas``). A save of such a rank
    that needs new room checks room for what those replicas bring too, as they arrive with
    the step: better a CapacityError at the save than a step that can never be protected.
    What they bring is ``arriving()`` (the replication layer's prediction: with data
    parallelism's copies, only the items that lack places cross, often a few KB), else, when
    it cannot tell yet, ``replicas`` shards of the saving rank's size.
    """

    def __init__(self, local_dir: str, paths: JobPaths, job_id: str, memory_limit_bytes: int | None):
        self.local_dir, self.paths, self.job_id = local_dir, paths, job_id
        self.memory_limit_bytes = memory_limit_bytes
        self.replicas = 0
        self.replicating: frozenset[int] = frozenset()
        self.arriving: Callable[[], int | None] | None = None  # (picklable: PROCESS mode)

    def expect_replicas(self, ranks: list[int], replicas: int,
                        arriving: Callable[[], int | None] | None = None) -> None:
        """Each save of ``ranks`` brings ``replicas`` partners' replicas: ``arriving()``
        bytes of them (None: unknown yet, then as many shards of the save's size)."""
        self.replicating, self.replicas = frozenset(ranks), replicas
        self.arriving = arriving

    def preflight(self, nbytes: int, reusable: int, *, rank: int | None = None,
                  step: int | None = None) -> None:
        """Raise CapacityError unless ``nbytes`` fit (``reusable`` of them already held by a
        buffer that will be recycled), and, for a save of a replicating ``rank`` that needs
        new room, the replicas of that step that will arrive too. The error names only what
        can make room (``step``: the step being saved, which retention would not retire)."""
        needed = nbytes - reusable
        if needed <= 0:
            return
        replicas = self.replicas if rank in self.replicating else 0
        predicted = self.arriving() if replicas and self.arriving is not None else None
        arriving = replicas * nbytes if predicted is None else predicted
        what = (f"checkpoint shard needs {needed / 2**20:.1f} MiB more"
                + (f" and what its step's {plural(replicas, 'replica')} from partner nodes "
                   f"bring {arriving / 2**20:.1f} MiB (replicas={replicas})" if arriving else ""))
        total = needed + arriving
        free = self.free_bytes()
        if total > free:
            size = self.filesystem_bytes()
            raise CapacityError(
                f"{what} but {self.local_dir} has only {free / 2**20:.1f} MiB free; "
                + self._remedies(whole=nbytes + arriving, shard=nbytes, short=total - free,
                                 arriving=arriving, room=size, step=step,
                                 grow="enlarge the tmpfs", elsewhere=True,
                                 also=("set MLCHECKPOINT_LOCAL_DIR to a larger one",),
                                 room_text=f"its {size / 2**20:.1f} MiB filesystem"),
                needed=total, available=free)
        if self.memory_limit_bytes is not None:
            used = self.usage_bytes()
            room = self.memory_limit_bytes - used
            if total > room:
                limit = self.memory_limit_bytes
                raise CapacityError(
                    f"{what} but job {self.job_id} already uses {used / 2**20:.1f} MiB of its "
                    f"{limit / 2**20:.1f} MiB memory limit; "
                    + self._remedies(whole=nbytes + arriving, shard=nbytes, short=total - room,
                                     arriving=arriving, room=limit, step=step,
                                     grow="raise memory_limit_bytes (MLCHECKPOINT_MEMORY_LIMIT)",
                                     room_text="the whole limit"),
                    needed=total, available=max(room, 0))

    def _remedies(self, *, whole: int, shard: int, short: int, arriving: int, room: int,
                  step: int | None, grow: str, room_text: str, also: tuple[str, ...] = (),
                  elsewhere: bool = False) -> str:
        """What can make ``short`` more bytes of room, and only that: ``grow`` (to a size, when
        the save, ``whole`` bytes, is larger than all the ``room`` there is) and ``also``
        always; a lower ``keep=`` only when the steps retention would then retire hold enough;
        a lower ``replicas=`` only when the shard alone would fit; with ``elsewhere`` (others
        share the room), freeing it when nothing of ours would."""
        if whole > room:
            replicas = ["lower replicas="] if arriving and shard <= room else []
            return (f"one save is larger than {room_text}: "
                    + _either([f"{grow} to at least {whole / 2**20:.1f} MiB", *replicas, *also])
                    + ' (more to keep steps: docs/operations.md, "Sizing tmpfs")')
        fixes = [grow]
        older = self.older_steps_bytes(step)
        if short <= older:
            fixes.append(f"lower keep= (this node's older steps hold {older / 2**20:.1f} MiB)")
        if arriving and short <= arriving:
            fixes.append("lower replicas=")
        if elsewhere and short > older:
            fixes.append(f"free space on it (other programs use it; keeping fewer steps would "
                         f"give back only {older / 2**20:.1f} MiB)")
        return _either(fixes + list(also))

    def filesystem_bytes(self) -> int:
        """The size of the filesystem the job directory is on."""
        vfs = os.statvfs(self.paths.job_dir)
        return vfs.f_blocks * vfs.f_frsize

    def older_steps_bytes(self, saving: int | None) -> int:
        """Bytes this node holds in committed steps older than its newest one (``saving``, the
        step being saved, not counted; nor the leftovers of steps that failed): what keeping
        fewer steps could give back."""
        steps = [s for s in self.paths.step_numbers()
                 if s != saving and os.path.exists(self.paths.metadata(s))]
        total = 0
        for step in steps[:-1]:
            with contextlib.suppress(FileNotFoundError):
                for e in os.scandir(self.paths.step_dir(step)):
                    with contextlib.suppress(FileNotFoundError):
                        total += e.stat().st_blocks * 512
        return total

    def free_bytes(self) -> int:
        vfs = os.statvfs(self.paths.job_dir)
        return vfs.f_bavail * vfs.f_frsize

    def no_room(self, needed: int, step: int | None = None) -> CapacityError:
        """The error for space that ran out after the check passed: another rank of this node
        or another program took it meanwhile."""
        free = self.free_bytes()
        return CapacityError(
            f"checkpoint data needs {needed / 2**20:.1f} MiB but {self.local_dir} ran out of "
            f"space while reserving it ({free / 2**20:.1f} MiB free now; other ranks of this node "
            "or other programs use the rest); "
            + self._remedies(whole=needed, shard=needed, short=needed - free, arriving=0,
                             room=self.filesystem_bytes(), step=step, grow="enlarge the tmpfs",
                             also=("set MLCHECKPOINT_LOCAL_DIR to a larger one",),
                             room_text="its filesystem", elsewhere=True),
            needed=needed, available=free)

    def usage_bytes(self) -> int:
        """Bytes held by this job's files on this node (committed, in flight and pooled)."""
        total = 0
        for root, _dirs, files in os.walk(self.paths.job_dir):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(root, name)).st_blocks * 512
        return total


def _either(fixes: list[str]) -> str:
    """"a", "a or b", "a, b or c"."""
    return fixes[0] if len(fixes) == 1 else ", ".join(fixes[:-1]) + f" or {fixes[-1]}"


class Pooled(NamedTuple):
    """A pooled buffer as ``BufferPool`` ranks it for a shard: the sort key's fields first."""

    unlocked: bool  # not page-locked here, for a rank that saves from device memory
    other_rank: bool  # retired by another owner rank
    short: bool  # smaller than the shard
    slack: int  # bytes between its size and the shard's
    path: str
    size: int


class BufferPool:
    """Retired shard buffers of this node's ranks, kept with their pages for the next saves."""

    def __init__(self, paths: JobPaths, mappings: MappingCache, capacity: Capacity, lock: NodeLock):
        self.paths, self.mappings, self.capacity, self.lock = paths, mappings, capacity, lock
        # Ranks whose buffers take device copies -> the CUDA device each registers under
        # (the warmer's thread registers them: with the rank's device, not device 0, current).
        self.device_ranks: dict[int, int | None] = {}

    def candidate(self, rank: int, nbytes: int, spare_locked: bool = True) -> tuple[str, int] | None:
        """(path, size) of the buffer ``take`` would pick first, if any."""
        ranked = self._ranked(rank, nbytes, spare_locked)
        return (ranked[0].path, ranked[0].size) if ranked else None

    def _ranked(self, rank: int, nbytes: int, spare_locked: bool) -> list[Pooled]:
        """This node's pooled buffers, best first for a shard of ``rank`` of ``nbytes``.

        A buffer this process page-locked is kept for a rank that saves from device memory,
        which takes those first: a replica landing in one would leave that rank's next save a
        buffer to page-lock on the training thread (a second or more per GiB). Another rank (a
        replica's owner) is offered them only without ``spare_locked`` (``ShardFiles._claim``:
        when nothing else gives it room). Then: own rank, fits, least slack or largest
        shortfall filled."""
        device_saver = rank in self.device_ranks
        candidates = []
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.paths.pool_dir):
                entry = classify(e.name)
                if entry.kind is not Kind.POOL_BUFFER:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat()
                    locked = self.mappings.page_locked(st)
                    if locked and spare_locked and not device_saver:
                        continue
                    candidates.append(Pooled(device_saver and not locked, entry.rank != rank,
                                             st.st_size < nbytes, abs(st.st_size - nbytes),
                                             e.path, st.st_size))
        return sorted(candidates)

    def take(self, rank: int, nbytes: int, dest: str, spare_locked: bool = True) -> str | None:
        """Move the best pooled buffer (``_ranked``) to ``dest``."""
        for c in self._ranked(rank, nbytes, spare_locked):
            try:
                os.rename(c.path, dest)  # atomic: a rank racing for the same file gets ENOENT
            except FileNotFoundError:
                continue
            if c.short or c.slack > max(SHRINK_SLACK, nbytes // 4):
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
            in_use = sum(1 for step in self.paths.step_numbers()
                         if os.path.exists(self.paths.data(step, rank))
                         or os.path.exists(self.paths.inflight(step, rank)))
            own = [c for c in self._ranked(rank, nbytes, spare_locked=True) if not c.other_rank]
            ready = sum(1 for c in own if not c.short)
            if in_use + ready >= keep + 1 or len(own) >= POOL_PER_RANK:
                break
            token = secrets.token_hex(8)
            tmp = self.paths.pool_inflight(rank, token)  # gc's if we die here
            try:
                with self.lock.held():
                    self.capacity.preflight(2 * nbytes, reusable=0)  # a save's worth must stay free
                    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, nbytes)
                    # Reserved a piece at a time, each under the node's lock like a save's whole
                    # buffer: a save that comes meanwhile waits for one piece, not for the
                    # buffer, and if it takes the room, this preparation stops (ENOSPC) instead.
                    for start in range(0, nbytes, PREPARE_PIECE):
                        with self.lock.held():
                            buffers.reserve(fd, min(PREPARE_PIECE, nbytes - start), start)
                finally:
                    os.close(fd)
                mapped = self.mappings.map(tmp, nbytes)  # populated: the pages exist from now on
                if rank in self.device_ranks:  # page-locked now, not on a save's path
                    mapped.register_for_device_copies(self.device_ranks[rank])
            except (CapacityError, OSError) as e:
                self.unlink(tmp)
                if isinstance(e, OSError) and e.errno not in NO_ROOM:
                    raise
                log.debug("not preparing more buffers for rank %d: %s", rank, e)
                break
            os.rename(tmp, self.paths.pool_buffer(rank, token))  # same inode: the mapping stays
            made += 1
        if made:
            log.debug("prepared %s of %d bytes for rank %d", plural(made, "buffer"), nbytes, rank)
        return made

    def recycle(self, path: str, rank: int) -> None:
        """Move a shard's data file into the pool (keeping at most ``POOL_PER_RANK`` per rank)."""
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(path)
            # An empty shard's file: nothing to recycle, and pooling it would evict a warm
            # buffer of this rank. A file with holes (a partial replica's): few warm pages,
            # and a save taking it would first have to fill the holes.
            if st.st_size == 0 or st.st_blocks * 512 < st.st_size:
                self.unlink(path)
                return
        dest = self.paths.pool_buffer(rank, secrets.token_hex(8))
        try:
            os.rename(path, dest)
        except FileNotFoundError:
            return
        mine = []
        for e in os.scandir(self.paths.pool_dir):
            entry = classify(e.name)
            if entry.kind is Kind.POOL_BUFFER and entry.rank == rank:
                # Another rank of this node may take (rename) a pooled file at any moment.
                with contextlib.suppress(FileNotFoundError):
                    mine.append((e.stat().st_mtime, e.path))
        for _, extra in sorted(mine, reverse=True)[POOL_PER_RANK:]:
            self.unlink(extra)

    def owners(self) -> set[int]:
        """Owner ranks with a recycled buffer in the pool."""
        found = set()
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.paths.pool_dir):
                entry = classify(e.name)
                if entry.kind is Kind.POOL_BUFFER and entry.rank is not None:
                    found.add(entry.rank)
        return found

    def drop(self, rank: int) -> int:
        """Delete every recycled buffer of ``rank`` (an owner no rank of this node keeps shards
        of any more); returns how many. A save taking one meanwhile keeps it (the rename wins
        or the unlink finds nothing)."""
        dropped = 0
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.paths.pool_dir):
                entry = classify(e.name)
                if entry.kind is Kind.POOL_BUFFER and entry.rank == rank:
                    self.unlink(e.path)
                    dropped += 1
        return dropped

    def discard(self, path: str) -> None:
        """Drop an uncommitted file: into the pool if it is a shard's buffer, else delete."""
        if not os.path.exists(path):
            return
        entry = classify(os.path.basename(path))
        if entry.is_buffer and entry.rank is not None:
            self.recycle(path, entry.rank)
        else:
            self.unlink(path)

    def unlink(self, path: str) -> None:
        """Delete a file, dropping this process's mapping of it first so its pages are freed."""
        self.mappings.forget(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
