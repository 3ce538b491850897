"""Retention: which committed steps to retire (a pure plan), and retiring them.

``plan_retention`` decides from an inventory alone; ``retire`` carries a plan out on a store;
``RetentionPolicy`` is what a CheckpointManager holds: ``keep`` and where protected steps
come from (pinned readers, and the newest step replicated everywhere).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .inventory import StepState

if TYPE_CHECKING:
    from .local_store import LocalStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPlan:
    """What retention retires: shards (step, owner), steps left with only their metadata, and
    steps a resume set aside (step, path) once a newer step is complete."""

    shards: tuple[tuple[int, int], ...] = ()
    bare_metadata: tuple[int, ...] = ()
    set_aside: tuple[tuple[int, str], ...] = ()
    newest_complete: int | None = None

    @property
    def steps(self) -> list[int]:
        """The steps some of whose shards go."""
        return sorted({step for step, _ in self.shards})


def plan_retention(inventory: Mapping[int, StepState], owners: Iterable[int], keep: int,
                   protected: Iterable[int] = (),
                   set_aside: Iterable[tuple[int, str]] = ()) -> RetentionPlan:
    """Keep the newest ``keep`` complete steps of each owner rank in ``owners``, and the newest
    step held whole here.

    A step counts as complete for rank r when the step's metadata and r's shard of the same
    save are both committed. Steps newer than the oldest kept one (e.g. a save in flight) and
    ``protected`` steps are never touched. Steps a resume ``set_aside`` go once a newer step is
    complete.

    The newest step this node holds *whole* (``StepState.complete``: the metadata and every
    rank's shard of one save, own or replica) is never touched either, whatever ranks skipped
    and however stale the caller's ``protected`` is: a node that once held a step whole keeps
    one until a newer one is whole here (the whole-step invariant). Every plan guards the
    newest whole step it sees, so a step goes only once a newer one is whole, and that one in
    turn only once a still newer one is: whatever thread plans, when.
    """
    if keep < 1:
        raise ValueError("keep must be >= 1")
    newest_whole = max((s for s, st in inventory.items() if st.complete), default=None)
    protected = set(protected) | ({newest_whole} if newest_whole is not None else set())
    shards: list[tuple[int, int]] = []
    bare: list[int] = []
    for rank in owners:
        complete = [s for s, st in inventory.items() if rank in st.ranks_of(st.save_id)]
        if len(complete) <= keep:
            continue
        oldest_kept = sorted(complete)[-keep]
        for s, st in inventory.items():
            if s < oldest_kept and s not in protected and rank in st.committed_ranks:
                shards.append((s, rank))
        # Metadata that outlived every shard of its step (e.g. pushed by the coordinator).
        bare += [s for s, st in inventory.items()
                 if s < oldest_kept and s not in protected and not st.committed_ranks and s not in bare]
    aside = tuple((step, path) for step, path in set_aside
                  if newest_whole is not None and step < newest_whole)
    return RetentionPlan(tuple(shards), tuple(bare), aside, newest_whole)


def retire(store: LocalStore, plan: RetentionPlan) -> list[int]:
    """Carry out a plan on ``store``; returns the steps some of whose shards went."""
    for step, rank in plan.shards:
        store.retire_shard(step, rank)
        log.debug("retired step %d rank %d", step, rank)
    for step in plan.bare_metadata:
        store.shards.remove_step_if_empty(step)
    for step, path in plan.set_aside:
        log.info("removing step %d set aside at an earlier resume: step %s is complete",
                 step, plan.newest_complete)
        shutil.rmtree(path, ignore_errors=True)
    return plan.steps


class Pinned(Protocol):
    """Steps whose buffers someone is reading (a transfer, a persistent write)."""

    def steps(self) -> set[int]: ...


class Protection(Protocol):
    """Which steps are on two nodes, job-wide, and which one is being replicated (the
    replicator)."""

    def newest_protected(self, candidates: list[int]) -> int | None: ...

    def known_protected(self) -> int | None: ...

    def round_step(self) -> int | None: ...


@dataclass
class RetentionPolicy:
    """Keep ``keep`` complete steps per owner, never a pinned step, never the newest step
    replicated everywhere until a newer one is, never the step being replicated now (so its
    shards are here when the partner's replicas of it arrive), and never the newest step held
    whole here (``plan_retention``)."""

    keep: int
    pins: Pinned
    replicas: Protection | None = None

    def protected(self, store: LocalStore, *, ask: bool = True) -> set[int]:
        """Steps retention must keep. ``ask=False`` uses the last known protected step rather
        than asking the job-wide counters (a listener thread). That value may be stale, i.e.
        older: it then guards an older step and leaves the newest protected one to the
        next plan that asks; the newest whole step is guarded by every plan regardless."""
        protected = self.pins.steps()
        if self.replicas is not None:
            newest = (self.replicas.newest_protected(store.steps()) if ask
                      else self.replicas.known_protected())
            protected |= {s for s in (newest, self.replicas.round_step()) if s is not None}
        return protected

    def apply(self, store: LocalStore, owners: Iterable[int], *, ask: bool = True) -> list[int]:
        """Retire ``owners``' shards beyond ``keep`` in ``store``; returns the steps retired."""
        return store.apply_retention(owners, self.keep, protected=self.protected(store, ask=ask))


class Retention:
    """A CheckpointManager's retention: its policy over this rank's own shards and, once
    replication runs, the replicas this node keeps for its partners."""

    def __init__(self, store: LocalStore, rank: int, keep: int, pins: Pinned):
        self.store = store
        self.policy = RetentionPolicy(keep, pins)
        self.owners = [rank]  # whose shards ``apply`` retires

    def protect_replicas(self, replicas: Protection, partners: Iterable[int]) -> None:
        """Replication started: keep the newest step replicated everywhere, and retire the
        replicas of ``partners`` too."""
        self.policy.replicas = replicas
        self.owners = [self.owners[0], *partners]

    def apply(self) -> list[int]:
        """Retire this rank's shards and the replicas it keeps beyond ``keep``."""
        return self.policy.apply(self.store, self.owners)

    def apply_received(self, owner: int) -> list[int]:
        """A replica of ``owner`` arrived (a listener thread: uses the last known protected
        step rather than asking the c10d store; a stale value only keeps more)."""
        return self.policy.apply(self.store, [owner], ask=False)
