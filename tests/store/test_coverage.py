"""The copy-group rules (store/coverage.py): which shards can serve an owner's items."""

import pytest

from mlcheckpoint.store import coverage
from mlcheckpoint.store.layout import ItemLocation


def loc(rank, *copies):
    return ItemLocation(rank=rank, offset=0, nbytes=8, checksum=1,
                        copies=tuple((r, 64) for r in copies))


def test_groups_name_the_distinct_copy_sets_per_owner():
    groups = coverage.copy_groups([loc(0, 2), loc(0, 3), loc(0, 2), loc(1), loc(1, 3), loc(4)])
    assert groups == {0: [[2], [3]], 1: [[], [3]]}  # rank 4: no copies, left out


def test_an_owner_is_readable_from_its_shard_or_from_a_copy_of_every_item():
    groups = {0: [[2], [3]], 1: [[], [3]]}
    assert coverage.unreadable([0, 1], groups, {0, 1}) == []
    assert coverage.unreadable([0, 1], groups, {2, 3}) == [1]  # rank 1 has an item with no copy
    assert coverage.unreadable([0], groups, {2}) == [0]  # the items copied to rank 3 are lost
    assert coverage.unreadable([0, 5], groups, {2, 3}) == [5]  # no groups: its own shard only


def test_fewest_places_counts_the_least_held_item():
    groups = {0: [[2], [3]], 1: [[], [3]]}
    node = {0: {"a"}, 1: {"a"}, 2: {"b"}, 3: {"a"}}.__getitem__
    assert coverage.fewest_places(0, groups, node) == 1  # the items copied to rank 3: node a only
    node = {0: {"a"}, 1: {"a", "c"}, 2: {"b"}, 3: {"b"}}.__getitem__
    assert coverage.fewest_places(0, groups, node) == 2
    assert coverage.fewest_places(1, groups, node) == 2  # replicated to c; copies on b


def test_header_round_trip_and_malformed_groups_are_refused():
    groups = {0: [[2], [3]], 7: [[]]}
    assert coverage.from_header(coverage.to_header(groups)) == groups
    for bad in ([], {"x": [[1]]}, {"1": [[-1]]}, {"1": [["2"]]}, {"1": [[True]]}, {"1": "2"}):
        with pytest.raises(ValueError):
            coverage.from_header(bad)
