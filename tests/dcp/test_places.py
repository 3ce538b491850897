"""Where the reader takes an item it has no place of on its node (dcp/remote.py, pure): from a
node that holds one of its places, the reads spread over every such node."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import given
from hypothesis import strategies as st

from mlcheckpoint.dcp.remote import deal, places_of
from mlcheckpoint.store.layout import ItemLocation


def test_an_items_places_are_its_primary_then_its_copies():
    loc = ItemLocation(rank=2, offset=64, nbytes=8, checksum=1, copies=((0, 128), (5, 0)))
    assert places_of(loc) == [(2, 64), (0, 128), (5, 0)]
    assert places_of(ItemLocation(rank=1, offset=0, nbytes=8, checksum=1)) == [(1, 0)]


def test_a_tie_goes_to_the_node_named_first_and_its_first_place():
    # the primary's holder (node 1) is named first; node 0 holds only the copy
    assert deal([(10, [((0, 0), [1]), ((3, 64), [0])])]) == [((0, 0), 1)]
    # a node holding both places serves the first
    assert deal([(10, [((0, 0), [2]), ((3, 64), [2, 0])])]) == [((0, 0), 2)]


def test_an_item_no_node_holds_is_not_dealt():
    assert deal([(10, [((0, 0), []), ((1, 0), [])]), (5, [((2, 0), [4])])]) == [None, ((2, 0), 4)]


def test_the_largest_item_goes_first_and_the_rest_to_the_node_with_fewer_bytes():
    both = [((0, 0), [0, 1])]
    dealt = deal([(10, both), (100, both), (10, both), (20, both)])
    assert dealt == [((0, 0), 1), ((0, 0), 0), ((0, 0), 1), ((0, 0), 1)]  # 100 | 10 + 20 + 10


ITEMS = st.lists(
    st.tuples(st.integers(0, 1000),
              st.lists(st.tuples(st.tuples(st.integers(0, 5), st.integers(0, 9)),
                                 st.lists(st.integers(0, 5), unique=True, max_size=4)),
                       max_size=4)),
    max_size=30)


@given(ITEMS)
def test_each_item_comes_from_a_node_that_holds_the_place_dealt(items):
    for (nbytes, options), choice in zip(items, deal(items), strict=True):
        holders = {n for _, nodes in options for n in nodes}
        if not holders:
            assert choice is None
            continue
        assert choice is not None
        place, node = choice
        assert node in holders
        # of that node's places, the first in order of preference
        assert place == next(p for p, nodes in options if node in nodes)


@given(st.lists(st.integers(1, 1000), max_size=40), st.integers(1, 5))
def test_items_every_node_holds_are_spread_within_one_item(sizes, nnodes):
    nodes = list(range(nnodes))
    dealt = deal([(n, [((0, i), nodes)]) for i, n in enumerate(sizes)])
    load: dict[int, int] = defaultdict(int)
    for n, (_, node) in zip(sizes, dealt, strict=True):
        load[node] += n
    loads = [load[n] for n in nodes]
    assert max(loads) - min(loads) <= max(sizes, default=0)
