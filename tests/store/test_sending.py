"""store/coverage.py plan_push: what each partner is sent of a shard (pure): only the items
that lack their places, from the save's metadata here."""

from __future__ import annotations

from mlcheckpoint.store import coverage
from mlcheckpoint.store.coverage import (
    StepItems,
    arriving_bytes,
    plan_push,
    pushed_bytes,
)
from mlcheckpoint.store.inventory import StepState
from mlcheckpoint.store.layout import ItemLocation
from mlcheckpoint.store.manifest import Manifest, ManifestItem
from mlcheckpoint.topology import Topology


def topo(rank: int, domains: tuple[str, ...] = ()) -> Topology:
    # 4 nodes x 1 rank
    return Topology(rank=rank, world_size=4, local_world_size=1, node_rank=rank, num_nodes=4,
                    domains=domains)


def save(locations: list[ItemLocation], save_id: str = "s1") -> tuple[StepState, StepItems]:
    st = StepState(3, has_metadata=True, required_ranks=(0, 1, 2, 3), world_size=4,
                   save_id=save_id, copy_groups=coverage.StepItems(locations).groups())
    return st, StepItems(locations)


def shard(rank: int, locations: list[ItemLocation], extra: list[ManifestItem] = ()) -> Manifest:
    """``rank``'s manifest: its primaries in ``locations``, and ``extra`` (copies it keeps)."""
    items = [ManifestItem(f"{rank}@{loc.offset}", loc.offset, loc.nbytes, loc.checksum)
             for loc in locations if loc.rank == rank] + list(extra)
    return Manifest("j", 3, rank, max((i.offset + i.nbytes for i in items), default=0), items,
                    world_size=4, save_id="s1")


def item(rank, offset, nbytes, *copies):
    return ItemLocation(rank, offset, nbytes, checksum=rank * 1000 + offset,
                        copies=tuple((r, 4096) for r in copies))


# DDP over 4 nodes x 1 rank: rank 0 is primary of the model (copies on every other node) and
# every rank keeps its own RNG state (no copies).
DDP = [item(0, 0, 4096, 1, 2, 3), item(0, 4096, 64), item(1, 0, 64), item(2, 0, 64),
       item(3, 0, 64)]


def test_a_ddp_rank_sends_only_its_own_entries():
    st, items = save(DDP)
    m = shard(0, DDP)
    plan = plan_push(m, st, items, "s1", topo(0), places=2, targets=[1])
    assert [it.offset for it in plan[1]] == [4096]  # its RNG entry; the model is on node 1
    assert pushed_bytes(m, plan[1]) == 64
    copy = ManifestItem("copy of 0@0", 64, 4096, 0)  # rank 1 keeps a copy of rank 0's model
    m1 = shard(1, DDP, [copy])
    plan = plan_push(m1, st, items, "s1", topo(1), places=2, targets=[2])
    assert [it.offset for it in plan[2]] == [0]  # its RNG only: never the copy it keeps


def test_a_shard_whose_items_all_lack_places_goes_whole_and_a_covered_one_sends_nothing():
    fsdp = [item(r, 0, 128) for r in range(4)] + [item(r, 128, 64) for r in range(4)]
    st, items = save(fsdp)
    m = shard(2, fsdp)
    assert plan_push(m, st, items, "s1", topo(2), 2, [3]) == {3: None}  # whole
    assert pushed_bytes(m, None) == m.data_bytes
    covered = [item(0, 0, 128, 1)]
    st, items = save(covered)
    assert plan_push(shard(0, covered), st, items, "s1", topo(0), 2, [1]) == {1: []}


def test_one_uncovered_fsdp_item_alone_is_sent():
    locs = [item(0, 0, 128, 1), item(0, 128, 128, 1), item(0, 256, 8)]
    st, items = save(locs)
    plan = plan_push(shard(0, locs), st, items, "s1", topo(0), 2, [2])
    assert [it.offset for it in plan[2]] == [256]


def test_what_a_partner_holds_as_a_copy_is_not_sent_to_it():
    # rank 0's item is copied on node 1 only; three places wanted (replicas=2): partners 1, 2
    locs = [item(0, 0, 128, 1), item(0, 128, 64, 1, 2)]
    st, items = save(locs)
    plan = plan_push(shard(0, locs), st, items, "s1", topo(0), 3, [1, 2])
    assert plan[1] == [] and [it.offset for it in plan[2]] == [0]  # 128 is on 3 nodes already


def test_a_copy_in_the_same_failure_domain_adds_no_place():
    locs = [item(0, 0, 128, 1), item(2, 0, 128, 3)]
    st, items = save(locs)
    domains = ("rack-a", "rack-a", "rack-b", "rack-c")
    assert plan_push(shard(0, locs), st, items, "s1", topo(0, domains), 2, [2]) == {2: None}
    assert plan_push(shard(2, locs), st, items, "s1", topo(2, domains), 2, [0]) == {0: []}


def test_another_save_or_no_metadata_here_sends_the_whole_shard():
    st, items = save(DDP)
    assert plan_push(shard(0, DDP), st, items, "other", topo(0), 2, [1]) == {1: None}
    assert plan_push(shard(0, DDP), StepState(3), None, "s1", topo(0), 2, [1]) == {1: None}
    # a manifest listing none of what the metadata says it holds: whole, not guessed at
    stray = Manifest("j", 3, 0, 8, [ManifestItem("x", 0, 8, 1)], world_size=4, save_id="s1")
    assert plan_push(stray, st, items, "s1", topo(0), 2, [1]) == {1: None}
    # one listing the RNG entry's place with other bytes: the shard does not hold that item
    # (the one check, integrity/verify.py Listing), so a partial replica of it is not guessed
    # at either (a partner would count an item it does not hold)
    m = shard(0, DDP)
    m.items = [it if it.offset != 4096 else ManifestItem(it.key, 4096, 64, it.checksum + 1)
               for it in m.items]
    assert plan_push(m, st, items, "s1", topo(0), 2, [1]) == {1: None}


def test_arriving_bytes_are_what_the_sources_send_this_node():
    _, items = save(DDP)
    node_of = topo(1).node_of
    assert arriving_bytes(items, {1: [0]}, node_of, 2) == {1: 64}  # rank 0's RNG entry
    assert arriving_bytes(items, {1: [0, 2]}, node_of, 2) == {1: 128}
    fsdp = [item(0, 0, 100), item(0, 128, 28)]
    _, items = save(fsdp)
    assert arriving_bytes(items, {1: [0]}, node_of, 2) == {1: 128 + 64}  # whole, aligned items
