"""Is the tmpfs big enough? One warning line, at construction and at the first save.

Containers get small memory filesystems by default (Docker: a 64 MiB ``/dev/shm``), and a
checkpoint that does not fit fails only later, at a save or when a partner's replica arrives.
This says so early, in one line that names the setting to raise. It never raises: a save
that does not fit still gets its CapacityError from the store.

A node holds ``keep`` steps of its own ranks' shards and, when replicating, as many of each
partner's (``replicas`` of them): for a node of n ranks with shards of s bytes,
keep * n * s * (1 + replicas).
"""

from __future__ import annotations

import contextlib
import logging
import os

from ._words import plural
from .store.layout import JobPaths
from .store.local_store import LocalStore
from .topology import Topology

log = logging.getLogger(__name__)

MiB = 1 << 20
CONTAINER_DEFAULT_BYTES = 64 * MiB  # Docker's /dev/shm unless `--shm-size` says otherwise
HOW_TO_RAISE = ("raise `docker run --shm-size`, the Kubernetes emptyDir's `sizeLimit` "
                "(medium: Memory), or the size of a hostPath tmpfs, or point "
                "MLCHECKPOINT_LOCAL_DIR at a larger tmpfs")


def filesystem_bytes(path: str) -> int:
    """Total size of the filesystem holding ``path``."""
    vfs = os.statvfs(path)
    return vfs.f_blocks * vfs.f_frsize


def step_room(store: LocalStore, keep: int) -> int:
    """The bytes one step of this node's shards may take: the job's memory limit (else its
    tmpfs's size) shared by the ``keep`` steps it holds, the newest protected step (kept
    when older) and the one being saved."""
    size = filesystem_bytes(store.local_dir)
    limit = store.memory_limit_bytes
    return (size if limit is None else min(limit, size)) // (max(1, keep) + 2)


def needed_bytes(shard_bytes: int, *, keep: int, ranks_per_node: int, replicating: bool,
                 replica_sets: int = 1) -> int:
    """tmpfs a node needs: ``keep`` steps of its ranks' shards, and as much again for each of
    the ``replica_sets`` partners' replicas it keeps when ``replicating`` (assumed the same
    size: FSDP shards evenly)."""
    return keep * ranks_per_node * shard_bytes * (1 + (replica_sets if replicating else 0))


class RoomCheck:
    """Warns once when ``local_dir`` cannot hold what this job will keep there."""

    def __init__(self, local_dir: str, paths: JobPaths, topology: Topology, keep: int,
                 replica_sets: int):
        self.local_dir, self.paths, self.topology = local_dir, paths, topology
        self.keep, self.replica_sets = keep, replica_sets  # 0: not replicating
        self.size = filesystem_bytes(local_dir)
        self._first_save_checked = False

    def _holds(self) -> str:
        partner = (" and its partner nodes' replicas" if self.replica_sets > 1
                   else " and its partner node's replicas" if self.replica_sets else "")
        return (f"keep={self.keep} steps of this node's "
                f"{plural(self.topology.local_world_size, 'rank')}{partner}")

    def _needed(self, shard_bytes: int) -> int:
        return needed_bytes(shard_bytes, keep=self.keep,
                            ranks_per_node=self.topology.local_world_size,
                            replicating=self.replica_sets > 0, replica_sets=self.replica_sets)

    def _warn(self, message: str) -> None:
        if self.topology.local_rank == 0:  # the ranks of a node share the tmpfs: one line
            log.warning("mlcheckpoint: %s; %s", message, HOW_TO_RAISE)

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
        for path in (self.paths.data(step, rank), self.paths.partial(step, rank)):
            with contextlib.suppress(OSError):
                return os.stat(path).st_size
        return None
