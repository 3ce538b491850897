"""manager/retention.py: the pure plan (which shards of which owners go), the pass that carries it out
on a real store, the policy a manager holds, and what a node keeps after its world size
changed: the shards of ranks no rank of the node keeps go with their step, and so do their
recycled buffers. (The whole-step invariant has its own spec: tests/store/test_whole_step.py.)"""

from __future__ import annotations

import os

import pytest
from helpers import begin, payload, pool_files, put_shard, put_step
from hypothesis import given, settings
from hypothesis import strategies as hst

from mlcheckpoint.manager.retention import (
    Retention,
    apply_retention,
    finished_steps,
    plan_retention,
)
from mlcheckpoint.store import layout
from mlcheckpoint.store.inventory import StepState
from mlcheckpoint.store.pins import Pins
from mlcheckpoint.waiting import deadline_in, wait_until

JOB = "job-retention"


# ---------------------------------------------------------------- the plan, one owner

def state(step: int, ranks=(0,), *, metadata: bool = True, save: str = "s") -> StepState:
    st = StepState(step, committed_ranks=set(ranks), shard_saves={r: save for r in ranks})
    if metadata:
        st.has_metadata = True
        st.required_ranks, st.save_id = tuple(ranks), "s"
    return st


def test_plan_keeps_newest_complete_and_what_is_newer_or_protected():
    inv = {1: state(1), 2: state(2), 3: state(3), 4: state(4), 5: state(5, metadata=False)}
    plan = plan_retention(inv, [0], keep=2, protected={1})
    assert plan.shards == ((2, 0),)  # 1 protected, 3-4 kept, 5 in flight (no metadata yet)
    assert plan.steps == [2]
    assert plan_retention(inv, [0], keep=2).steps == [1, 2]


def test_plan_counts_only_shards_of_the_save_the_metadata_names():
    inv = {1: state(1), 2: state(2, save="other"), 3: state(3)}
    # step 2's shard is of another save: not complete for rank 0, so keep=2 keeps 1 and 3
    assert plan_retention(inv, [0], keep=2).shards == ()
    assert plan_retention(inv, [0], keep=1).shards == ((1, 0), (2, 0))


def test_plan_drops_bare_metadata_and_set_aside_steps_past_a_complete_one():
    inv = {1: state(1, ranks=()), 2: state(2), 3: state(3)}
    plan = plan_retention(inv, [0], keep=1, set_aside=[(0, "/o/0"), (5, "/o/5")])
    assert plan.bare_metadata == (1, 2)  # 1 has only its metadata; 2 once its shard goes
    assert plan.set_aside == ((0, "/o/0"),)  # step 5 is newer than the newest complete (3)
    assert plan.newest_complete == 3


def test_an_older_step_whose_metadata_never_came_goes_once_keep_steps_are_complete():
    """A node holds its own shards of steps 1-3 but step 1's metadata never reached it (rank 0
    named a newer save in its replication round): with keep=2 and steps 2 and 3 complete,
    step 1's shards go at once, not only after a third complete step (they stayed to the end
    of a job: tests/jobs/test_native_route.py failed under load on them)."""
    inv = {1: state(1, metadata=False), 2: state(2), 3: state(3), 4: state(4, metadata=False)}
    plan = plan_retention(inv, [0], keep=2)
    assert plan.shards == ((1, 0),)  # 4 is newer: a save in flight
    assert plan_retention({1: state(1, metadata=False), 2: state(2)}, [0], keep=2).shards == ()
    # a stray owner's shard (a former partner's replica) likewise, once keep steps are finished
    inv = {1: state(1, ranks=(0, 7), metadata=False), 2: state(2), 3: state(3)}
    assert plan_retention(inv, [0], keep=2, node_owners=[0]).shards == ((1, 0), (1, 7))


def test_plan_refuses_keep_below_one():
    with pytest.raises(ValueError):
        plan_retention({}, [0], keep=0)


@settings(max_examples=200, deadline=None)
@given(steps=hst.dictionaries(hst.integers(0, 30), hst.tuples(hst.booleans(), hst.booleans()),
                              max_size=12),
       keep=hst.integers(1, 4), protected=hst.sets(hst.integers(0, 30), max_size=3))
