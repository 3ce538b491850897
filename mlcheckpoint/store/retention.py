"""Retention: which committed steps to retire (a pure plan), and retiring them.

``plan_retention`` decides from an inventory alone; ``retire`` carries a plan out on the
store's shard files. Which steps a pass must protect, and when passes run, is the lifecycle
policy's (``mlcheckpoint/lifecycle.py``).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .inventory import StepState
from .shards import ShardFiles

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


def retire(shards: ShardFiles, plan: RetentionPlan) -> list[int]:
    """Carry out a plan on a job's ``shards``; returns the steps some of whose shards went."""
    for step, rank in plan.shards:
        shards.retire(step, rank)
        log.debug("retired step %d rank %d", step, rank)
    for step in plan.bare_metadata:
        shards.remove_step_if_empty(step)
    for step, path in plan.set_aside:
        log.info("removing step %d set aside at an earlier resume: step %s is complete",
                 step, plan.newest_complete)
        shutil.rmtree(path, ignore_errors=True)
    return plan.steps
