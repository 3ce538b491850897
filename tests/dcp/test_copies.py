"""dcp/copies.py: which rank of each node keeps a copy of a replicated item (pure)."""

from __future__ import annotations

import logging

from torch.distributed.checkpoint.metadata import MetadataIndex

from mlcheckpoint.dcp import copies
from mlcheckpoint.replication.schedule.pairing import (
    every_source,
    pairing_for,
    rank_sources,
)
from mlcheckpoint.store import coverage
from mlcheckpoint.store.inventory import Arrivals, StepState
from mlcheckpoint.store.layout import ItemLocation
from mlcheckpoint.topology import Topology

BIG = 1 << 40


def idx(fqn: str, offset=None) -> MetadataIndex:
    return MetadataIndex(fqn, offset)


def ddp(world: int, items: dict[str, int]) -> dict[int, list]:
    return {r: [(idx(f), n) for f, n in items.items()] for r in range(world)}


def choose(held, planned, nodes, room, replicas=1) -> copies.Choice:
    """``copies.choose`` with one or two nodes, each keeping the other's replicas."""
    n = max(nodes) + 1
    return copies.choose(held, planned, nodes, room, replicas,
                         sources=[[m for m in range(n) if m != node] for node in range(n)])


def test_ddp_two_nodes_one_copy_per_node_on_the_other_node():
    held = ddp(2, {"a": 100, "b": 50})
    planned = {0: [idx("a")], 1: [idx("b")]}
    choice = choose(held, planned, [0, 1], {0: BIG, 1: BIG})
    assert choice.modes == (copies.DP_COPIES, copies.DP_COPIES)
    assert choice.copies == {1: [idx("a")], 0: [idx("b")]}
    assert choice.copy_bytes == (50, 100)


def test_one_keeper_per_node_balanced_by_bytes():
    # 2 nodes x 2 ranks, every item everywhere, all primaries on node 0
    items = {"a": 40, "b": 30, "c": 20, "d": 10}
    held = ddp(4, items)
    planned = {0: [idx("a"), idx("d")], 1: [idx("b"), idx("c")], 2: [], 3: []}
    choice = choose(held, planned, [0, 0, 1, 1], {0: BIG, 1: BIG})
    kept = {r: sorted(i.fqn for i in v) for r, v in choice.copies.items()}
    assert set(kept) == {2, 3}  # only node 1 keeps copies: node 0 holds the primaries
    assert sorted(kept[2] + kept[3]) == ["a", "b", "c", "d"]  # each item once on the node
    by = {r: sum(items[f] for f in fs) for r, fs in kept.items()}
    assert sorted(by.values()) == [50, 50]
    again = choose(held, planned, [0, 0, 1, 1], {0: BIG, 1: BIG})
    assert again == choice  # deterministic


def test_unique_items_keep_no_copies():
    held = {0: [(idx("w0"), 10)], 1: [(idx("w1"), 10)]}
    choice = choose(held, {0: [idx("w0")], 1: [idx("w1")]}, [0, 1], {0: BIG, 1: BIG})
    assert choice.copies == {} and choice.modes == (copies.UNIQUE, copies.UNIQUE)


def test_replicas_within_one_node_keep_no_copy():
    held = ddp(2, {"a": 10})
    choice = choose(held, {0: [idx("a")], 1: []}, [0, 0], {0: BIG})
    assert choice.copies == {} and choice.modes == (copies.UNIQUE,)


def test_a_node_without_room_keeps_none():
    held = ddp(2, {"a": 100, "b": 100})
    planned = {0: [idx("a")], 1: [idx("b")]}
    # node 1 would hold 100 of its own and 100 of copies: 150 has no room for them
    choice = choose(held, planned, [0, 1], {0: BIG, 1: 150})
    assert choice.modes == (copies.DP_COPIES, copies.DEDUP)
    assert choice.copies == {0: [idx("b")]}
    assert choose(held, planned, [0, 1], {0: BIG, 1: 200}).modes[1] == copies.DP_COPIES


def test_the_room_counts_what_replicas_bring_beside_the_copies():
    """What arrives with copies is what the partner holds alone (its per-rank state), as a
    shard stores it (aligned): not a shard of the node's own size."""
    held = {r: [(idx("a"), 100), (idx(f"rng{r}"), 10)] for r in range(2)}
    planned = {0: [idx("a"), idx("rng0")], 1: [idx("rng1")]}
    # node 1: 10 of its own, 100 of copies, rank 0's 10-byte RNG state arriving in 64: 174
    assert choose(held, planned, [0, 1], {0: BIG, 1: 174}).modes[1] == copies.DP_COPIES
    assert choose(held, planned, [0, 1], {0: BIG, 1: 173}).modes[1] == copies.DEDUP
    assert choose(held, planned, [0, 1], {0: BIG, 1: BIG}).arriving == (64, 64)


