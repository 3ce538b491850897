"""Retention, in one module: which checkpoints a node keeps (the policy), which files go (a pure
plan over the node's inventory), and the pass that retires them on the store.

Who runs a pass: the ``Saver`` after each committed save and the manager's ``storage_writer``
before a DCP-native one (``Retention.apply``), the persistent writer once a step it pinned is
released, the lifecycle's subscriber when a partner's replica lands (``Retention.apply_received``),
and ``mlcheckpoint gc --keep`` (``apply_retention`` with no owner of its own).

What a pass keeps (``plan_retention``):
- for each owner rank it answers for (its own rank; once replication runs, the ranks whose
  replicas it keeps), the newest ``keep`` steps whose shard of that owner belongs to the save
  the step's metadata names;
- never a pinned step (read by the pass itself, ``Pins.held``) nor a protected one
  (``Retention.protected``: the newest step replicated everywhere, the replication round's),
  never the newest step held whole here, never a step
  newer than those kept (a save in flight);
- shards of owners no rank of this node answers for (``node_owners``: the ranks of an earlier
  world, replicas of a node that is no longer a partner) go with their step, once no shard in
  it is kept for a live owner and it is older than the newest ``keep`` steps finished here;
- a step left with nothing but its metadata loses that too; a step a resume set aside goes
  once a newer step is whole; recycled buffers of owners no rank here answers for are deleted.

The store (layer 1) stays passive: it provides the inventory, the ``CommitLock`` and the
primitives a pass calls (``ShardFiles.retire``, ``ShardFiles.remove_step_if_empty``,
``BufferPool.drop``, ``LocalStore.remove_orphan``); what to keep is decided here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._faults import pause_point
from ..store import LocalStore, StepState
from ..store.pins import Pins

if TYPE_CHECKING:
    from ..replication.schedule.status import Protection

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- the plan (pure)

@dataclass(frozen=True)
class RetentionPlan:
    """What a pass retires: shards (step, owner), steps left with only their metadata, steps a
    resume set aside (step, path) once a newer step is whole, and owners whose recycled buffers
    are deleted."""

    shards: tuple[tuple[int, int], ...] = ()
    bare_metadata: tuple[int, ...] = ()
    set_aside: tuple[tuple[int, str], ...] = ()
    newest_complete: int | None = None  # the newest step held whole here (always kept)
    pooled: tuple[int, ...] = ()

    @property
    def steps(self) -> list[int]:
        """The steps some of whose shards go."""
        return sorted({step for step, _ in self.shards})


def finished_steps(inventory: Mapping[int, StepState]) -> list[int]:
    """Steps whose save finished, as far as this node can tell, oldest first: the step's
    metadata is here (the coordinator writes it only after every rank committed its shard) and
    so is a shard of that very save. Whether the other nodes still hold their shards no node
    can see from its own files: that is the recovery planner's job-wide question."""
    return sorted(s for s, st in inventory.items() if st.has_metadata and st.ranks_of(st.save_id))


