"""What ``CheckpointManager.checkpoints()`` lists: the in-memory steps on this node (with
their replication state when replication runs) and the persistent steps."""

from __future__ import annotations

from dataclasses import dataclass, field

from .persistent import PersistentStorage
from .replication import Replicator
from .store import LocalStore


@dataclass
class CheckpointEntry:
    """One row of ``CheckpointManager.checkpoints()``."""

    step: int
    location: str  # "memory" or "persistent"
    state: str  # "complete", "incomplete"
    bytes: int | None
    ranks: list[int] = field(default_factory=list)  # ranks whose shards are on this node
    replication: str | None = None  # this rank's shard: committed | replicated | failed: why | ...
    protected: bool | None = None  # every shard and the metadata on two nodes (job-wide)


def list_checkpoints(store: LocalStore, replicator: Replicator | None,
                     persistent: PersistentStorage | None) -> list[CheckpointEntry]:
    """In-memory steps in ``store`` and steps in ``persistent``, oldest first."""
    entries = []
    for step, st in store.inventory().items():
        entry = CheckpointEntry(step, "memory", "complete" if st.complete else "incomplete",
                                st.total_bytes, sorted(st.committed_ranks))
        if replicator is not None:
            rep = replicator.state(step)
            entry.replication = None if rep is None else (
                rep.state if rep.reason is None else f"{rep.state}: {rep.reason}")
            entry.protected = replicator.is_protected(step)
        entries.append(entry)
    if persistent is not None:
        for step in persistent.steps():
            entries.append(CheckpointEntry(step, "persistent", "complete",
                                           persistent.size_bytes(step)))
    return sorted(entries, key=lambda e: (e.step, e.location))