def test_plan_never_retires_protected_or_the_newest_complete_steps(steps, keep, protected):
    inv = {s: state(s, ranks=(0,) if held else (), metadata=meta)
           for s, (held, meta) in steps.items()}
    plan = plan_retention(inv, [0], keep=keep, protected=protected)
    retired = {s for s, _ in plan.shards}
    complete = sorted(s for s, st in inv.items() if st.complete)
    assert not retired & protected
    assert not retired & set(complete[-keep:])
    assert all(s < complete[-keep] for s in retired)  # nothing newer than the oldest kept
    assert all(0 in inv[s].committed_ranks for s in retired)


def test_store_retention_carries_out_the_plan(store):
    for s in (1, 2, 3):
        put_step(store, s)
    plan = plan_retention(store.inventory.all(), [0], keep=1)
    assert apply_retention(store, [0], keep=1) == plan.steps == [1, 2]
    assert store.inventory.complete_steps() == [3]


class Replicas:
    """Stands in for the replicator's view of job-wide protection (a plain value here)."""

    def __init__(self, newest: int | None, known: int | None, round_step: int | None = None):
        self.newest, self.known, self.asked = newest, known, 0
        self.round = round_step

    def newest_protected(self, ask: bool = True) -> int | None:
        if not ask:
            return self.known
        self.asked += 1
        return self.newest

    def round_step(self) -> int | None:
        return self.round


def test_policy_keeps_pinned_and_newest_protected_steps(store):
    for s in range(1, 6):
        put_step(store, s)
    pins = Pins()
    pins.pin(1)
    replicas = Replicas(newest=2, known=3)
    retention = Retention(store, 0, keep=1, pins=pins)
    retention.protect_replicas(replicas, [])
    assert retention.protected() == {2} and replicas.asked == 1  # (pins: each pass reads them)
    # A listener thread does not ask the job-wide counters: the last known step instead.
    assert retention.protected(ask=False) == {3} and replicas.asked == 1
    assert retention.apply_received(0) == [2, 4]  # 1 pinned, 3 known protected, 5 newest
    assert store.inventory.complete_steps() == [1, 3, 5]
    assert Retention(store, 0, keep=1, pins=Pins()).apply() == [1, 3]


# ---------------------------------------------------------------- a pass on a real store

def test_retention_keeps_newest_complete_steps_and_pools_buffers(store):
    inodes = {}
    for s in range(1, 6):
        put_step(store, s)
        inodes[s] = os.stat(store.paths.data(s, 0)).st_ino
    retired = apply_retention(store, [0], keep=2)
    assert retired == [1, 2, 3]
    assert store.inventory.steps() == [4, 5]
    assert store.inventory.complete_steps() == [4, 5]
    for s in (4, 5):
        store.verify_shard(s, 0)
    pooled = pool_files(store)
    assert 1 <= len(pooled) <= 2  # a bounded number of buffers per rank
    pooled_inodes = {os.stat(p).st_ino for p in pooled}
    assert pooled_inodes <= {inodes[1], inodes[2], inodes[3]}
    assert apply_retention(store, [0], keep=2) == []  # idempotent


def test_retention_never_touches_in_flight_or_protected_steps(store):
    for s in (1, 2, 3, 4):
        put_step(store, s)
    put_shard(store, 5, 0)  # shard committed, metadata not yet: a save in flight
    begin(store, 6, 0, payload(6, 0))  # still being written
    retired = apply_retention(store, [0], keep=2, protected=[1])
    assert retired == [2]
    assert store.inventory.complete_steps() == [1, 3, 4]
    assert store.inventory.all()[5].committed_ranks == {0}
    assert os.path.exists(store.paths.data(6, 0) + layout.INFLIGHT)
    store.verify_shard(1, 0)
    store.verify_shard(5, 0)


def test_retention_between_protected_steps(store):
    for s in (1, 2, 3, 4):
        put_step(store, s)
    assert apply_retention(store, [0], keep=1, protected={2}) == [1, 3]
    assert store.inventory.complete_steps() == [2, 4]


