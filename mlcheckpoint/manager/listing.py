"""What ``CheckpointManager.checkpoints()`` lists: the in-memory steps on this node (with
their replication state when replication runs) and the persistent steps."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..persistent import PersistentStorage
from ..replication import Replicator
from ..store import LocalStore
from ..store.inventory import StepState


@dataclass
class CheckpointEntry:
    """One row of ``CheckpointManager.checkpoints()``."""

    step: int
    location: str  # "memory" or "persistent"
    state: str  # see ``step_label``: complete | incomplete | superseded | partly retired
    bytes: int | None
    ranks: list[int] = field(default_factory=list)  # ranks whose shards are on this node
    replication: str | None = None  # this rank's shard: committed | replicated | failed: why | ...
    protected: bool | None = None  # every shard and the metadata on two nodes (job-wide)


# What a step that is not whole on this node is (``mlcheckpoint ls`` and ``checkpoints()``).
COMPLETE = "complete"  # every rank's shard and the metadata are here
INCOMPLETE = "incomplete"  # no newer step is whole here: a save in flight, or one a crash cut
SUPERSEDED = "superseded"  # a newer step is whole here; replication skipped this one for it
PARTLY_RETIRED = "partly retired"  # replicated, then retention removed some of its shards here


def step_label(complete: bool, newer_complete: bool, replicated: bool) -> str:
    """How a listing names a step of this node: ``complete`` when it is whole here. Otherwise
    a step older than one whole here is no loss: ``superseded`` when it was never replicated
    from this node (replication went to a newer save), ``partly retired`` when it was and
    retention has since removed part of it (what is left is kept for one owner's ``keep``).
    Only a step with nothing whole after it is ``incomplete``."""
    if complete:
        return COMPLETE
    if not newer_complete:
        return INCOMPLETE
    return PARTLY_RETIRED if replicated else SUPERSEDED


def step_labels(inventory: Mapping[int, StepState], replicated: set[int]) -> dict[int, str]:
    """``step_label`` of every step of ``inventory`` (step -> StepState); ``replicated``: the
    steps this node pushed to a partner."""
    newest_whole = max((s for s, st in inventory.items() if st.complete), default=None)
    return {s: step_label(st.complete, newest_whole is not None and newest_whole > s,
                          s in replicated) for s, st in inventory.items()}


def list_checkpoints(store: LocalStore, replicator: Replicator | None,
                     persistent: PersistentStorage | None) -> list[CheckpointEntry]:
    """In-memory steps in ``store`` and steps in ``persistent``, oldest first."""
    entries = []
    inventory = store.inventory()
    states = {s: replicator.state(s) for s in inventory} if replicator is not None else {}
    labels = step_labels(inventory, {s for s, rep in states.items()
                                     if rep is not None and rep.state == "replicated"})
    for step, st in inventory.items():
        entry = CheckpointEntry(step, "memory", labels[step], st.total_bytes,
                                sorted(st.committed_ranks))
        if replicator is not None:
            rep = states[step]
            entry.replication = None if rep is None else (
                rep.state if rep.reason is None else f"{rep.state}: {rep.reason}")
            entry.protected = replicator.is_protected(step)
        entries.append(entry)
    if persistent is not None:
        for step in persistent.steps():
            entries.append(CheckpointEntry(step, "persistent", "complete",
                                           persistent.size_bytes(step)))
    return sorted(entries, key=lambda e: (e.step, e.location))
