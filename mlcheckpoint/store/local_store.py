"""The node-local tmpfs store of one job: its parts, and what spans them.

``LocalStore`` owns the job directory ``<local_dir>/<job_id>`` and the node lock, and is
made of parts that other layers call directly, each the one home of what it holds:
  - ``paths`` (``layout.JobPaths``): every file name (``layout.classify`` says what an entry is);
  - ``capacity`` and ``pool`` (``pool.Capacity``, ``pool.BufferPool``): room checks, usage and
    recycled shard buffers;
  - ``shards`` (``shards.ShardFiles``): writing, committing, opening, mapping and retiring shards;
  - ``metadata`` (``metadata.MetadataFiles``): each step's global metadata and its items;
  - ``inventory`` (``inventory.Inventory``): what is here, for which owner, committed or not;
  - ``cleanup``: what crashes or resumes leave behind.
The methods below are what needs more than one part: a shard begun in a job directory that
may be gone, a shard verified against the metadata, gc and settling, the other jobs here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterable, Iterator

from ..errors import CorruptShardError, JobDirGoneError, ShardNotFoundError
from ..integrity.verify import Listing, verify_region
from ..settings import resolve_job_id, resolve_local_dir, resolve_memory_limit
from ..tmpfs import local_dir_errors, warn_if_not_memory
from . import cleanup
from .buffers import MappingCache
from .identity import Lineage
from .inventory import Inventory, StepState
from .layout import ItemLocation, JobPaths
from .locks import CommitLock, NodeLock, flocked
from .manifest import Manifest
from .metadata import MetadataFiles
from .pool import BufferPool, Capacity
from .shards import ALIGN, ShardFiles, ShardSource, ShardWriter, align

__all__ = ["ALIGN", "LocalStore", "ShardSource", "ShardWriter", "StepState", "align"]

log = logging.getLogger(__name__)


class LocalStore:
    """All checkpoint files of one job on this node, under ``<local_dir>/<job_id>``.

    Safe to use from several processes of the same node at once (each rank writes its own
    shards; step-level bookkeeping takes a file lock). Never touches another job's directory.
    Picklable (DCP's PROCESS mode sends the writer, store included, to another process): the
    mapping cache is per process and arrives empty.
    """

    def __init__(self, local_dir: str | os.PathLike | None = None, job_id: str | None = None, *,
                 memory_limit_bytes: int | str | None = None, create: bool = True):
        self.local_dir = resolve_local_dir(local_dir)
        self.job_id = resolve_job_id(job_id)
        self.paths = JobPaths(os.path.join(self.local_dir, self.job_id))
        self.job_dir = self.paths.job_dir
        self.steps_dir = self.paths.steps_dir
        self.pool_dir = self.paths.pool_dir
        self.lock = NodeLock(self.paths.lock)
        self.commits = CommitLock(self.paths.retention_lock)
        self.mappings = MappingCache()
        self.capacity = Capacity(self.local_dir, self.paths, self.job_id,
                                 resolve_memory_limit(memory_limit_bytes))
        self.pool = BufferPool(self.paths, self.mappings, self.capacity, self.lock)
        self.shards = ShardFiles(self.paths, self.job_id, self.mappings, self.pool, self.capacity,
                                 self.lock, self.commits)
        self.metadata = MetadataFiles(self.paths, self.job_id, self.commits)
        self.inventory = Inventory(self.paths, self.shards, self.metadata)
        if create:
            with local_dir_errors(self.local_dir):
                os.makedirs(self.local_dir, mode=0o700, exist_ok=True)
                for d in (self.job_dir, self.steps_dir, self.pool_dir):
                    os.makedirs(d, mode=0o700, exist_ok=True)
                os.chmod(self.job_dir, 0o700)
            warn_if_not_memory(self.local_dir)

    @property
    def memory_limit_bytes(self) -> int | None:
        """The job's memory limit on this node (None: the tmpfs's free space only)."""
        return self.capacity.memory_limit_bytes

    @memory_limit_bytes.setter
    def memory_limit_bytes(self, limit: int | None) -> None:
        self.capacity.memory_limit_bytes = limit

    def close(self) -> None:
        self.mappings.clear()

    # ------------------------------------------------------------------ paths and locks
    def locked(self) -> contextlib.AbstractContextManager[None]:
        """Job-wide lock for step-level bookkeeping shared by the ranks of a node."""
        return self.lock.held()

    @contextlib.contextmanager
    def fetch_lock(self, step: int, owner: int | None) -> Iterator[None]:
        """Serialise fetches of one shard among the processes of this node."""
        path = self.paths.fetch_lock(step * 1009 + (-1 if owner is None else owner))
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with flocked(path):
            yield

    # ------------------------------------------------------------------ write path
    def begin_shard(self, step: int, rank: int, nbytes: int,
                    held: list[tuple[int, int]] | None = None) -> ShardWriter:
        """Get a mapped buffer of ``nbytes`` for (step, rank), recycled when possible; with
        ``held`` (a partial replica's item ranges), a sparse one in which only those ranges
        take memory (and only they may be written).

        Raises CapacityError before writing anything if tmpfs or the memory limit has no room,
        JobDirGoneError when the job directory was removed under this run.
        """
        try:
            return self.shards.begin(step, rank, nbytes, held)
        except FileNotFoundError as e:
            if os.path.isdir(self.job_dir):
                raise
            raise JobDirGoneError(
                f"the job directory {self.job_dir} is gone: something removed it while this "
                "run used it (rm, a cleanup of the tmpfs, a restarted container; `mlcheckpoint "
                "gc` refuses a directory a live run holds). In-memory saves fail until the job "
                "restarts; the persistent checkpoints asked for are still written") from e

    # ------------------------------------------------------------------ read path
    def verify_shard(self, step: int, rank: int, recorded: Iterable[ItemLocation] = ()) -> Manifest:
        """Check every item's checksum; raises CorruptShardError naming the first bad item.

        Checked against the manifest and against ``recorded``: the item locations the step's
        metadata holds for this rank (what a resume checks, so a manifest rewritten to match
        damaged bytes does not pass). A shard of another save than the metadata here fails.
        """
        m, buf = self.shards.map(step, rank)
        listing = Listing(m.items)  # a partial replica: only the items it lists are here
        recorded = [loc for loc in recorded if not m.partial or listing.lists(loc.offset)]
        with contextlib.suppress(ShardNotFoundError):
            header, _ = self.metadata.read(step)
            if header.save_id != m.save_id:
                raise CorruptShardError(f"step {step} rank {rank}: the shard belongs to save "
                                        f"{m.save_id!r}, the metadata to {header.save_id!r}")
        where = f"step {step} rank {rank} ({self.paths.data(step, rank)})"
        verify_region(buf.array, m.items, where, lambda it: f"item {it.key!r}")
        verify_region(buf.array, recorded, where, lambda loc: f"metadata item at offset {loc.offset}")
        return m

    # ------------------------------------------------------------------ inventory
    def other_jobs(self) -> dict[str, int]:
        """Other jobs under ``local_dir`` that hold step folders and could still be resumed
        (not finished: ``store/claim.py``'s ``mark_finished``): job id -> its newest step. Only
        directory names and that note are looked at (a restart that resolved the wrong job id
        is told what is there); nothing of another job is changed."""
        found: dict[str, int] = {}
        for paths in self._other_job_paths():
            with contextlib.suppress(OSError):  # another user's job, or gone meanwhile
                steps = paths.step_numbers()
                if steps and not os.path.exists(paths.finished):
                    found[os.path.basename(paths.job_dir)] = steps[-1]
        return found

    def finished_jobs(self) -> dict[str, int]:
        """Other jobs under ``local_dir`` whose last run closed cleanly and that no run holds
        since: job id -> the bytes their files take here (what removing them would free)."""
        found: dict[str, int] = {}
        for paths in self._other_job_paths():
            if os.path.exists(paths.finished):
                found[os.path.basename(paths.job_dir)] = _disk_bytes(paths.job_dir)
        return found

    def _other_job_paths(self) -> Iterator[JobPaths]:
        try:
            entries = list(os.scandir(self.local_dir))
        except OSError:
            return
        for e in entries:
            try:
                other = e.name != self.job_id and e.is_dir(follow_symlinks=False)
            except OSError:  # gone meanwhile
                continue
            if other:
                yield JobPaths(e.path)

    # ------------------------------------------------------------------ retirement and gc
    def gc(self, ranks: Iterable[int] | None = None, min_age_s: float = 0.0) -> list[str]:
        """Remove what crashes left behind (see ``cleanup.gc``); returns the removed paths."""
        return cleanup.gc(self.inventory, self.shards, ranks, min_age_s)

    def settle(self, lineage: Lineage, loaded: int | None, set_aside: Iterable[int] = ()) -> list[int]:
        """After a resume, keep only the job's history up to ``loaded`` (see ``cleanup.settle``)."""
        return cleanup.settle(self.inventory, self.shards, lineage, loaded, set_aside)

    def set_aside_runs(self, lineage: Lineage) -> list[int]:
        """Before the first save of a run that did not resume, move the steps of runs outside
        ``lineage`` into ``orphans/`` (see ``cleanup.set_aside_runs``); returns them."""
        return cleanup.set_aside_runs(self.inventory, self.shards, lineage)

    def orphans(self) -> list[tuple[int, str]]:
        """(step, path) of steps set aside by ``settle``."""
        return cleanup.orphans(self.paths)

    def remove_orphan(self, path: str) -> None:
        """Delete a step set aside by ``settle`` (a path ``orphans`` returned)."""
        cleanup.remove_orphan(self.paths, path)

    def destroy(self) -> None:
        """Delete every file of this job on this node."""
        self.mappings.clear()
        shutil.rmtree(self.job_dir, ignore_errors=True)


def _disk_bytes(root: str) -> int:
    """Bytes the files under ``root`` occupy (allocated blocks: a sparse buffer counts what it
    holds)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total
