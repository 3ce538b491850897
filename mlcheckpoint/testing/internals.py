"""The parts a CheckpointManager is built from, for tests that look inside or damage them.

A training loop reads what it needs through the manager's methods (``stats()``,
``checkpoints()``, ``protection()``, ``replication_state()``, ``SaveResult``, ``ResumeInfo``).
A test that flips a byte of a shard, holds the staging thread, or checks which steps are
pinned needs the parts themselves: ``internals(ckpt)`` is the one door to them, so the
manager's private names are spelled in one place outside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dcp.snapshot import Snapshotter
from ..manager import CheckpointManager
from ..manager.lifecycle import BufferWarmer
from ..manager.persistent_writer import PersistentWriter
from ..manager.saving import Saver
from ..persistent import PersistentStorage
from ..replication import Replicator
from ..store import LocalStore
from ..store.pins import Pins


@dataclass(frozen=True)
class Internals:
    store: LocalStore  # this rank's tmpfs files
    pins: Pins  # steps a transfer or a persistent write reads
    snapshots: Snapshotter  # the staging thread, guards, plan cache
    warmer: BufferWarmer  # buffers of the next saves
    replicator: Replicator | None  # None: replication off
    persistent: PersistentStorage | None  # the persistent folder, if any
    persistent_writer: PersistentWriter | None
    saver: Saver  # the save path (its copy policy: dcp/copies.py)


def internals(ckpt: CheckpointManager) -> Internals:
    """``ckpt``'s parts (tests only)."""
    lifecycle = ckpt._lifecycle
    return Internals(store=ckpt._store, pins=lifecycle.pins, snapshots=ckpt._snapshots,
                     warmer=lifecycle.warmer, replicator=ckpt._replicator,
                     persistent=ckpt._persistent, persistent_writer=ckpt._persistent_writer,
                     saver=ckpt._saver)