def test_retention_is_per_rank(store):
    for s in (1, 2, 3):
        put_step(store, s, ranks=(0, 1))
    assert apply_retention(store, [0], keep=1) == [1, 2]
    inv = store.inventory.all()
    assert inv[1].committed_ranks == {1} and inv[2].committed_ranks == {1}
    store.verify_shard(1, 1)
    assert store.inventory.complete_steps() == [3]
    assert apply_retention(store, [0, 1], keep=1) == [1, 2]
    assert store.inventory.steps() == [3]


def test_retention_rejects_keep_zero(store):
    put_step(store, 1)
    with pytest.raises(ValueError):
        apply_retention(store, [0], keep=0)
    assert store.inventory.complete_steps() == [1]


# ---------------------------------------------------------------- owners no rank here keeps

def saved(step: int, held, world: int, *, save: str = "s", metadata: bool = True) -> StepState:
    """This node's view of ``step``, saved by a job of ``world`` ranks: the shards of ``held``
    (of save ``save``) and, with ``metadata``, the step's metadata (of save "s")."""
    st = StepState(step, committed_ranks=set(held), shard_saves={r: save for r in held})
    if metadata:
        st.has_metadata, st.required_ranks, st.save_id = True, tuple(range(world)), "s"
    return st


def carry_out(inv: dict[int, StepState], plan) -> None:
    """What ``retire`` does to the files, done to the model."""
    for step, rank in plan.shards:
        inv[step].committed_ranks.discard(rank)
        inv[step].shard_saves.pop(rank, None)
    for step in {s for s, _ in plan.shards} | set(plan.bare_metadata):
        if step in inv and not inv[step].committed_ranks:
            del inv[step]


def resized_node() -> dict[int, StepState]:
    """Node 0 after 2 x 2 -> 1 x 2: steps 1 and 2 of the 2 x 2 job (its ranks 0, 1 and the
    replicas of node 1's ranks 2, 3), steps 3 to 5 of the 1 x 2 job."""
    return {1: saved(1, (0, 1, 2, 3), 4), 2: saved(2, (0, 1, 2, 3), 4),
            3: saved(3, (0, 1), 2), 4: saved(4, (0, 1), 2), 5: saved(5, (0, 1), 2)}


def test_shards_of_ranks_the_world_no_longer_has_go_with_the_last_live_shard_of_their_step():
    """Ranks 2 and 3 have no rank here to retire their shards. Rank 0's pass retires its own
    and leaves them (rank 1's shard of steps 1, 2 is still kept); rank 1's pass retires the
    rest of steps 1 to 3, its metadata included, and the recycled buffers of ranks 2, 3."""
    inv = resized_node()
    plan = plan_retention(inv, [0], keep=2, node_owners={0, 1}, pooled={0, 2})
    assert plan.shards == ((1, 0), (2, 0), (3, 0))
    assert plan.pooled == (2,)
    carry_out(inv, plan)
    plan = plan_retention(inv, [1], keep=2, node_owners={0, 1}, pooled={0, 1})
    assert plan.shards == ((1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3), (3, 1))
    assert set(plan.bare_metadata) == {1, 2, 3}  # nothing left of them: their metadata goes
    assert plan.pooled == (2, 3)  # the buffers their shards leave in the pool, too
    carry_out(inv, plan)
    assert sorted(inv) == [4, 5]


def test_the_plan_without_the_nodes_owners_retires_only_its_own():
    """``node_owners`` unknown: the shards of ranks 2, 3 stay (what every pass did before)."""
    inv = resized_node()
    for owners in ([0], [1]):
        carry_out(inv, plan_retention(inv, owners, keep=2))
    assert sorted(inv) == [1, 2, 4, 5] and inv[1].committed_ranks == {2, 3}
    assert plan_retention(inv, [0], keep=2, pooled={3}).pooled == ()


