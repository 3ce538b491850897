"""Is ``local_dir`` fit to hold checkpoints? On a memory filesystem, writable, big enough.

- ``local_dir_errors``: what the OS says while the store creates its directories (a file in
  the way, a read-only or foreign directory) becomes a ConfigError naming the fix;
- ``warn_if_not_memory``: one warning when ``local_dir`` is not on tmpfs/ramfs (statfs);
- ``RoomCheck``: one warning line, at construction and at the first save, when the tmpfs is
  too small for what the job keeps. Containers get small memory filesystems by default
  (Docker: a 64 MiB ``/dev/shm``), and a checkpoint that does not fit fails only later, at a
  save or when a partner's replica arrives. It never raises: a save that does not fit still
  gets its CapacityError from the store.

A node holds ``keep`` steps of its own ranks' shards and, when replicating, as many of each
partner's (``replicas`` of them): for a node of n ranks with shards of s bytes,
keep * n * s * (1 + replicas).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ._messages import plural
from .errors import ConfigError
from .settings import DEFAULT_LOCAL_DIR
from .topology import Topology

if TYPE_CHECKING:
    from .store.layout import JobPaths

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- creating it, its filesystem

@contextlib.contextmanager
def local_dir_errors(local_dir: str) -> Iterator[None]:
    """Turn what the OS says while creating the store's directories into a ConfigError that
    names ``local_dir`` and the fix (a regular file in the way, a read-only or foreign dir)."""
    fix = "pass local_dir= (or set MLCHECKPOINT_LOCAL_DIR to) a writable directory on tmpfs"
    try:
        yield
    except (FileExistsError, NotADirectoryError) as e:
        what = repr(e.filename) if isinstance(e, FileExistsError) else f"a part of {e.filename!r}"
        raise ConfigError(f"local_dir {local_dir!r} cannot hold checkpoints: {what} is a file, "
                          f"not a directory; {fix}") from e
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        why = "is on a read-only filesystem" if e.errno == errno.EROFS else "is not writable by this user"
        raise ConfigError(f"local_dir {local_dir!r} {why} ({e.strerror}: {e.filename!r}); "
                          f"{fix}") from e


# statfs f_type of the filesystems that keep their files in memory, and names of a few others
# for the warning's wording.
_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs", 0x958458F6: "hugetlbfs"}
_OTHER_FS = {0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x794C7630: "overlayfs",
            0x6969: "nfs", 0xFF534D42: "cifs", 0x65735546: "fuse", 0x2FC12FC1: "zfs"}
_warned_not_memory: set[str] = set()


def filesystem_type(path: str) -> int | None:
    """statfs(2)'s f_type of the filesystem holding ``path``; None where it cannot be read."""
    try:
        statfs = ctypes.CDLL(None, use_errno=True).statfs
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes; f_type comes first
    if statfs(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def warn_if_not_memory(local_dir: str) -> None:
    """Warn (once per directory and process) when ``local_dir`` is not on tmpfs/ramfs."""
    fs = filesystem_type(local_dir)
    if fs is None or fs in _MEMORY_FS or local_dir in _warned_not_memory:
        return
    _warned_not_memory.add(local_dir)
    log.warning(
        "mlcheckpoint: local_dir %s is on %s, not tmpfs: in-memory checkpoints go to that "
        "filesystem instead, so saves and resumes run at its speed, not at memory speed, and "
        "take its space. Point local_dir= or MLCHECKPOINT_LOCAL_DIR at a tmpfs directory such "
        "as %s.", local_dir, _OTHER_FS.get(fs, f"a filesystem of type {fs:#x}"), DEFAULT_LOCAL_DIR)


# ---------------------------------------------------------------- its size

MiB = 1 << 20
CONTAINER_DEFAULT_BYTES = 64 * MiB  # Docker's /dev/shm unless `--shm-size` says otherwise
HOW_TO_RAISE = ("raise `docker run --shm-size`, the Kubernetes emptyDir's `sizeLimit` "
                "(medium: Memory), or the size of a hostPath tmpfs, or point "
                "MLCHECKPOINT_LOCAL_DIR at a larger tmpfs")


def filesystem_bytes(path: str) -> int:
    """Total size of the filesystem holding ``path``."""
    vfs = os.statvfs(path)
    return vfs.f_blocks * vfs.f_frsize


def step_room(local_dir: str, memory_limit: int | None, keep: int) -> int:
    """The bytes one step of this node's shards may take: the job's memory limit (else the
    size of ``local_dir``'s tmpfs) shared by the ``keep`` steps it holds, the newest
    protected step (kept when older) and the one being saved."""
    size = filesystem_bytes(local_dir)
    limit = memory_limit
    return (size if limit is None else min(limit, size)) // (max(1, keep) + 2)


def needed_bytes(shard_bytes: int, *, keep: int, ranks_per_node: int, replicating: bool,
                 replica_sets: int = 1, arriving: int | None = None) -> int:
    """tmpfs a node needs: ``keep`` steps of its ranks' shards and, when ``replicating``, of
    what its partners' replicas bring per rank: ``arriving`` bytes where known (with data
    parallelism's copies only the items that lack places cross), else as much again as a shard
    for each of the ``replica_sets`` partners (FSDP shards evenly)."""
    if not replicating:
        return keep * ranks_per_node * shard_bytes
    brought = replica_sets * shard_bytes if arriving is None else arriving
    return keep * ranks_per_node * (shard_bytes + brought)


class RoomCheck:
    """Warns once when ``local_dir`` cannot hold what this job will keep there."""

    def __init__(self, local_dir: str, paths: JobPaths, topology: Topology, keep: int,
                 replica_sets: int, reclaimable: Callable[[], dict[str, int]] | None = None):
        self.local_dir, self.paths, self.topology = local_dir, paths, topology
        # Finished jobs under local_dir (job id -> bytes): named when room is short, as the
        # memory to reclaim first (LocalStore.finished_jobs)
        self.reclaimable = reclaimable
        self.keep, self.replica_sets = keep, replica_sets  # 0: not replicating
        self.size = filesystem_bytes(local_dir)
        self._first_save_checked = False
        # What the partners' replicas bring per rank and step, where the replication layer can
        # tell (None, or it says None: shards of this rank's size)
        self.arriving: Callable[[], int | None] | None = None

    def _holds(self) -> str:
        partner = (" and its partner nodes' replicas" if self.replica_sets > 1
                   else " and its partner node's replicas" if self.replica_sets else "")
        return (f"keep={self.keep} steps of this node's "
                f"{plural(self.topology.local_world_size, 'rank')}{partner}")

    def _needed(self, shard_bytes: int) -> int:
        return needed_bytes(shard_bytes, keep=self.keep,
                            ranks_per_node=self.topology.local_world_size,
                            replicating=self.replica_sets > 0, replica_sets=self.replica_sets,
                            arriving=self.arriving() if self.arriving is not None else None)

    def _warn(self, message: str) -> None:
        if self.topology.is_node_leader:  # the ranks of a node share the tmpfs: one line
            log.warning("mlcheckpoint: %s; %s%s", message, HOW_TO_RAISE, self._finished_jobs())

    def _finished_jobs(self) -> str:
        """Finished jobs' memory under local_dir, the first to reclaim (or "")."""
        jobs = self.reclaimable() if self.reclaimable is not None else {}
        if not jobs:
            return ""
        names = sorted(jobs, key=lambda job: -jobs[job])
        listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return (f". Finished jobs here hold {sum(jobs.values()) / MiB:.0f} MiB ({listed}): "
                "'mlcheckpoint gc --finished' frees them")

    def at_start(self) -> None:
        """Before any save the size of a step is unknown; a filesystem no larger than the
        container default is too small for any real model's state."""
        if self.size > CONTAINER_DEFAULT_BYTES:
            return
        per_rank = self.size // self._needed(1)
        self._warn(f"{self.local_dir} is on a {self.size / MiB:.0f} MiB filesystem (the size of "
                   f"a container's default /dev/shm): it holds {self._holds()} only for shards "
                   f"under {per_rank / MiB:.1f} MiB per rank")

    def after_first_save(self, step: int) -> None:
        """Once this rank's first shard is in tmpfs, its size says what the node will need."""
        if self._first_save_checked:
            return
        self._first_save_checked = True
        shard = self._shard_bytes(step)
        if shard is None:
            return
        needed = self._needed(shard)
        if needed > self.size:
            self._warn(f"{self.local_dir} is on a {self.size / MiB:.0f} MiB filesystem, too small "
                       f"for {self._holds()}: about {needed / MiB:.0f} MiB with "
                       f"{shard / MiB:.1f} MiB per rank and step")

    def _shard_bytes(self, step: int) -> int | None:
        # Committed by save(); possibly still being written after async_save() returns.
        rank = self.topology.rank
        for path in (self.paths.data(step, rank), self.paths.inflight(step, rank)):
            with contextlib.suppress(OSError):
                return os.stat(path).st_size
        return None