def plan_retention(inventory: Mapping[int, StepState], owners: Iterable[int], keep: int,
                   protected: Iterable[int] = (), set_aside: Iterable[tuple[int, str]] = (), *,
                   node_owners: Iterable[int] | None = None,
                   pooled: Iterable[int] = ()) -> RetentionPlan:
    """Keep the newest ``keep`` complete steps of each owner rank in ``owners``, and the newest
    step held whole here; retire the shards of owners outside ``node_owners`` with their step.

    A step counts as complete for rank r when the step's metadata and r's shard of the same
    save are both committed. Once r has ``keep`` complete steps, its shards of older steps go,
    complete or not (a step whose metadata never reached this node: its round was superseded).
    Steps newer than the oldest kept one (e.g. a save in flight) and ``protected`` steps are
    never touched. Steps a resume ``set_aside`` go once a newer step is
    whole.

    ``node_owners``: every owner some rank of this node answers for (its ranks and the ranks
    whose replicas they keep); None when unknown, and then only ``owners`` lose shards. An owner
    outside it (a rank of an earlier world size, a replica of a former partner) has no rank to
    retire its shards, so they go with their step: once the step is older than the newest
    ``keep`` finished steps here (``finished_steps``) and holds no shard of an owner in
    ``node_owners`` that this plan keeps (another rank's pass retires those, and these with the
    last of them). ``pooled`` (owners with recycled buffers) outside ``node_owners`` are named
    in ``RetentionPlan.pooled``, with every such owner whose shard this plan retires.
    ``owners=()`` with ``node_owners=()`` is ``mlcheckpoint gc --keep``: every shard of a step
    older than the newest ``keep`` finished ones goes.

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
    guarded = set(protected) | ({newest_whole} if newest_whole is not None else set())
    retired: set[tuple[int, int]] = set()
    horizon = None  # steps older than this are past some owner's (or the node's) newest kept
    for rank in owners:
        complete = sorted(s for s, st in inventory.items() if rank in st.ranks_of(st.save_id))
        if len(complete) < keep:
            continue
        oldest_kept = complete[-keep]
        horizon = oldest_kept if horizon is None else max(horizon, oldest_kept)
        retired |= {(s, rank) for s, st in inventory.items()
                    if s < oldest_kept and s not in guarded and rank in st.committed_ranks}
    finished = finished_steps(inventory)
    if len(finished) >= keep:
        oldest_kept = finished[-keep]
        horizon = oldest_kept if horizon is None else max(horizon, oldest_kept)
        if node_owners is not None:
            live = set(node_owners)
            for s, st in inventory.items():
                if s >= oldest_kept or s in guarded:
                    continue
                if not any(r in live and (s, r) not in retired for r in st.committed_ranks):
                    retired |= {(s, r) for r in st.committed_ranks if r not in live}
    # What is left of a step once its shards go: its metadata (with nothing to describe here).
    bare = sorted(s for s, st in inventory.items()
                  if horizon is not None and s < horizon and s not in guarded
                  and all((s, r) in retired for r in st.committed_ranks))
    aside = tuple((step, path) for step, path in set_aside
                  if newest_whole is not None and step < newest_whole)
    pool: tuple[int, ...] = ()
    if node_owners is not None:
        pool = tuple(sorted((set(pooled) | {r for _, r in retired}) - set(node_owners)))
    return RetentionPlan(tuple(sorted(retired)), tuple(bare), aside, newest_whole, pool)


# ---------------------------------------------------------------------------- the pass

def apply_retention(store: LocalStore, owners: Iterable[int], keep: int,
                    protected: Iterable[int] = (), *, pins: Pins | None = None,
                    node_owners: Iterable[int] | None = None) -> list[int]:
    """One retention pass on ``store`` (see ``plan_retention``); returns the steps some of
    whose shards went. ``pins``: this process's readers; their steps are kept as
    ``protected`` are, and no pin is taken while the pass runs (``Pins.held``).

    One pass at a time on a node, and no commit during a pass (the store's ``CommitLock``): a
    plan guards the newest step it sees whole, and a pass interleaved with another, or with the
    commit that makes a newer step whole, could retire the step that is then the newest whole
    one.
    """
    owners = list(owners)
    with store.commits.retiring(), (pins or Pins()).held() as pinned:
        plan = plan_retention(store.inventory.all(), owners, keep, {*protected, *pinned},
                              store.orphans(), node_owners=node_owners,
                              pooled=store.pool.owners() if node_owners is not None else ())
        pause_point("retention_planned")  # tests: another pass or a replica comes in now
        return retire(store, plan)


def retire(store: LocalStore, plan: RetentionPlan) -> list[int]:
    """Carry ``plan`` out on ``store`` (under its ``CommitLock``, see ``apply_retention``);
    returns the steps some of whose shards went."""
    for step, rank in plan.shards:
        store.shards.retire(step, rank)  # uncommits it, and pools its buffer
        log.debug("retired step %d rank %d", step, rank)
    for step in plan.bare_metadata:
        store.shards.remove_step_if_empty(step)
    for step, path in plan.set_aside:
        log.info("removing step %d set aside at an earlier resume: step %s is complete",
                 step, plan.newest_complete)
        store.remove_orphan(path)
    for owner in plan.pooled:  # after the shards: a stray's buffer went to the pool just now
        if store.pool.drop(owner):
            log.debug("deleted the recycled buffers of rank %d: no rank of this node keeps its "
                      "shards", owner)
    return plan.steps


# ---------------------------------------------------------------------------- the policy

class Retention:
    """A CheckpointManager's retention, over this rank's own shards and, once replication
    runs, the replicas this node keeps for its partners: keep ``keep`` complete steps per
    owner, never a pinned step, never the newest step replicated everywhere until a newer one
    is, never the step being replicated now (so its shards are here when the partner's
    replicas of it arrive), and never the newest step held whole here (``plan_retention``).

    ``node_owners``: every owner rank some rank of this node answers for (the node's ranks,
    and with replication the ranks of the nodes it keeps replicas of); the shards and buffers
    of any other owner, which an earlier world size or pairing left here, go with their steps.
    None: not known, and then only this rank's owners lose shards.
    """

    def __init__(self, store: LocalStore, rank: int, keep: int, pins: Pins,
                 node_owners: Iterable[int] | None = None):
        self.store, self.keep, self.pins = store, keep, pins
        self.replicas: Protection | None = None  # set once replication runs
        self.node_owners = _frozen(node_owners)
        self.owners = [rank]  # whose shards ``apply`` retires

    def protect_replicas(self, replicas: Protection, partners: Iterable[int],
                         node_owners: Iterable[int] | None = None) -> None:
        """Replication started: keep the newest step replicated everywhere, and retire the
        replicas of ``partners`` too. ``node_owners`` as in the constructor, now with the
        replicas the node's ranks keep (None: not known)."""
        self.replicas = replicas
        self.owners = [self.owners[0], *partners]
        self.node_owners = _frozen(node_owners)

    def protected(self, *, ask: bool = True) -> set[int]:
        """Steps retention must keep besides the pinned ones (which each pass reads itself,
        ``apply_retention``). ``ask=False`` uses the last known protected step rather
        than asking the job-wide counters (a listener thread). That value may be stale, i.e.
        older: it then guards an older step and leaves the newest protected one to the
        next plan that asks; the newest whole step is guarded by every plan regardless."""
        if self.replicas is None:
            return set()
        newest = self.replicas.newest_protected(ask=ask)
        return {s for s in (newest, self.replicas.round_step()) if s is not None}

    def apply(self) -> list[int]:
        """Retire this rank's shards and the replicas it keeps beyond ``keep`` (and what no
        rank of the node keeps); returns the steps retired."""
        return apply_retention(self.store, self.owners, self.keep, self.protected(),
                               pins=self.pins, node_owners=self.node_owners)

    def apply_received(self, owner: int) -> list[int]:
        """A replica of ``owner`` arrived (a listener thread: uses the last known protected
        step rather than asking the c10d store; a stale value only keeps more)."""
        return apply_retention(self.store, [owner], self.keep, self.protected(ask=False),
                               pins=self.pins, node_owners=self.node_owners)


def _frozen(owners: Iterable[int] | None) -> frozenset[int] | None:
    return None if owners is None else frozenset(owners)
