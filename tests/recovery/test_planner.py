"""The recovery planner (``plan_resume``): a pure function, tested without processes.

Deterministic cases pin down each rule; hypothesis then checks the rules together against an
independent model of "which step is usable and what must move where", over random clusters
(lost nodes, partial holdings, bad copies, failed steps, a persistent step, replication off,
copies of items that data parallelism kept in other ranks' shards).
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
from helpers import held_step, restate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlcheckpoint.recovery import Decision, Fetch, NodeInventory, plan_resume
from mlcheckpoint.recovery.planner import (
    FRESH,
    MEMORY,
    PERSISTENT,
    PersistentStep,
    step_verdicts,
)
from mlcheckpoint.store.inventory import StepState
from mlcheckpoint.topology import Topology


# ---------------------------------------------------------------------------- builders
def copy(owners, meta=True, required=None, world_size=None, nbytes=100, sizes=None) -> StepState:
    """What one node holds of one step. ``sizes`` overrides ``nbytes`` per owner."""
    owners = sorted(set(owners))
    sizes = sizes or {}
    return held_step(owners, has_metadata=meta, required=required, world_size=world_size,
                     shard_bytes={o: sizes.get(o, nbytes) for o in owners})


def inventories(nnodes: int, rpn: int, holdings: dict[int, dict[int, StepState]]) -> list[NodeInventory]:
    """``nnodes`` nodes of ``rpn`` ranks; ``holdings[node][step]`` is what survived there."""
    return [NodeInventory(n, list(range(n * rpn, (n + 1) * rpn)), dict(holdings.get(n, {})))
            for n in range(nnodes)]


def paired(nnodes: int, rpn: int, steps, *, lost=(), world=None, nbytes=100) -> list[NodeInventory]:
    """Every step saved by ``nnodes`` x ``rpn`` ranks and replicated to the buddy node (i^1),
    metadata everywhere; ``lost`` nodes came back empty (replacement machines)."""
    world = world or nnodes * rpn
    req = tuple(range(world))
    holdings = {}
    for n in range(nnodes):
        if n in lost:
            continue
        buddy = n ^ 1 if (n ^ 1) < nnodes else n
        owners = set(range(n * rpn, (n + 1) * rpn)) | set(range(buddy * rpn, (buddy + 1) * rpn))
        holdings[n] = {s: copy(owners, required=req, world_size=world, nbytes=nbytes) for s in steps}
    return inventories(nnodes, rpn, holdings)


def peers(d: Decision) -> list[int]:
    """Ranks whose own shard is whole only on other nodes: read from there, rebuilt after."""
    return sorted(r for r, source in d.sources.items() if source == "peer")


def rebuilt_from(d: Decision, rpn: int) -> dict[int, set[int]]:
    """Per rank of ``peers(d)``, the other nodes holding its shard whole: where its rebuild's
    item reads may go (recovery/holders.py ``Holders.rebuild``, dealt by ``remote.deal``)."""
    topo = Topology(local_world_size=rpn)  # (it asks only which node a rank is on)
    return {owner: {topo.node_of(r) for r in d.holders.get(owner, ())}
            - set(d.partial.get(owner, {})) - {topo.node_of(owner)} for owner in peers(d)}


def mentions_step(reason: str, step: int) -> bool:
    return re.search(rf"\bstep {step}\b", reason) is not None


# ---------------------------------------------------------------------------- the basics
def test_all_intact_resumes_newest_locally():
    nodes = paired(2, 1, [1, 2, 3])
    d = plan_resume(nodes, None, 2)
    assert (d.kind, d.step) == (MEMORY, 3)
    assert d.fetches == []
    assert d.sources == {0: "local", 1: "local"}
    assert not d.resharded
    assert d.holders == {0: [0, 1], 1: [0, 1]}
    assert d.metadata_holders == [0, 1]
    assert d.newest_protected == 3
    assert d.reason == ""


def test_nothing_anywhere_is_fresh():
    d = plan_resume(inventories(3, 2, {}), None, 6)
    assert (d.kind, d.step, d.fetches) == (FRESH, None, [])
    assert "no checkpoint" in d.reason
    assert d.newest_protected is None


def test_nothing_in_memory_uses_persistent():
    d = plan_resume(inventories(2, 1, {}), 7, 2)
    assert (d.kind, d.step, d.fetches) == (PERSISTENT, 7, [])


def test_replaced_node_fetches_its_metadata_and_reads_its_shard_from_its_buddy():
    nodes = paired(2, 1, [4, 5], lost=[1])
    d = plan_resume(nodes, None, 2)
    assert (d.kind, d.step) == (MEMORY, 5)
    # The metadata is fetched on the plan's word; the shard is not: the plan says who holds
    # it, and the reads (and the rebuild) are dealt over those holders where they are made.
    assert d.fetches == [Fetch(dst_rank=1, src_rank=0, step=5)]
    assert d.sources == {0: "local", 1: "peer"}
    assert d.holders == {0: [0], 1: [0]}
    assert d.metadata_holders == [0]
    assert d.newest_protected is None  # nothing is on two nodes any more


def test_persistent_newer_than_memory_wins_and_says_why():
    nodes = paired(2, 1, [2, 3])
    d = plan_resume(nodes, 4, 2)
    assert (d.kind, d.step, d.fetches) == (PERSISTENT, 4, [])
    assert "persistent step 4" in d.reason and mentions_step(d.reason, 3), d.reason


def test_memory_wins_over_equal_or_older_persistent():
    nodes = paired(2, 1, [2, 3])
    for persistent in (0, 2, 3):
        d = plan_resume(nodes, persistent, 2)
        assert (d.kind, d.step) == (MEMORY, 3), (persistent, d)


def test_incomplete_newest_step_falls_back_to_older_with_reason():
    # Step 6: rank 1's shard was never committed anywhere (the node died mid-save).
    nodes = paired(2, 1, [4, 5])
    for inv in nodes:
        inv.steps[6] = copy({0}, required=(0, 1), world_size=2)
    d = plan_resume(nodes, None, 2)
    assert (d.kind, d.step) == (MEMORY, 5)
    assert mentions_step(d.reason, 6) and "1" in d.reason and "surviving" in d.reason, d.reason


def test_step_without_metadata_is_refused():
    # Every shard of step 6 is there, but the metadata was never written (coordinator died).
    nodes = paired(2, 1, [5])
    for inv in nodes:
        inv.steps[6] = copy({0, 1}, meta=False)
    d = plan_resume(nodes, None, 2)
    assert (d.kind, d.step) == (MEMORY, 5)
    assert mentions_step(d.reason, 6) and "metadata" in d.reason, d.reason


def test_ranks_outside_required_need_no_shard():
    # Rank 1 wrote nothing at step 3 (e.g. everything it held was de-duplicated to rank 0).
    nodes = inventories(2, 1, {0: {3: copy({0}, required=(0,), world_size=2)}, 1: {}})
    d = plan_resume(nodes, None, 2)
    assert (d.kind, d.step) == (MEMORY, 3)
    assert peers(d) == []
    assert [(f.dst_rank, f.src_rank) for f in d.fetches] == [(1, 0)]
    assert d.sources == {0: "local", 1: "local"}


# ---------------------------------------------------------------------------- bad copies
def test_bad_local_copy_is_replaced_from_the_replica():
    nodes = paired(2, 1, [2, 3])
    d = plan_resume(nodes, None, 2, bad_copies=[(3, 0, 0)])
    assert (d.kind, d.step) == (MEMORY, 3)
    assert d.fetches == []
    assert d.sources == {0: "peer", 1: "local"}
    assert d.holders[0] == [1]  # the bad copy serves nobody
    assert d.newest_protected == 2  # step 3 has one good copy of rank 0's shard left


def test_bad_copies_on_both_nodes_fall_back_to_previous_step():
    nodes = paired(2, 1, [2, 3])
    d = plan_resume(nodes, None, 2, bad_copies=[(3, 0, 0), (3, 0, 1)])
    assert (d.kind, d.step, d.fetches) == (MEMORY, 2, [])
    assert mentions_step(d.reason, 3), d.reason


def test_bad_metadata_copy_is_fetched_again():
    nodes = paired(2, 1, [3])
    d = plan_resume(nodes, None, 2, bad_copies=[(3, None, 1)])
    assert (d.kind, d.step) == (MEMORY, 3)
    assert d.fetches == [Fetch(1, 0, 3)]
    assert d.metadata_holders == [0]


def test_step_that_failed_to_load_is_skipped():
    nodes = paired(2, 1, [2, 3])
    d = plan_resume(nodes, 1, 2, bad_steps=[3])
    assert (d.kind, d.step) == (MEMORY, 2)
    assert mentions_step(d.reason, 3) and "failed" in d.reason, d.reason
    d = plan_resume(nodes, 1, 2, bad_steps=[2, 3])
    assert (d.kind, d.step) == (PERSISTENT, 1)
    assert mentions_step(d.reason, 3) and mentions_step(d.reason, 2), d.reason


def test_node_without_ranks_serves_nothing():
    # Node 1's machine is not part of the job any more: what its dir holds is unreachable.
    nodes = paired(2, 1, [3])
    nodes[1].ranks = []
    nodes[0].steps[3] = copy({0}, required=(0, 1), world_size=2)
    d = plan_resume(nodes, None, 2)
    assert d.kind == FRESH, d
    assert mentions_step(d.reason, 3), d.reason


# ---------------------------------------------------------------------------- replication off
def test_without_transport_a_step_needing_fetches_is_refused():
    nodes = paired(2, 1, [3], lost=[1])
    d = plan_resume(nodes, None, 2, can_fetch=False)
    assert d.kind == FRESH and d.fetches == []
    assert mentions_step(d.reason, 3) and "replication is off" in d.reason, d.reason
    d = plan_resume(nodes, 1, 2, can_fetch=False)
    assert (d.kind, d.step, d.fetches) == (PERSISTENT, 1, [])


def test_without_transport_an_older_fully_local_step_is_used():
    nodes = paired(2, 1, [2])
    nodes[0].steps[3] = copy({0, 1}, required=(0, 1), world_size=2)
    nodes[1].steps[3] = copy({0}, required=(0, 1), world_size=2)  # its own shard is missing
    assert plan_resume(nodes, None, 2).step == 3  # with a transport: fetch and use step 3
    d = plan_resume(nodes, None, 2, can_fetch=False)
    assert (d.kind, d.step, d.fetches) == (MEMORY, 2, [])
    assert mentions_step(d.reason, 3), d.reason


def test_single_node_without_transport():
    nodes = inventories(1, 2, {0: {7: copy({0, 1}, required=(0, 1), world_size=2)}})
    d = plan_resume(nodes, None, 2, can_fetch=False)
    assert (d.kind, d.step, d.fetches) == (MEMORY, 7, [])
    assert d.sources == {0: "local", 1: "local"}


# ---------------------------------------------------------------------------- rebuilds
# The plan names no source for a shard: a replaced node's rank rebuilds its shard from its
# items' places, dealt over every node the plan says holds them (recovery/holders.py).
def test_two_replacement_nodes_rebuild_from_every_holder():
    # 4 nodes x 1 rank; nodes 0 and 1 are replacements. Nodes 2 and 3 each hold every shard.
    full = copy(range(4), required=range(4), world_size=4)
    nodes = inventories(4, 1, {2: {9: full}, 3: {9: full}})
    d = plan_resume(nodes, None, 4)
    assert (d.kind, d.step) == (MEMORY, 9)
    assert peers(d) == [0, 1]
    assert d.holders[0] == d.holders[1] == [2, 3]
    assert rebuilt_from(d, 1) == {0: {2, 3}, 1: {2, 3}}
    assert len(d.fetches) == 2


def test_one_node_replaced_every_rank_of_it_reads_from_its_buddy():
    # 2 nodes x 2 ranks, node 1 replaced: ranks 2 and 3 read and rebuild from node 0.
    nodes = paired(2, 2, [5], lost=[1])
    d = plan_resume(nodes, None, 4)
    assert d.sources == {0: "local", 1: "local", 2: "peer", 3: "peer"}
    assert d.holders[2] == d.holders[3] == [0, 1]
    assert rebuilt_from(d, 2) == {2: {0}, 3: {0}}
    # One metadata fetch per node lacking it, by one of that node's ranks.
    assert [(f.dst_rank in (2, 3), f.src_rank in (0, 1)) for f in d.fetches] == [(True, True)]


def test_many_replacements_rebuild_from_all_holders():
    # 8 nodes x 1 rank: nodes 0..3 replaced; nodes 4..7 each hold all 8 shards.
    full = copy(range(8), required=range(8), world_size=8)
    nodes = inventories(8, 1, {n: {2: full} for n in range(4, 8)})
    d = plan_resume(nodes, None, 8)
    assert rebuilt_from(d, 1) == {r: {4, 5, 6, 7} for r in range(4)}
    # the metadata fetches too, one per holder
    assert sorted(f.src_rank for f in d.fetches) == [4, 5, 6, 7]


# ---------------------------------------------------------------------------- resharding
def test_other_world_size_reshards_without_rebuilds():
    # Saved by 4 ranks (one per node); resumed by 2 nodes x 1 rank that hold the shards
    # between them. DCP decides which bytes each rank reads; the reader fetches lazily.
    req = range(4)
    nodes = inventories(2, 1, {0: {3: copy({0, 1}, required=req, world_size=4)},
                           1: {3: copy({2, 3}, meta=False)}})
    d = plan_resume(nodes, None, 2)
    assert (d.kind, d.step, d.resharded) == (MEMORY, 3, True)
    assert peers(d) == []
    assert d.fetches == [Fetch(1, 0, 3)]
    assert d.holders == {0: [0], 1: [0], 2: [1], 3: [1]}
    assert d.sources == {0: "local", 1: "local"}


def test_other_world_size_with_missing_shards_falls_back():
    req = range(4)
    nodes = inventories(2, 1, {0: {3: copy({0, 1}, required=req, world_size=4)},
                           1: {3: copy({0, 1}, required=req, world_size=4)}})
    d = plan_resume(nodes, 2, 2)
    assert (d.kind, d.step) == (PERSISTENT, 2)
    assert mentions_step(d.reason, 3) and "2, 3" in d.reason, d.reason
    d = plan_resume(nodes, None, 2)
    assert (d.kind, d.step) == (FRESH, None)
    assert mentions_step(d.reason, 3), d.reason


def test_growing_world_size_reads_from_old_holders():
    # Saved by 2 nodes x 1, resumed on 4 nodes; nodes 2 and 3 are new.
    nodes = paired(2, 1, [8]) + [NodeInventory(2, [2]), NodeInventory(3, [3])]
    d = plan_resume(nodes, None, 4)
    assert (d.kind, d.step, d.resharded) == (MEMORY, 8, True)
    assert peers(d) == []
    assert sorted(f.dst_rank for f in d.fetches) == [2, 3]
    assert {f.src_rank for f in d.fetches} <= {0, 1}


# ---------------------------------------------------------------------------- scale
def test_sixteen_thousand_ranks():
    """2048 nodes x 8 ranks, buddy-replicated, 3 steps; 5 nodes replaced and, at the newest
    step, one shard missing on both copies. (Correctness only: no timing is asserted.)"""
    nnodes, rpn = 2048, 8
    world = nnodes * rpn
    lost = {3, 100, 777, 2047}  # no two of them buddies
    nodes = paired(nnodes, rpn, [10, 11], lost=lost)
    # Step 12 lacks rank 5000's shard everywhere (its node and buddy died mid-save).
    for inv in nodes:
        if inv.steps:
            owners = set(inv.steps[11].committed_ranks) - {5000}
            inv.steps[12] = copy(owners, required=range(world), world_size=world)
    d = plan_resume(nodes, None, world)
    assert (d.kind, d.step) == (MEMORY, 11)
    assert mentions_step(d.reason, 12) and "5000" in d.reason
    lost_ranks = {r for n in lost for r in range(n * rpn, (n + 1) * rpn)}
    assert peers(d) == sorted(lost_ranks)
    assert all(d.holders[r] == list(range(((r // rpn) ^ 1) * rpn, (((r // rpn) ^ 1) + 1) * rpn))
               for r in lost_ranks)
    assert sorted(f.dst_rank // rpn for f in d.fetches) == sorted(lost)
    assert len(d.sources) == world
    # The buddies of the lost nodes hold step 11 once only: not protected any more; step 10 is
    # not either (same holdings). So nothing is.
    assert d.newest_protected is None


# ---------------------------------------------------------------------------- properties
@st.composite
def scenarios(draw):
    """A healthy buddy-replicated cluster, then damage: lost nodes (empty inventories),
    copies missing here and there, stray extra copies, machines without live ranks, bad
    copies, failed steps, a persistent step, replication off."""
    nnodes = draw(st.integers(1, 8))
    rpn = draw(st.integers(1, 3))
    world = nnodes * rpn
    steps = draw(st.lists(st.integers(0, 30), unique=True, min_size=1, max_size=4))
    saved: dict[int, tuple[tuple[int, ...], int]] = {}
    groups: dict[int, dict[int, list[list[int]]]] = {}  # step -> its metadata's copy groups
    for s in steps:
        ws = world if draw(st.integers(0, 5)) else draw(st.integers(1, 12))  # mostly the same
        full = tuple(range(ws))
        req = full if draw(st.integers(0, 3)) else tuple(sorted(draw(st.sets(st.sampled_from(full), min_size=1))))
        saved[s] = (req, ws)
        # Mostly none; else data-parallel copies: some owners' items copied into other shards.
        groups[s] = {} if draw(st.integers(0, 2)) else {
            o: [sorted(g) for g in draw(st.lists(st.sets(st.sampled_from(full), max_size=2),
                                                 min_size=1, max_size=2))]
            for o in draw(st.sets(st.sampled_from(req), max_size=3))}

    def base(node: int, s: int) -> set[int]:
        """The shards that ``node``'s ranks saved of step ``s``."""
        _, ws = saved[s]
        if ws == world:
            return set(range(node * rpn, (node + 1) * rpn))
        return {o for o in range(ws) if o % nnodes == node}  # saved under another layout

    # node -> step -> [owners, has_metadata]
    hold: dict[int, dict[int, list]] = {}
    for n in range(nnodes):
        buddy = n ^ 1 if (n ^ 1) < nnodes else n
        hold[n] = {s: [base(n, s) | base(buddy, s), True] for s in steps}
    ghosts = draw(st.integers(0, 1))
    for g in range(ghosts):
        like = draw(st.integers(0, nnodes - 1))
        hold[nnodes + g] = {s: [set(o), m] for s, (o, m) in hold[like].items()}
    lost = draw(st.sets(st.integers(0, nnodes - 1), max_size=nnodes // 2))
    for n in lost:
        hold[n] = {}
    copies = sorted((n, s, o) for n in hold for s, (owners, _) in hold[n].items() for o in owners)
    copies += sorted((n, s, None) for n in hold for s, (_, meta) in hold[n].items() if meta)
    for n, s, o in draw(st.sets(st.sampled_from(copies), max_size=4)) if copies else ():
        if o is None:
            hold[n][s][1] = False
        else:
            hold[n][s][0].discard(o)
    all_owners = list(range(max([world] + [ws for _, ws in saved.values()])))
    if steps:
        for _ in range(draw(st.integers(0, 2))):  # a stray copy, e.g. an old replica
            n, s = draw(st.sampled_from(sorted(hold))), draw(st.sampled_from(steps))
            hold[n].setdefault(s, [set(), False])[0].add(draw(st.sampled_from(all_owners)))

    nodes = []
    for n in sorted(hold):
        ranks = list(range(n * rpn, (n + 1) * rpn)) if n < nnodes else []
        inv = {}
        for s, (owners, meta) in hold[n].items():
            sizes = {o: draw(st.integers(1, 1000)) for o in sorted(owners)}
            req, ws = saved[s]
            inv[s] = copy(owners, meta=meta, required=req, world_size=ws, sizes=sizes)
            if meta:
                inv[s] = with_copies(inv[s], groups[s])
        nodes.append(NodeInventory(n, ranks, inv))
    if draw(st.booleans()):
        nodes = draw(st.permutations(nodes))

    existing = [(s, o, inv.node) for inv in nodes for s, c in inv.steps.items() for o in c.committed_ranks]
    existing += [(s, None, inv.node) for inv in nodes for s, c in inv.steps.items() if c.has_metadata]
    bad = draw(st.sets(st.sampled_from(existing), max_size=4)) if existing else set()
    bad_steps = draw(st.sets(st.sampled_from(steps), max_size=2)) if steps else set()
    persistent = draw(st.one_of(st.none(), st.none(), st.integers(0, 32)))
    can_fetch = draw(st.integers(0, 3)) > 0
    return {"nodes": nodes, "world": world, "rpn": rpn, "bad": bad, "bad_steps": bad_steps,
                "persistent": persistent, "can_fetch": can_fetch}


class Model:
    """An independent statement of what the planner must decide."""

    def __init__(self, sc):
        self.sc = sc
        self.live = {inv.node: inv for inv in sc["nodes"] if inv.ranks}
        self.node_of = {r: n for n, inv in self.live.items() for r in inv.ranks}
        self.steps = sorted({s for inv in self.live.values() for s in inv.steps})
        bad = sc["bad"]
        self.meta: dict[int, set[int]] = defaultdict(set)
        self.owner: dict[int, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
        self.nbytes: dict[tuple[int, int], set[int]] = defaultdict(set)
        self.saved: dict[int, tuple[tuple[int, ...], int]] = {}
        self.groups: dict[int, dict[int, list[list[int]]]] = {}
        for n, inv in self.live.items():
            for s, c in inv.steps.items():
                if c.has_metadata and (s, None, n) not in bad:
                    self.meta[s].add(n)
                    self.saved[s] = (tuple(c.required_ranks or ()), c.world_size)
                    self.groups[s] = c.copy_groups
                for o, b in c.shard_bytes.items():
                    if (s, o, n) not in bad:
                        self.owner[s][o].add(n)
                        self.nbytes[(s, o)].add(b)

    def readable(self, s: int, r: int, nodes: set[int] | None = None) -> bool:
        """Every item of ``r``'s shard of step ``s`` is on a node (in ``nodes``, if given):
        the shard, or a copy of each item (some shard of each of its copy groups)."""
        def on(x: int) -> bool:
            return bool(self.owner[s][x] if nodes is None else self.owner[s][x] & nodes)

        return on(r) or bool(self.groups[s].get(r)) and all(any(on(x) for x in g)
                                                            for g in self.groups[s][r])

    def complete(self, s: int) -> bool:
        return bool(self.meta[s]) and all(self.readable(s, r) for r in self.saved[s][0])

    def through_copies(self, s: int) -> list[int]:
        """Owners of step ``s`` whose shard is on no node: their items are read from copies."""
        return [r for r in self.saved[s][0] if not self.owner[s][r]]

    def same_world(self, s: int) -> bool:
        return self.saved[s][1] == self.sc["world"]

    def shard_needs(self, s: int) -> list[int]:
        """Ranks that must pull their own shard of step ``s`` onto their node."""
        if not self.same_world(s):
            return []
        return [r for r in sorted(self.node_of) if r in self.saved[s][0]
                and self.node_of[r] not in self.owner[s][r] and self.owner[s][r]]

    def copies_elsewhere(self, s: int) -> list[int]:
        """Ranks read through copies that are not all on their own node."""
        if not self.same_world(s):
            return []
        return [r for r in self.through_copies(s)
                if r in self.node_of and not self.readable(s, r, {self.node_of[r]})]

    def meta_needs(self, s: int) -> list[int]:
        return sorted(n for n in self.live if n not in self.meta[s])

    def usable(self, s: int) -> bool:
        if s in self.sc["bad_steps"] or not self.complete(s):
            return False
        return self.sc["can_fetch"] or not (self.shard_needs(s) or self.meta_needs(s)
                                            or self.copies_elsewhere(s))

    def expected(self) -> tuple[str, int | None]:
        best = max((s for s in self.steps if self.usable(s)), default=None)
        p = self.sc["persistent"]
        if best is not None and (p is None or best >= p):
            return MEMORY, best
        if p is not None:
            return PERSISTENT, p
        return FRESH, None

    def newest_protected(self) -> int | None:
        for s in reversed(self.steps):
            if len(self.meta[s]) >= 2 and all(self.places(s, r) >= 2 for r in self.saved[s][0]):
                return s
        return None


    def places(self, s: int, r: int) -> int:
        """On how many nodes the least-held item of ``r``'s shard of step ``s`` is."""
        return min(len(self.owner[s][r].union(*(self.owner[s][x] for x in g)))
                   for g in self.groups[s].get(r) or [()])


def run(sc) -> Decision:
    return plan_resume(sc["nodes"], sc["persistent"], sc["world"], bad_copies=sc["bad"],
                       bad_steps=sc["bad_steps"], can_fetch=sc["can_fetch"])


PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(scenarios())
def test_property_decision_matches_model(sc):
    d = run(sc)
    m = Model(sc)
    assert (d.kind, d.step) == m.expected(), (d, sc)
    assert d.newest_protected == m.newest_protected()
    if d.kind == MEMORY:
        # the chosen step is complete among the survivors, not counting bad copies
        assert m.complete(d.step) and d.step not in sc["bad_steps"]
        # no newer step was usable, and a persistent step newer than it would have won
        assert not any(m.usable(s) for s in m.steps if s > d.step)
        assert sc["persistent"] is None or sc["persistent"] <= d.step
        assert d.resharded == (not m.same_world(d.step))
    else:
        assert d.fetches == [] and d.sources == {}
        if d.kind == FRESH:
            assert sc["persistent"] is None and not any(m.usable(s) for s in m.steps)


@PROPERTY
@given(scenarios())
def test_property_fetch_plan_covers_every_need_once(sc):
    d = run(sc)
    if d.kind != MEMORY:
        return
    m = Model(sc)
    s = d.step
    assert all(f.step == s for f in d.fetches)
    if not sc["can_fetch"]:
        assert d.fetches == []

    # Shards: the plan fetches none; exactly one rebuild per rank whose node lacks its (good)
    # shard, read from live nodes with a good copy only, none otherwise.
    rebuilds = rebuilt_from(d, sc["rpn"])
    assert sorted(rebuilds) == m.shard_needs(s), (rebuilds, sc)
    for owner, src_nodes in rebuilds.items():
        assert src_nodes, (owner, sc)
        for src_node in src_nodes:
            assert src_node in m.live and src_node in m.owner[s][owner], (owner, src_node)
            assert (s, owner, src_node) not in sc["bad"]
        assert d.data_bytes[owner] in m.nbytes[(s, owner)]  # the size it rebuilds

    # Metadata: exactly one fetch per live node without a good copy, by one of its ranks.
    metas = d.fetches
    assert sorted(m.node_of[f.dst_rank] for f in metas) == m.meta_needs(s), (metas, sc)
    for f in metas:
        src_node = m.node_of[f.src_rank]
        assert src_node in m.meta[s] and (s, None, src_node) not in sc["bad"]

    # Where each rank's bytes come from; who can serve each shard during the load.
    needs = set(m.shard_needs(s))
    copied = set(m.through_copies(s)) if m.same_world(s) else set()
    assert d.through_copies == m.through_copies(s)
    assert d.sources == {r: ("peer" if r in needs else "copies" if r in copied else "local")
                         for r in m.node_of}
    for o, ranks in d.holders.items():
        assert sorted(ranks) == sorted(r for n in m.owner[s][o] for r in m.live[n].ranks), o
    assert {o for o, ns in m.owner[s].items() if ns} == set(d.holders)
    assert sorted(d.metadata_holders) == sorted(r for n in m.meta[s] for r in m.live[n].ranks)


@PROPERTY
@given(scenarios())
def test_property_reason_names_every_refused_newer_step(sc):
    d = run(sc)
    m = Model(sc)
    chosen = d.step if d.kind == MEMORY else None
    p = sc["persistent"]
    for s in m.steps:
        if chosen is not None and s <= chosen:
            continue
        if d.kind == PERSISTENT and s < p:
            continue  # never looked at: the persistent step is newer anyway
        assert mentions_step(d.reason, s), (s, d.reason, sc)
        if s in sc["bad_steps"]:
            assert f"step {s} failed" in d.reason
        elif not m.complete(s):
            assert f"step {s} unusable" in d.reason
        elif not sc["can_fetch"]:
            assert "replication is off" in d.reason
    if d.kind == PERSISTENT and any(s < p for s in m.steps):
        assert f"persistent step {p} is newer" in d.reason, d.reason
    if d.kind == FRESH:
        assert d.reason


@PROPERTY
@given(scenarios())
def test_property_deterministic_and_inputs_untouched(sc):
    """Every rank plans on the same gathered inputs and must reach the same decision."""
    snapshot = [(inv.node, list(inv.ranks), dict(inv.steps)) for inv in sc["nodes"]]
    a, b = run(sc), run(sc)
    assert a == b
    assert snapshot == [(inv.node, list(inv.ranks), dict(inv.steps)) for inv in sc["nodes"]]


@pytest.mark.parametrize("persistent", [None, 5])
def test_bad_everything_is_fresh_or_persistent(persistent):
    nodes = paired(2, 1, [1, 2])
    bad = [(s, o, n) for s in (1, 2) for o in (0, 1, None) for n in (0, 1)]
    d = plan_resume(nodes, persistent, 2, bad_copies=bad)
    assert d.kind == (FRESH if persistent is None else PERSISTENT)
    assert d.step == persistent and d.fetches == []


# ---------------------------------------------------------------------------- saves and runs
def saved(owners, run, save, created, *, shard_save=None, ancestors=(), required=(0, 1), world=2,
          meta=True) -> StepState:
    """A node's copy of one save: metadata of ``save`` by ``run`` and shards of ``shard_save``
    (default: the same save)."""
    base = copy(owners, meta=meta, required=required, world_size=world)
    shard_save = save if shard_save is None else shard_save
    return restate(base, save_id=save if meta else "", run_id=run if meta else "",
                               created=created if meta else 0.0, ancestors=tuple(ancestors),
                               shard_saves=tuple((o, shard_save) for o in sorted(owners)))


def test_a_returning_node_with_an_older_run_of_the_same_steps_is_not_mixed_in():
    # run A saved steps 2-3 on both nodes; run B (a fresh start on new machines) saved 2-3 again.
    # Node 1 came back with run A's memory; node 0 has run B's, including node 1's replica.
    nodes = inventories(2, 1, {
        0: {s: saved({0, 1}, "B", f"b{s}", 200 + s) for s in (2, 3)},
        1: {s: saved({0, 1}, "A", f"a{s}", 100 + s) for s in (2, 3)},
    })
    d = plan_resume(nodes, None, 2)
    assert (d.kind, d.step, d.save_id) == (MEMORY, 3, "b3")
    # rank 1 reads run B's bytes from node 0, never the run-A copy on its own node
    assert d.sources == {0: "local", 1: "peer"}
    assert [(f.dst_rank, f.src_rank) for f in d.fetches] == [(1, 0)]  # the metadata
    assert d.holders == {0: [0], 1: [0]}
    assert "another run" in d.reason


def test_steps_of_the_failed_run_newer_than_what_was_resumed_are_foreign():
    # run A saved 1-3; run B resumed A's step 2 (3 was incomplete then) and saved 3 again, but
    # B's step 3 lost a shard. A's step 3, complete on node 1, is not part of B's history.
    nodes = inventories(2, 1, {
        0: {1: saved({0, 1}, "A", "a1", 101), 2: saved({0, 1}, "A", "a2", 102),
            3: saved({0}, "B", "b3", 203, ancestors=[("A", 2)])},
        1: {3: saved({0, 1}, "A", "a3", 103), 2: saved({0, 1}, "A", "a2", 102)},
    })
    d = plan_resume(nodes, None, 2)
    assert (d.step, d.save_id) == (2, "a2"), d
    assert d.history.run_id == "B" and d.history.admits("A", 2) and not d.history.admits("A", 3)
    assert mentions_step(d.reason, 3)


def test_a_shard_of_another_save_of_the_step_does_not_count():
    # step 5 saved twice in one run: node 1 still holds rank 0's replica of the first save
    nodes = inventories(2, 1, {
        0: {5: saved({0}, "R", "second", 20, shard_save="second")},
        1: {5: restate(saved({0, 1}, "R", "second", 20),
                                   shard_saves=((0, "first"), (1, "second")))},
    })
    d = plan_resume(nodes, None, 2)
    assert (d.step, d.save_id) == (5, "second")
    assert d.holders[0] == [0]  # only node 0 holds rank 0's shard of the second save
    nodes[0].steps.clear()  # lose node 0: the first save's replica cannot complete step 5
    d = plan_resume(nodes, None, 2)
    assert d.kind == FRESH and "ranks [0]" in d.reason


def test_the_later_save_of_a_step_saved_twice_wins():
    both = {0: "first", 1: "first"}
    nodes = inventories(2, 1, {
        0: {5: saved({0, 1}, "R", "second", 20)},
        1: {5: restate(saved({0, 1}, "R", "first", 10),
                                   shard_saves=tuple(both.items()))},
    })
    d = plan_resume(nodes, None, 2)
    assert (d.step, d.save_id) == (5, "second") and d.holders == {0: [0], 1: [0]}


def test_complete_steps_that_were_not_loaded_are_stranded_not_dropped():
    nodes = paired(2, 1, [2, 3])
    d = plan_resume(nodes, None, 2, bad_steps={3})
    assert d.step == 2 and d.stranded == [3]
    d = plan_resume(nodes, None, 2, bad_steps={2, 3})
    assert d.kind == FRESH and d.stranded == [3, 2]
    d = plan_resume(nodes, 2, 2, bad_steps={2, 3})  # persistent step 2: only 3 is newer
    assert d.kind == PERSISTENT and d.stranded == [3]


@st.composite
def incarnations(draw):
    """Two runs of a job left copies of the same step numbers on the nodes, mixed at random.
    Run B is newer and may descend from run A up to some step."""
    nnodes = draw(st.integers(2, 4))
    world = nnodes
    upto = draw(st.one_of(st.none(), st.integers(0, 4)))
    runs = {"A": (100.0, ()), "B": (200.0, () if upto is None else (("A", upto),))}
    nodes = []
    for n in range(nnodes):
        inv = {}
        for s in draw(st.sets(st.integers(1, 4), max_size=4)):
            meta_run = draw(st.sampled_from(["A", "B", None]))
            owners = draw(st.sets(st.integers(0, world - 1), max_size=world))
            shard_runs = {o: draw(st.sampled_from(["A", "B"])) for o in sorted(owners)}
            created, ancestors = runs[meta_run or "A"]
            base = copy(owners, meta=meta_run is not None, required=range(world), world_size=world)
            inv[s] = restate(
                base, save_id=f"{meta_run}{s}" if meta_run else "", run_id=meta_run or "",
                created=created + s if meta_run else 0.0, ancestors=ancestors if meta_run else (),
                shard_saves=tuple((o, f"{r}{s}") for o, r in shard_runs.items()))
        nodes.append(NodeInventory(n, [n], inv))
    return nodes, world


@PROPERTY
@given(incarnations())
def test_property_a_decision_never_combines_two_saves(sc):
    nodes, world = sc
    d = plan_resume(nodes, None, world)
    if d.kind != MEMORY:
        return
    held = {inv.node: inv.steps.get(d.step) for inv in nodes}
    assert d.history is not None and d.history.admits(d.save_id[0], d.step)
    assert d.save_id == f"{d.save_id[0]}{d.step}"
    for node in {r for r in d.metadata_holders}:  # one rank per node: rank == node
        assert held[node].has_metadata and held[node].save_id == d.save_id
    for owner, holders in d.holders.items():
        for node in holders:
            assert held[node].shard_saves.get(owner) == d.save_id, (owner, node, d)
    for owner in range(world):
        assert d.holders.get(owner), (owner, d)  # every shard of the save is somewhere
    # the newest save any node holds is run B's whenever B left any metadata behind
    if any(c.run_id == "B" for inv in nodes for c in inv.steps.values() if c.has_metadata):
        assert d.history.run_id == "B"


def verdicts_agree(nodes: list[NodeInventory], world: int, bad=()) -> None:
    """``step_verdicts`` calls a step complete exactly when ``plan_resume`` over the same
    inventories and bad copies loads it with every newer step ruled out, and lists every step
    a node with live ranks holds."""
    verdicts = step_verdicts(nodes, bad_copies=bad)
    assert set(verdicts) == {s for inv in nodes if inv.ranks for s in inv.steps}
    for s, v in verdicts.items():
        d = plan_resume(nodes, None, world, bad_copies=bad, bad_steps=[t for t in verdicts if t > s])
        assert ((d.kind, d.step) == (MEMORY, s)) == v.complete, (s, v, d.reason)
        assert not (v.complete and (v.missing or v.foreign or v.reason)), v
        assert v.complete or v.reason, v


@PROPERTY
@given(scenarios())
def test_property_step_verdicts_are_the_planners(sc):
    verdicts_agree(sc["nodes"], sc["world"], sc["bad"])


@PROPERTY
@given(incarnations())
def test_property_step_verdicts_are_the_planners_across_runs(sc):
    verdicts_agree(*sc)


# ---------------------------------------------------------------------------- reasons are true
def _one_shard_lost(steps) -> list:
    """Steps saved on two nodes whose rank-1 shard survived nowhere (unusable)."""
    nodes = paired(2, 1, [])
    for inv in nodes:
        for s in steps:
            inv.steps[s] = copy({0}, required=(0, 1), world_size=2)
    return nodes


# (memory, persistent step, bad steps) -> the decision and what its reason must say; every
# reason also says what was loaded. The first rows were "no checkpoint found" before, which is
# false when a persistent step is loaded.
REASONS = {
    "memory empty, persistent": (lambda: inventories(2, 1, {}), 35, (), (PERSISTENT, 35),
                                 ["memory holds no checkpoint of this job",
                                  "loading persistent step 35"]),
    "memory unusable, persistent": (lambda: _one_shard_lost([6, 7]), 4, (), (PERSISTENT, 4),
                                    ["step 7 unusable", "step 6 unusable", "ranks [1]",
                                     "no step in memory is usable", "loading persistent step 4"]),
    "memory failed, persistent": (lambda: paired(2, 1, [5]), 4, (5,), (PERSISTENT, 4),
                                  ["step 5 failed earlier", "no step in memory is usable",
                                   "loading persistent step 4"]),
    "persistent newer": (lambda: paired(2, 1, [3]), 9, (), (PERSISTENT, 9),
                         ["persistent step 9 is newer than memory step 3: loading it"]),
    "nothing anywhere": (lambda: inventories(2, 1, {}), None, (), (FRESH, None),
                         ["memory holds no checkpoint of this job",
                          "no persistent checkpoint: starting fresh"]),
    "memory unusable, no persistent": (lambda: _one_shard_lost([6]), None, (), (FRESH, None),
                                       ["step 6 unusable", "no step in memory is usable",
                                        "starting fresh"]),
    "only step failed, no persistent": (lambda: paired(2, 1, [5]), None, (5,), (FRESH, None),
                                        ["step 5 failed earlier", "starting fresh"]),
}


@pytest.mark.parametrize("case", list(REASONS))
def test_reason_says_what_was_loaded_and_why(case):
    nodes, persistent, bad_steps, decided, phrases = REASONS[case]
    d = plan_resume(nodes(), persistent, 2, bad_steps=bad_steps)
    assert (d.kind, d.step) == decided, d
    for words in phrases:
        assert words in d.reason, (words, d.reason)
    assert "no checkpoint found" not in d.reason
    if d.kind == PERSISTENT:
        assert "starting fresh" not in d.reason and f"persistent step {d.step}" in d.reason


def test_a_persistent_step_written_before_the_memory_step_was_saved_is_an_earlier_history():
    # Run A wrote persistent step 3 at t=100; run B started over without resuming and saved
    # steps 0 and 1 at t=200 and 201.
    nodes = inventories(2, 1, {n: {s: saved({0, 1}, "B", f"b{s}", 200 + s) for s in (0, 1)}
                               for n in (0, 1)})
    d = plan_resume(nodes, 3, 2, persistent=PersistentStep(3, written=100.0))
    assert (d.kind, d.step, d.save_id) == (MEMORY, 1, "b1"), d
    assert "persistent step 3 was written before memory step 1 was saved" in d.reason
    # Written after the memory step (one history, the usual case), at an unknown time, or so
    # little before that clocks may disagree: the higher-numbered persistent step wins as before.
    for written in (300.0, None, 198.0):
        d = plan_resume(nodes, 3, 2, persistent=PersistentStep(3, written=written))
        assert (d.kind, d.step) == (PERSISTENT, 3), (written, d)
    # Memory of the later history unusable: a fresh start, not the earlier history's step.
    for inv in nodes:
        inv.steps = {s: restate(c, owners=frozenset({0}), shard_bytes=((0, 100),))
                     for s, c in inv.steps.items()}
    d = plan_resume(nodes, 3, 2, persistent=PersistentStep(3, written=100.0))
    assert d.kind == FRESH and "starting fresh" in d.reason, d


def test_a_persistent_step_with_an_origin_record_is_weighed_by_run_not_by_the_file_servers_clock():
    # Run B saved memory steps 0 and 1 at t=200/201 (by the job's clock).
    nodes = inventories(2, 1, {n: {s: saved({0, 1}, "B", f"b{s}", 200 + s) for s in (0, 1)}
                               for n in (0, 1)})
    # Run A wrote persistent step 3 at t=100 by its own clock; the file server's clock says
    # t=300 (skewed ahead): the record decides, B does not descend from A, so it is earlier.
    d = plan_resume(nodes, 3, 2, persistent=PersistentStep(3, written=300.0, run_id="A", created=100.0))
    assert (d.kind, d.step, d.save_id) == (MEMORY, 1, "b1"), d
    assert "earlier history" in d.reason
    # Written by B itself (the same history), even with the file server's clock far behind
    # (t=50): the higher-numbered persistent step is newer and wins.
    d = plan_resume(nodes, 3, 2, persistent=PersistentStep(3, written=50.0, run_id="B", created=202.0))
    assert (d.kind, d.step) == (PERSISTENT, 3), d
    # Written by a run not in B's history but after B's saves (a later history): loaded.
    d = plan_resume(nodes, 3, 2, persistent=PersistentStep(3, written=50.0, run_id="C", created=250.0))
    assert (d.kind, d.step) == (PERSISTENT, 3), d


def test_a_persistent_step_of_an_ancestor_run_counts_only_up_to_where_this_history_left_it():
    # Run B resumed from run A's step 1; A went on to write persistent step 3 (at t=150) that
    # B never saw. B saved step 2 at t=200.
    nodes = inventories(2, 1, {n: {2: saved({0, 1}, "B", "b2", 200, ancestors=(("A", 1),))}
                               for n in (0, 1)})
    d = plan_resume(nodes, 3, 2, persistent=PersistentStep(3, written=150.0, run_id="A", created=150.0))
    assert (d.kind, d.step) == (MEMORY, 2), d
    # A's persistent step 1 is where B came from: B's step 2 is newer anyway; a persistent
    # step 5 written by A at or before the step B took (none here) would count as B's history.
    d = plan_resume(nodes, 1, 2, persistent=PersistentStep(1, written=90.0, run_id="A", created=90.0))
    assert (d.kind, d.step) == (MEMORY, 2), d


# ---------------------------------------------------------------------------- data-parallel copies
def with_copies(c: StepState, groups: dict[int, list[list[int]]]) -> StepState:
    """``c`` with the metadata's copy groups (owner -> sets of ranks whose shards hold copies
    of its items, ``store/coverage.py``)."""
    return restate(c, copy_groups=tuple((o, tuple(map(tuple, gs)))
                                                    for o, gs in sorted(groups.items())))


DDP = {0: [[1]], 1: [[0]]}  # two data-parallel ranks: each shard holds a copy of the other's items


def test_a_shard_on_no_node_is_read_from_copies():
    # DDP, 2 nodes x 1 rank. Replication sent nothing (every item was on two nodes already);
    # node 1 was replaced. Rank 1's shard is gone, its items survive in rank 0's shard.
    nodes = inventories(2, 1, {0: {5: with_copies(copy({0}, required=(0, 1), world_size=2), DDP)}})
    d = plan_resume(nodes, None, 2)
    assert (d.kind, d.step) == (MEMORY, 5)
    assert d.through_copies == [1]
    assert d.sources == {0: "local", 1: "copies"}
    assert d.fetches == [Fetch(1, 0, 5)]  # its metadata; rank 1's shard is on no node
    assert d.holders == {0: [0]}  # who serves the copies: rank 0's shard's holders
    assert "ranks [1]" in d.reason and "copies" in d.reason, d.reason
    # The same holdings under a metadata without copy groups (an older save): unusable, as before.
    old = inventories(2, 1, {0: {5: copy({0}, required=(0, 1), world_size=2)}})
    d = plan_resume(old, None, 2)
    assert (d.kind, d.step) == (FRESH, None)
    assert "shards of ranks [1] are on no surviving node" in d.reason and "cop" not in d.reason


def test_copies_on_the_same_node_serve_without_a_transport():
    # 1 node x 2 ranks, rank 1's shard never committed; its items are copied into rank 0's.
    nodes = inventories(1, 2, {0: {3: with_copies(copy({0}, required=(0, 1), world_size=2), DDP)}})
    d = plan_resume(nodes, None, 2, can_fetch=False)
    assert (d.kind, d.step, d.fetches) == (MEMORY, 3, [])
    assert d.sources == {0: "local", 1: "copies"}
    # Across nodes the copies would have to be read from node 0: refused without a transport.
    nodes = inventories(2, 1, {0: {3: with_copies(copy({0}, required=(0, 1), world_size=2), DDP)},
                               1: {3: with_copies(copy(set(), required=(0, 1), world_size=2), DDP)}})
    d = plan_resume(nodes, None, 2, can_fetch=False)
    assert d.kind == FRESH and "replication is off" in d.reason, d
    assert plan_resume(nodes, None, 2).sources == {0: "local", 1: "copies"}


def test_a_lost_copy_group_leaves_the_step_incomplete_and_says_which():
    # 2 nodes x 2 ranks; node 1 (ranks 2, 3) lost. Rank 2's items were copied, some to rank 0's
    # shard and the others to rank 1's; rank 3 has items with no copy at all.
    groups = {2: [[0], [1]], 3: [[], [1]]}
    older = paired(2, 2, [4], lost=[1])  # step 4: replicated, complete on node 0
    older[0].steps[6] = with_copies(copy({0, 1}, required=range(4), world_size=4), groups)
    d = plan_resume(older, None, 4)
    assert (d.kind, d.step) == (MEMORY, 4)
    assert "step 6 unusable: shards of ranks [3] are on no surviving node" in d.reason, d.reason
    assert "rank 3's items with no copy" in d.reason and "rank 2" not in d.reason, d.reason
    # Rank 1's shard lost too: the copies of rank 2's items kept there are gone.
    older[0].steps[6] = with_copies(copy({0}, required=range(4), world_size=4), groups)
    d = plan_resume(older, None, 4)
    assert d.step == 4
    assert "rank 2's items copied only to ranks [1]" in d.reason, d.reason
    # Without rank 3's uncopied items, step 6 is complete: rank 2 through copies in 0 and 1.
    older[0].steps[6] = with_copies(copy({0, 1}, required=range(3), world_size=4),
                                    {2: [[0], [1]]})
    d = plan_resume(older, None, 4)
    assert (d.step, d.through_copies, d.resharded) == (6, [2], False), d
    assert d.sources == {0: "local", 1: "local", 2: "copies", 3: "local"}
    assert peers(d) == []


def test_a_refused_copy_counts_as_lost():
    nodes = inventories(2, 1, {0: {5: with_copies(copy({0}, required=(0, 1), world_size=2), DDP)}})
    d = plan_resume(nodes, None, 2, bad_copies=[(5, 0, 0)])  # rank 0's shard failed a checksum
    assert d.kind == FRESH
    assert "failed verification" in d.reason and "rank 1's items copied only to ranks [0]" in d.reason


def test_protection_counts_the_nodes_each_item_is_on():
    # DDP on 2 nodes, nothing replicated: each node holds its own rank's shard, which holds a
    # copy of the other's items. Every item is on two nodes: protected.
    nodes = inventories(2, 1, {n: {7: with_copies(copy({n}, required=(0, 1), world_size=2), DDP)}
                               for n in (0, 1)})
    d = plan_resume(nodes, None, 2)
    assert (d.step, d.fetches, d.through_copies) == (7, [], [])
    assert d.newest_protected == 7
    assert plan_resume(nodes, None, 2, places=3).newest_protected is None
    # An item with no copy (group []) of rank 1 is on node 1 only.
    partly = {0: [[1]], 1: [[], [0]]}
    nodes = inventories(2, 1, {n: {7: with_copies(copy({n}, required=(0, 1), world_size=2), partly)}
                               for n in (0, 1)})
    assert plan_resume(nodes, None, 2).newest_protected is None
    # The metadata on one node only: not protected.
    nodes = inventories(2, 1, {0: {7: with_copies(copy({0}, required=(0, 1), world_size=2), DDP)},
                               1: {7: with_copies(copy({1}, meta=False), DDP)}})
    assert plan_resume(nodes, None, 2).newest_protected is None
    # The same holdings without copy groups (an older save): each shard on one node, as before.
    nodes = inventories(2, 1, {n: {7: copy({n}, required=(0, 1), world_size=2)} for n in (0, 1)})
    d = plan_resume(nodes, None, 2)
    assert (d.step, d.newest_protected, d.through_copies) == (7, None, [])
    assert d.fetches == []
