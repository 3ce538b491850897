"""store/coverage.py, the one home of *complete* and *protected*: which nodes hold each item.

Deterministic cases pin down each rule; hypothesis then checks them against an independent
model that counts, item by item, the nodes whose files hold it (whole shards, partial replicas
listing the item, shards holding a copy).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlcheckpoint.store import coverage
from mlcheckpoint.store.coverage import WHOLE, Held, StepItems
from mlcheckpoint.store.layout import ItemLocation
from mlcheckpoint.store.manifest import ManifestItem


def loc(rank, *copies, offset=0, nbytes=8, checksum=1):
    return ItemLocation(rank=rank, offset=offset, nbytes=nbytes, checksum=checksum,
                        copies=tuple((r, 64) for r in copies))


def partial(*groups):
    return Held(frozenset(), frozenset(tuple(g) for g in groups))


def whole_on(node_of_rank):
    """Holdings of each rank's shard whole on its node."""
    return {rank: {node: WHOLE} for rank, node in node_of_rank.items()}


def to_send(owner, groups, holdings, places, target, place_of=lambda n: n):
    """What a replica on ``target`` must carry: the groups lacking places it does not hold."""
    return [g for g, nodes in coverage.lacking(owner, groups, holdings, places, place_of)
            if target not in nodes]


def test_groups_name_the_distinct_copy_sets_per_owner():
    groups = StepItems([loc(0, 2), loc(0, 3), loc(0, 2), loc(1), loc(1, 3), loc(4)]).groups()
    assert groups == {0: [(2,), (3,)], 1: [(), (3,)]}  # rank 4: no copies, left out
    assert coverage.group_of(loc(0, 3, 2, 0)) == (2, 3)  # sorted, its owner left out
    assert coverage.groups_of(4, groups) == [()]


def test_an_item_is_held_by_its_shard_a_partial_replica_listing_it_or_a_copy():
    groups = {0: [(), (2,)]}
    holdings = {0: {"a": WHOLE, "c": partial(())}, 2: {"b": WHOLE, "d": partial(())}}
    assert coverage.holders(0, (), holdings) == {"a", "c"}
    # the copies kept in rank 2's shard: on b, where it is whole, not in its partial on d
    assert coverage.holders(0, (2,), holdings) == {"a", "b"}
    assert coverage.fewest_places(0, groups, holdings) == 2
    assert coverage.unreadable([0], groups, {0: {"c": partial(())}}) == [0]  # the copied items
    assert coverage.unreadable([0], groups, {0: {"c": partial(())}, 2: {"b": WHOLE}}) == []


def test_an_owner_is_readable_from_its_shard_or_from_a_copy_of_every_item():
    groups = {0: [(2,), (3,)], 1: [(), (3,)]}
    here = whole_on

    def available(*ranks):
        return here(dict.fromkeys(ranks, "n"))

    assert coverage.unreadable([0, 1], groups, available(0, 1)) == []
    assert coverage.unreadable([0, 1], groups, available(2, 3)) == [1]  # an item with no copy
    assert coverage.unreadable([0], groups, available(2)) == [0]  # the items copied to rank 3
    assert coverage.unreadable([0, 5], groups, available(2, 3)) == [5]  # its own shard only


def test_fewest_places_counts_the_least_held_item_in_places():
    groups = {0: [(2,), (3,)], 1: [(), (3,)]}
    holdings = whole_on({0: "a", 1: "a", 2: "b", 3: "a"})
    assert coverage.fewest_places(0, groups, holdings) == 1  # copied to rank 3: node a only
    holdings = {**whole_on({0: "a", 2: "b", 3: "b"}), 1: {"a": WHOLE, "c": WHOLE}}
    assert coverage.fewest_places(0, groups, holdings) == 2
    assert coverage.fewest_places(1, groups, holdings) == 2  # replicated to c; copies on b
    # two nodes of one failure domain are one place
    assert coverage.fewest_places(0, groups, holdings, {"a": "x", "b": "x", "c": "y"}.get) == 1


def test_protected_needs_the_metadata_and_every_item_on_enough_places():
    groups = {0: [(), (1,)]}
    holdings = {0: {"a": WHOLE, "b": partial(())}, 1: {"b": WHOLE}}
    assert coverage.protected([0, 1], groups, holdings, 2, ["a", "b"]) is False  # rank 1: b only
    holdings[1]["a"] = partial(())
    assert coverage.protected([0, 1], groups, holdings, 2, ["a", "b"])
    assert not coverage.protected([0, 1], groups, holdings, 2, ["a"])  # metadata on one node
    assert not coverage.protected([0, 1], groups, holdings, 3, ["a", "b", "c"])


def test_what_a_target_is_sent_lacks_places_and_is_not_on_it():
    groups = {0: [(), (1,), (2,)]}
    holdings = whole_on({0: 0, 1: 1, 2: 0})  # the copies in rank 2's are on node 0
    assert to_send(0, groups, holdings, 2, target=1) == [(), (2,)]
    assert to_send(0, groups, holdings, 2, target=3) == [(), (2,)]
    # three places wanted: what only node 1 adds is still short, but node 1 has it
    assert to_send(0, groups, holdings, 3, target=1) == [(), (2,)]
    assert to_send(0, groups, holdings, 3, target=3) == [(), (1,), (2,)]
    # a partner in the failure domain of the owner's node adds no place, but it is still sent
    # there: it holds no copy, and the partner is the one other node there is
    same = {0: "rack", 1: "rack", 2: "other"}.get
    assert to_send(0, {0: [()]}, whole_on({0: 0}), 2, 1, same) == [()]