def test_chunks_of_one_tensor_are_items_of_their_own():
    held = {r: [(idx("w", [0]), 8), (idx("w", [4]), 8)] for r in range(2)}
    planned = {0: [idx("w", [0])], 1: [idx("w", [4])]}
    choice = choose(held, planned, [0, 1], {0: BIG, 1: BIG})
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
    choice = choose(held, planned, [0, 1], {0: BIG, 1: BIG})
    assert choice.copies == {1: [idx("a")]}


# ------------------------------------------------ the room arriving replicas take: one count
# ``choose`` (before the save's metadata) and the room check after it (``inventory.Arrivals``)
# count what the partners' replicas bring by one rule, ``coverage.arriving_bytes``.

def recorded(choice: copies.Choice, held, planned) -> list[ItemLocation]:
    """The item locations a save planned so records with the copies ``choice`` keeps."""
    size = {copies.key_of(i): n for items in held.values() for i, n in items}
    kept: dict = {}
    for rank, indexes in choice.copies.items():
        for i in indexes:
            kept.setdefault(copies.key_of(i), []).append(rank)
    out, end = [], dict.fromkeys(held, 0)
    for rank, indexes in planned.items():
        for i in indexes:
            k = copies.key_of(i)
            places = []
            for r in kept.get(k, ()):
                places.append((r, end[r]))
                end[r] += size[k]
            out.append(ItemLocation(rank, end[rank], size[k], checksum=hash(k) & 0xFFFF,
                                    copies=tuple(places)))
            end[rank] += size[k]
    return out


class Saved:
    """One step's metadata, as ``Arrivals`` reads it from a store."""

    def __init__(self, locations: list[ItemLocation], world: int):
        self.state = StepState(3, has_metadata=True, required_ranks=tuple(range(world)),
                               world_size=world, save_id="s1",
                               copy_groups=coverage.StepItems(locations).groups())
        self._items = coverage.StepItems(locations)

    def steps(self) -> list[int]:
        return [3]

    def step_state(self, step: int) -> StepState:
        return self.state

    def items(self, step: int) -> coverage.StepItems:
        return self._items


def room_check(choice, held, planned, nodes: int, ranks_per_node: int, replicas: int) -> list[int]:
    """Per node, what the room check after the save counts as arriving: ``Arrivals`` of each
    of its ranks, with the pairing the manager uses."""
    strategy = pairing_for([""] * nodes, replicas)
    saved = Saved(recorded(choice, held, planned), nodes * ranks_per_node)
    per_node = [0] * nodes
    for rank in range(nodes * ranks_per_node):
        t = Topology(rank=rank, world_size=nodes * ranks_per_node, local_rank=rank % ranks_per_node,
                     local_world_size=ranks_per_node, node_rank=rank // ranks_per_node,
                     num_nodes=nodes)
        places = max(2, 1 + len(strategy.targets(t.node_rank, nodes)))
        arrivals = Arrivals(saved, saved, t, places, rank_sources(strategy, rank,
                                                                     ranks_per_node, nodes))
        per_node[t.node_rank] += arrivals()
    return per_node


def test_choose_counts_what_arrives_as_the_room_check_does_with_two_replicas():
    """4 nodes x 1 rank, replicas=2: each of two 4 KiB items on two nodes, 64 bytes of
    per-rank state. An item on two nodes still lacks a place and goes to a partner that
    does not hold it: node 1 receives rank 2's item and two RNG states, 4224 bytes (the
    estimate ``choose`` made before, its own state twice, was 128), so it keeps its copy
    only where all of that fits too."""
    nodes, sources = 4, every_source(pairing_for([""] * 4, 2), 4)
    held = {0: [(idx("a"), 4096), (idx("rng0"), 64)], 1: [(idx("a"), 4096), (idx("rng1"), 64)],
            2: [(idx("b"), 4096), (idx("rng2"), 64)], 3: [(idx("b"), 4096), (idx("rng3"), 64)]}
    planned = {0: [idx("a"), idx("rng0")], 1: [idx("rng1")], 2: [idx("b"), idx("rng2")],
               3: [idx("rng3")]}
    room = dict.fromkeys(range(nodes), BIG)
    choice = copies.choose(held, planned, range(nodes), room, 2, sources=sources)
    assert choice.modes == (copies.UNIQUE, copies.DP_COPIES, copies.UNIQUE, copies.DP_COPIES)
    assert choice.arriving[1] == 4096 + 64 + 64
    assert list(choice.arriving) == room_check(choice, held, planned, nodes, 1, replicas=2)
    # node 1 needs 64 of its own, 4096 of copies and 4224 arriving
    fits = copies.choose(held, planned, range(nodes), {**room, 1: 8384}, 2, sources=sources)
    assert fits.modes[1] == copies.DP_COPIES
    short = copies.choose(held, planned, range(nodes), {**room, 1: 8383}, 2, sources=sources)
    assert short.modes[1] == copies.DEDUP and 1 not in short.copies
    assert list(short.arriving) == room_check(short, held, planned, nodes, 1, replicas=2)