def test_a_stray_shard_stays_in_a_protected_a_whole_or_a_newer_step():
    """Step 1 (only ranks 2, 3 here) is protected, step 2 is the newest whole step here (the
    1 x 2 job's steps lack rank 1's shard: still arriving), step 6 is newer than the kept ones
    (a save in flight that holds a stray, e.g. a replica fetched for a resume)."""
    inv = {1: saved(1, (2, 3), 4), 2: saved(2, (0, 1, 2, 3), 4), 3: saved(3, (0,), 2),
           4: saved(4, (0,), 2), 5: saved(5, (0,), 2), 6: saved(6, (0, 3), 2, metadata=False)}
    plan = plan_retention(inv, [0], keep=2, protected={1}, node_owners={0, 1})
    assert plan.newest_complete == 2
    assert plan.shards == ((3, 0),)
    # unprotected, step 1 goes whole
    plan = plan_retention(inv, [0], keep=2, node_owners={0, 1})
    assert plan.shards == ((1, 2), (1, 3), (3, 0)) and plan.bare_metadata == (1, 3)


def test_gc_keeps_the_newest_complete_steps_and_never_the_one_being_written():
    """``owners=()``, ``node_owners=()`` (``mlcheckpoint gc --keep``): every shard of a step
    older than the newest ``keep`` finished steps goes, whoever owns it; a step without
    metadata (being written) or whose shards here are of another save than its metadata (a
    step saved again, being written) counts as none, and it and anything newer stay."""
    inv = resized_node()
    inv[6] = saved(6, (0,), 2, metadata=False)  # being written
    inv[7] = saved(7, (0, 1), 2, save="again")  # saved again under its number, being written
    assert finished_steps(inv) == [1, 2, 3, 4, 5]
    plan = plan_retention(inv, (), keep=1, node_owners=(), pooled={0, 1, 2})
    # 5 is kept (the newest complete step, and whole here); 1 to 4 go, every owner's shards
    assert set(plan.shards) == {(s, r) for s in (1, 2, 3, 4) for r in inv[s].committed_ranks}
    assert plan.pooled == (0, 1, 2, 3)  # gc frees what it retires, and empties the pool
    carry_out(inv, plan)
    assert sorted(inv) == [5, 6, 7]
    assert plan_retention(inv, (), keep=1, node_owners=()).shards == ()  # idempotent


LIVE, STRAYS = (0, 1), (2, 3)


@settings(max_examples=200, deadline=None)
@given(steps=hst.dictionaries(
    hst.integers(0, 20),
    hst.tuples(hst.sets(hst.sampled_from(LIVE + STRAYS)), hst.booleans(), hst.sampled_from([2, 4]),
               hst.booleans()),
    max_size=10),
    keep=hst.integers(1, 3), protected=hst.sets(hst.integers(0, 20), max_size=2),
    order=hst.permutations(LIVE))
def test_plan_with_strays_keeps_what_it_must_and_leaves_no_stray_behind_a_retired_step(
        steps, keep, protected, order):
    """Any holdings of live owners (0, 1) and owners no rank here keeps (2, 3), with or without
    metadata, of either world size, shards of the metadata's save or not; a pass of each live
    owner in either order. Never touched: a protected step, the newest whole step, a step newer
    than the newest ``keep`` finished ones. After both passes, a stray is left in an older
    unguarded step only beside a live shard its owner keeps."""
    inv = {s: saved(s, held, world, metadata=meta, save="s" if same else "x")
           for s, (held, meta, world, same) in steps.items()}
    before = {s: set(st.committed_ranks) for s, st in inv.items()}
    finished = finished_steps(inv)
    newest_whole = max((s for s, st in inv.items() if st.complete), default=None)
    untouchable = set(protected) | {newest_whole} | (set(finished[-keep:]) if finished else set())
    untouchable |= {s for s in inv if finished and s > finished[-1]}
    for owner in order:
        plan = plan_retention(inv, [owner], keep, protected, node_owners=LIVE, pooled=STRAYS)
        assert not {s for s, _ in plan.shards} & untouchable, plan
        assert all(r in (owner, *STRAYS) for _, r in plan.shards), plan
        assert set(plan.pooled) == set(STRAYS)
        carry_out(inv, plan)
    for s, held in before.items():
        if s in untouchable or len(finished) < keep or s >= finished[-keep]:
            assert s in inv and inv[s].committed_ranks == held, s
        elif s in inv and inv[s].committed_ranks & set(STRAYS):
            assert inv[s].committed_ranks & set(LIVE), (s, inv[s].committed_ranks)


