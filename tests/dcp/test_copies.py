"""dcp/copies.py: which rank of each node keeps a copy of a replicated item (pure)."""

from __future__ import annotations

import logging

from torch.distributed.checkpoint.metadata import MetadataIndex

from mlcheckpoint.dcp import copies
from mlcheckpoint.store.layout import ItemLocation

BIG = 1 << 40


def idx(fqn: str, offset=None) -> MetadataIndex:
    return MetadataIndex(fqn, offset)


def ddp(world: int, items: dict[str, int]) -> dict[int, list]:
    return {r: [(idx(f), n) for f, n in items.items()] for r in range(world)}


def test_ddp_two_nodes_one_copy_per_node_on_the_other_node():
    held = ddp(2, {"a": 100, "b": 50})
    planned = {0: [idx("a")], 1: [idx("b")]}
    choice = copies.choose(held, planned, [0, 1], {0: BIG, 1: BIG})
    assert choice.modes == (copies.DP_COPIES, copies.DP_COPIES)
    assert choice.copies == {1: [idx("a")], 0: [idx("b")]}
    assert choice.copy_bytes == (50, 100)


def test_one_keeper_per_node_balanced_by_bytes():
    # 2 nodes x 2 ranks, every item everywhere, all primaries on node 0
    items = {"a": 40, "b": 30, "c": 20, "d": 10}
    held = ddp(4, items)
    planned = {0: [idx("a"), idx("d")], 1: [idx("b"), idx("c")], 2: [], 3: []}
    choice = copies.choose(held, planned, [0, 0, 1, 1], {0: BIG, 1: BIG})
    kept = {r: sorted(i.fqn for i in v) for r, v in choice.copies.items()}
    assert set(kept) == {2, 3}  # only node 1 keeps copies: node 0 holds the primaries
    assert sorted(kept[2] + kept[3]) == ["a", "b", "c", "d"]  # each item once on the node
    by = {r: sum(items[f] for f in fs) for r, fs in kept.items()}
    assert sorted(by.values()) == [50, 50]
    again = copies.choose(held, planned, [0, 0, 1, 1], {0: BIG, 1: BIG})
    assert again == choice  # deterministic


def test_unique_items_keep_no_copies():
    held = {0: [(idx("w0"), 10)], 1: [(idx("w1"), 10)]}
    choice = copies.choose(held, {0: [idx("w0")], 1: [idx("w1")]}, [0, 1], {0: BIG, 1: BIG})
    assert choice.copies == {} and choice.modes == (copies.UNIQUE, copies.UNIQUE)


def test_replicas_within_one_node_keep_no_copy():
    held = ddp(2, {"a": 10})
    choice = copies.choose(held, {0: [idx("a")], 1: []}, [0, 0], {0: BIG})
    assert choice.copies == {} and choice.modes == (copies.UNIQUE,)


def test_a_node_without_room_keeps_none():
    held = ddp(2, {"a": 100, "b": 100})
    planned = {0: [idx("a")], 1: [idx("b")]}
    # node 1 would hold 100 of its own and 100 of copies: 150 has no room for them
    choice = copies.choose(held, planned, [0, 1], {0: BIG, 1: 150})
    assert choice.modes == (copies.DP_COPIES, copies.DEDUP)
    assert choice.copies == {0: [idx("b")]}
    assert copies.choose(held, planned, [0, 1], {0: BIG, 1: 200}).modes[1] == copies.DP_COPIES


def test_the_room_counts_what_replicas_bring_beside_the_copies():
    """What arrives with copies is what the partner holds alone (its per-rank state), as much
    as this node holds alone, once per replica: not a shard of the node's own size."""
    held = {r: [(idx("a"), 100), (idx(f"rng{r}"), 10)] for r in range(2)}
    planned = {0: [idx("a"), idx("rng0")], 1: [idx("rng1")]}
    # node 1: 10 of its own, 100 of copies, 10 of rank 0's RNG state arriving: 120
    assert copies.choose(held, planned, [0, 1], {0: BIG, 1: 120}).modes[1] == copies.DP_COPIES
    assert copies.choose(held, planned, [0, 1], {0: BIG, 1: 119}).modes[1] == copies.DEDUP
    two = copies.choose(held, planned, [0, 1], {0: BIG, 1: 129}, replicas=2)  # 10 twice
    assert two.modes[1] == copies.DEDUP


def test_chunks_of_one_tensor_are_items_of_their_own():
    held = {r: [(idx("w", [0]), 8), (idx("w", [4]), 8)] for r in range(2)}
    planned = {0: [idx("w", [0])], 1: [idx("w", [4])]}
    choice = copies.choose(held, planned, [0, 1], {0: BIG, 1: BIG})
    assert choice.copies == {1: [idx("w", [0])], 0: [idx("w", [4])]}


def test_attach_records_agreeing_copies_only(caplog):
    a, b = idx("a"), idx("b")
    primaries = {a: ItemLocation(0, 0, 8, 111), b: ItemLocation(0, 64, 8, 222)}
    kept = [(a, ItemLocation(1, 128, 8, 111)), (b, ItemLocation(1, 0, 8, 999))]
    with caplog.at_level(logging.WARNING):
        out = copies.attach(primaries, kept)
    assert out[a].copies == ((1, 128),)
    assert out[b].copies == ()
    assert "b (rank 0, rank 1)" in caplog.text
    assert primaries[a].copies == ()  # the input is left alone


def test_items_a_planner_did_not_deduplicate_get_no_copies():
    held = ddp(2, {"a": 10, "b": 10})
    planned = {0: [idx("a"), idx("b")], 1: [idx("b")]}  # "b" written by both
    choice = copies.choose(held, planned, [0, 1], {0: BIG, 1: BIG})
    assert choice.copies == {1: [idx("a")]}