def test_a_node_keeping_none_leaves_others_more_to_receive():
    """4 nodes in pairs (0-1, 2-3): rank 0's item "a" is also held on node 2, "c" on node 1.
    Node 2 keeping no copy of "a" (no room) leaves it on node 0 alone, so node 0's partner,
    node 1, receives it: node 1, which had room beside its copy of "c", has none any more
    (the nodes are asked again until none changes)."""
    sources = every_source(pairing_for([""] * 4, 1), 4)
    held = {0: [(idx("a"), 4096), (idx("c"), 128)], 1: [(idx("c"), 128)],
            2: [(idx("a"), 4096)], 3: []}
    planned = {0: [idx("a"), idx("c")], 1: [], 2: [], 3: []}
    room = dict.fromkeys(range(4), BIG)
    both = copies.choose(held, planned, range(4), room, 1, sources=sources)
    assert both.modes == (copies.UNIQUE, copies.DP_COPIES, copies.DP_COPIES, copies.UNIQUE)
    assert both.arriving == (0, 0, 0, 0)  # "a" on nodes 0 and 2, "c" on 0 and 1: placed
    assert list(both.arriving) == room_check(both, held, planned, 4, 1, replicas=1)
    tight = {**room, 1: 128 + 4095, 2: 4095}
    one = copies.choose(held, planned, range(4), tight, 1, sources=sources)
    assert one.modes == (copies.UNIQUE, copies.DEDUP, copies.DEDUP, copies.UNIQUE)
    assert one.copies == {}
    assert one.arriving[1] == 4096 + 128
    assert list(one.arriving) == room_check(one, held, planned, 4, 1, replicas=1)
    # with room for "a" arriving beside its copy of "c", node 1 keeps it
    roomy = copies.choose(held, planned, range(4), {**tight, 1: 128 + 4096}, 1, sources=sources)
    assert roomy.modes[1:3] == (copies.DP_COPIES, copies.DEDUP)
    assert roomy.arriving[1] == 4096


def test_a_symmetric_ddp_job_with_one_replica_counts_what_it_counted_before():
    """2 nodes x 2 ranks, replicas=1: every rank holds the model, each its own 64-byte RNG
    state. What arrives is the partner's per-rank state (128 bytes a node), as before and as
    the room check counts it; the room a node needs is unchanged."""
    model = {f"m{i}": 1024 for i in range(4)}
    held = {r: [(idx(f), n) for f, n in model.items()] + [(idx(f"rng{r}"), 64)] for r in range(4)}
    planned = {r: [idx(f"m{r}"), idx(f"rng{r}")] for r in range(4)}
    sources = every_source(pairing_for(["", ""], 1), 2)
    choice = copies.choose(held, planned, [0, 0, 1, 1], {0: BIG, 1: BIG}, 1, sources=sources)
    assert choice.modes == (copies.DP_COPIES, copies.DP_COPIES)
    assert choice.arriving == (128, 128)
    assert list(choice.arriving) == room_check(choice, held, planned, 2, 2, replicas=1)
    # node 1: 2 x (1024 + 64) of its own, 2048 of copies, 128 arriving
    need = 2 * 1088 + 2048 + 128
    fits = copies.choose(held, planned, [0, 0, 1, 1], {0: BIG, 1: need}, 1, sources=sources)
    short = copies.choose(held, planned, [0, 0, 1, 1], {0: BIG, 1: need - 1}, 1, sources=sources)
    assert (fits.modes[1], short.modes[1]) == (copies.DP_COPIES, copies.DEDUP)