def test_a_pass_on_a_real_store_leaves_nothing_of_a_stray_step_and_empties_its_buffers(store):
    """Node 0 after 2 x 2 -> 1 x 2, on real files: the pass of each rank of the 1 x 2 job, as
    its manager's ``Retention`` runs it. Steps 1 and 2 go whole, metadata and all, and the pool
    holds no buffer of ranks 2, 3 (sized for the old shards)."""
    for step in (0, 1, 2):
        put_step(store, step, ranks=(0, 1, 2, 3))
    store.shards.retire(0, 3)  # the 2 x 2 job's retention pooled a buffer of rank 3
    for rank in (0, 1, 2):
        store.shards.retire(0, rank)
    assert store.pool.owners() == {0, 1, 2, 3}
    for step in (3, 4, 5):
        put_step(store, step, ranks=(0, 1))
    retentions = [Retention(store, rank, keep=2, pins=Pins(), node_owners=(0, 1)) for rank in (0, 1)]
    assert retentions[0].apply() == [1, 2, 3]
    # rank 1's shards of 1 to 3 are its own pass's to retire, and ranks 2, 3's go with them
    assert [sorted(store.inventory.step_state(s).committed_ranks) for s in (1, 2, 3)] == [[1, 2, 3]] * 2 + [[1]]
    assert retentions[1].apply() == [1, 2, 3]
    assert store.inventory.steps() == [4, 5]
    assert not os.path.exists(store.paths.step_dir(1)) and not os.path.exists(store.paths.step_dir(2))
    assert store.pool.owners() <= {0, 1}, pool_files(store)
    assert store.inventory.complete_steps() == [4, 5]


def test_replication_adds_the_partners_to_the_nodes_owners(store):
    """A rank whose node keeps the replicas of ranks 2, 3: their shards are live, retired per
    owner by the rank that keeps them, not as strays."""
    for step in (1, 2, 3):
        put_step(store, step, ranks=(0, 1, 2, 3))
    retention = Retention(store, 0, keep=2, pins=Pins(), node_owners=(0, 1))
    retention.protect_replicas(Replicas(newest=None, known=None), [2], node_owners=(0, 1, 2, 3))
    assert retention.node_owners == {0, 1, 2, 3}
    assert retention.apply() == [1]
    assert store.inventory.step_state(1).committed_ranks == {1, 3}


def test_a_step_pinned_while_a_pass_runs_is_never_retired_under_its_reader(store, monkeypatch, tmp_path):
    """A reader pins a step, then opens its shard (a push, a served read). A pass that planned
    before the pin must not retire the step after the reader opened it: the pass reads the
    pins and retires with no pin taken meanwhile, so the reader either pins first (the step
    stays) or finds the shard gone when it opens it (and promises a peer nothing)."""
    import threading

    from mlcheckpoint.errors import ShardNotFoundError

    for s in (1, 2, 3):
        put_step(store, s)
    pins = Pins()
    release = tmp_path / "release"
    monkeypatch.setenv("MLCHECKPOINT_PAUSE_AT", f"retention_planned={release}")
    retention = Retention(store, 0, keep=1, pins=pins)
    a_pass = threading.Thread(target=retention.apply)
    a_pass.start()
    assert wait_until(lambda: os.path.exists(f"{release}.reached"), deadline_in(30), 0.01)
    opened: list[str] = []

    def reader() -> None:
        pins.pin(1)
        try:
            store.shards.read_manifest(1, 0)
            opened.append("read")
        except ShardNotFoundError:
            opened.append("gone")

    a_reader = threading.Thread(target=reader)
    a_reader.start()
    a_reader.join(timeout=0.5)  # without the fix it pins and reads now, mid-pass
    release.touch()
    for t in (a_pass, a_reader):
        t.join(timeout=30)
        assert not t.is_alive()
    # The pass had planned step 1 away; the reader waited for it and found the shard gone.
    # (Before, it read the manifest mid-pass and then lost the shard it was sending.)
    assert opened == ["gone"] and 1 not in store.inventory.steps(), (opened, store.inventory.steps())
    pins.unpin(1)