def test_a_partial_replica_holds_the_items_it_lists_as_recorded_and_the_groups_they_make_whole():
    items = StepItems([loc(0, offset=0, checksum=5), loc(0, offset=64, checksum=6),
                       loc(0, 1, offset=128, checksum=7), loc(1, offset=0)])

    def listed(*pairs):
        return [ManifestItem(f"k{o}", o, 8, c) for o, c in pairs]

    assert items.held(0, listed((0, 5), (64, 6))) == Held(frozenset({0, 64}), frozenset({()}))
    half = items.held(0, listed((0, 5)))  # half a group is none of it; the item listed is here
    assert half == Held(frozenset({0}), frozenset()) and half.holds_item(0) and not half.holds_item(64)
    # another checksum: neither the group nor that item (the reader asks what the planner counts)
    assert items.held(0, listed((0, 5), (64, 9))) == Held(frozenset({0}), frozenset())
    assert items.held(0, listed((0, 5), (64, 6), (128, 7))).groups == {(), (1,)}
    assert items.nbytes(0, [(), (1,)]) == 24 and items.of(0, (1,))[0].offset == 128


def test_an_empty_item_at_a_listed_items_offset_is_not_held_with_it():
    # An empty tensor takes the offset of the item after it. A partial replica listing that
    # item (copy group (1,)) holds nothing of the empty one's group (none): the group is not
    # counted as held there because an offset in it is listed.
    items = StepItems([ItemLocation(0, 64, 20, 5, copies=((1, 64),)), ItemLocation(0, 64, 0, 6)])
    held = items.held(0, [ManifestItem("b", 64, 20, 5)])
    assert held == Held(frozenset({64}), frozenset({(1,)})), held


# ---------------------------------------------------------------------------- against a model
@st.composite
def steps(draw):
    """A save of ``ranks`` ranks on ``nodes`` nodes (rank r on node r % nodes), each owner with
    items some of which have copies in other ranks' shards, and what each node holds: whole
    shards and partial replicas listing whole copy groups."""
    nodes = draw(st.integers(1, 4))
    ranks = draw(st.integers(1, 5))
    locs = []
    for owner in range(ranks):
        for i in range(draw(st.integers(0, 3))):
            copies = draw(st.sets(st.integers(0, ranks - 1), max_size=2)) - {owner}
            locs.append(loc(owner, *sorted(copies), offset=64 * i, checksum=owner * 10 + i))
    groups = StepItems(locs).groups()
    holdings: dict[int, dict[int, Held]] = {}
    for owner in range(ranks):
        for node in range(nodes):
            kind = draw(st.sampled_from(["none", "whole", "partial"]))
            own = coverage.groups_of(owner, groups)
            if kind == "whole" or node == owner % nodes:  # (its own node always holds it)
                holdings.setdefault(owner, {})[node] = WHOLE
            elif kind == "partial":
                chosen = draw(st.sets(st.sampled_from(own), max_size=len(own)))
                offsets = frozenset(item.offset for item in locs if item.rank == owner
                                    and coverage.group_of(item) in chosen)
                holdings.setdefault(owner, {})[node] = Held(offsets, frozenset(chosen))
    return nodes, ranks, locs, groups, holdings


def model_nodes(item: ItemLocation, holdings) -> set[int]:
    """The nodes whose files hold ``item``: its owner's shard whole or listing it, or
    a whole shard of a rank keeping a copy."""
    out = {n for n, h in holdings.get(item.rank, {}).items() if h.holds_item(item.offset)}
    for rank, _ in item.copies:
        out |= {n for n, h in holdings.get(rank, {}).items() if h.whole}
    return out


@settings(max_examples=300, deadline=None)
@given(steps(), st.integers(1, 3))
def test_the_rules_agree_with_counting_each_item(step, copies):
    nodes, _ranks, locs, groups, holdings = step
    required = sorted({item.rank for item in locs})
    per_item = {id(item): model_nodes(item, holdings) for item in locs}
    for owner in required:
        mine = [item for item in locs if item.rank == owner]
        assert coverage.fewest_places(owner, groups, holdings) == min(len(per_item[id(i)]) for i in mine)
    assert coverage.unreadable(required, groups, holdings) == sorted(
        {item.rank for item in locs if not per_item[id(item)]})
    want = all(len(per_item[id(item)]) >= copies for item in locs)
    assert coverage.protected(required, groups, holdings, copies, range(nodes)) == (want and nodes >= copies)
    # what each node is sent makes every item it gets on enough places, and nothing it holds
    for target in range(nodes):
        for owner in required:
            need = to_send(owner, groups, holdings, copies, target)
            for item in (i for i in locs if i.rank == owner):
                where = per_item[id(item)]
                assert (coverage.group_of(item) in need) == (len(where) < copies and target not in where)
