"""What ``CheckpointManager.checkpoints()`` lists: the in-memory steps on this node (with
their replication state when replication runs) and the persistent steps. Whether a step is
whole on this node is the recovery planner's verdict over this node's inventory
(``verdicts_here``), which ``mlcheckpoint ls`` and ``verify`` print too."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..errors import CopyId
from ..persistent import PersistentStorage
from ..recovery.planner import NodeInventory, StepVerdict, step_verdicts
from ..replication import Replicator
from ..store import LocalStore
from ..store.inventory import StepState


@dataclass
class CheckpointEntry:
    """One row of ``CheckpointManager.checkpoints()``."""

    step: int
    location: str  # "memory" or "persistent"
    # see ``step_label``: complete | incomplete | superseded | partly retired | other run
    state: str
    bytes: int | None
    ranks: list[int] = field(default_factory=list)  # ranks whose shards are on this node
    replication: str | None = None  # this rank's shard: committed | replicated | failed: why | ...
    protected: bool | None = None  # every shard and the metadata on two nodes (job-wide)
    # ranks the step needs with an item on no shard here (its own, a partial replica of it, or
    # one keeping a data-parallel copy): a resume from this node alone lacks them
    missing: list[int] = field(default_factory=list)


# What a step that is not whole on this node is (``mlcheckpoint ls`` and ``checkpoints()``).
COMPLETE = "complete"  # a resume could load it from this node alone (``verdicts_here``)
INCOMPLETE = "incomplete"  # no newer step is whole here: a save in flight, or one a crash cut
SUPERSEDED = "superseded"  # a newer step is whole here; replication skipped this one for it
PARTLY_RETIRED = "partly retired"  # replicated, then retention removed some of its shards here
OTHER_RUN = "other run"  # saved by a run the newest save does not descend from: never loaded

HERE = 0  # this node, as ``verdicts_here`` names it in the planner's inputs (``CopyId.node``)


def verdicts_here(store: LocalStore, bad_copies: Iterable[CopyId] = (),
                  listed: Mapping[int, StepState] | None = None) -> dict[int, StepVerdict]:
    """What the recovery planner decides of each step of ``store`` from this node's holdings
    alone (``planner.step_verdicts``): complete when a resume could load it from here, else
    which ranks' items are not here. ``bad_copies`` (node ``HERE``): copies found corrupt;
    ``listed``: the store's ``inventory.all()`` when the caller has just taken it."""
    steps = store.inventory.all() if listed is None else dict(listed)
    return step_verdicts([NodeInventory(HERE, [HERE], steps)], bad_copies=bad_copies)


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


def step_labels(verdicts: Mapping[int, StepVerdict], replicated: set[int]) -> dict[int, str]:
    """``step_label`` of every step of ``verdicts`` (``verdicts_here``), ``other run`` for a
    step of another run of the job; ``replicated``: the steps this node pushed to a partner."""
    newest_whole = max((s for s, v in verdicts.items() if v.complete), default=None)
    return {s: OTHER_RUN if v.foreign else
            step_label(v.complete, newest_whole is not None and newest_whole > s, s in replicated)
            for s, v in verdicts.items()}


def list_checkpoints(store: LocalStore, replicator: Replicator | None,
                     persistent: PersistentStorage | None) -> list[CheckpointEntry]:
    """In-memory steps in ``store`` and steps in ``persistent``, oldest first."""
    entries = []
    inventory = store.inventory.all()
    verdicts = verdicts_here(store, listed=inventory)
    states = {s: replicator.state(s) for s in inventory} if replicator is not None else {}
    labels = step_labels(verdicts, {s for s, rep in states.items()
                                    if rep is not None and rep.state == "replicated"})
    for step, st in inventory.items():
        verdict = verdicts.get(step, StepVerdict(False))  # (no usable metadata of it here)
        entry = CheckpointEntry(step, "memory", labels.get(step, INCOMPLETE), st.total_bytes,
                                sorted(st.committed_ranks), missing=list(verdict.missing))
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
