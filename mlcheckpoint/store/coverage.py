"""Which places hold each item of a step: the one home of *complete* and *protected*.

A data-parallel job (DDP, HSDP's replica groups) holds the same item on several ranks. DCP
writes it once, in the shard of the rank it chose (the item's *primary*); a save may also keep
agreeing copies of it in other ranks' shards. The global metadata records both: per item, its
primary location and its copies (``ItemLocation.copies``, only copies whose checksum agrees):
the one record of copies. From it, per owner rank, its *copy groups* (``copy_groups``): the
distinct sets of other ranks whose shards hold copies of some of the owner's items, the empty
set standing for items that have no copy.

Items of one owner in one copy group are held by the same places, so a group is the unit every
question here is asked in. A node holds an item of group ``g`` of owner ``o`` when it holds
``o``'s shard whole, or a *partial replica* of it that lists every item of ``g`` (replication
sends only the items that lack places, ``Manifest.partial``), or the whole shard of a rank in
``g`` (the copy). ``Holdings`` say what each node holds of each owner's shard; from them and
the copy groups:

- ``unreadable``: owners with an item on no node (a step is *complete* where none is);
- ``fewest_places`` / ``protected``: on how many places (nodes, or failure domains where
  declared: ``place_of``) the least-held item is (a step is *protected* when its metadata and
  every item are on 1 + k places);
- ``to_send``: which of an owner's groups lack places and are not on a partner yet
  (replication sends those to it).

The store (is a step whole here?), the replicator (what must it send, and to whom?), the room
a node keeps for what arrives, and the recovery planner (is a step complete, protected?) all ask
these functions, so the rule is written once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..integrity.verify import Listing, Recorded
from .layout import ItemLocation

# owner rank -> the distinct sets of ranks whose shards hold copies of some of its items
CopyGroups = Mapping[int, Sequence[Sequence[int]]]
Group = tuple[int, ...]  # the ranks whose shards hold copies of an item (sorted; () for none)


@dataclass(frozen=True)
class Held:
    """What one place holds of one owner's shard: all of it (``items`` None), or the items a
    partial replica there lists as the step's metadata records them (their offsets in the
    owner's shard) and the copy groups all of whose items are among them. Both come from one
    look at the replica's manifest (``StepItems.held``): what counts it towards *complete*
    and *protected* (the groups) and what a reader asks of it (the items) never disagree."""

    items: frozenset[int] | None = None
    groups: frozenset[Group] = frozenset()

    @property
    def whole(self) -> bool:
        return self.items is None

    def holds(self, group: Group) -> bool:
        return self.items is None or group in self.groups

    def holds_item(self, offset: int) -> bool:
        """Whether the item at ``offset`` of the owner's shard is here."""
        return self.items is None or offset in self.items


WHOLE = Held()
# owner rank -> node (a node rank, or any name for one) -> what it holds of the owner's shard
Holdings = Mapping[int, Mapping[Any, Held]]
# A node's place: the node itself, or its failure domain where nodes declare them.
PlaceOf = Callable[[Any], Hashable]


def _itself(node: Any) -> Hashable:
    return node


def group_of(loc: ItemLocation) -> Group:
    """The copy group of the item at ``loc``: the other ranks whose shards hold a copy."""
    return tuple(sorted({rank for rank, _ in loc.copies} - {loc.rank}))


def copy_groups(locations: Iterable[ItemLocation]) -> dict[int, list[list[int]]]:
    """The copy groups of a step, from its items' locations (an owner whose items have no
    copies at all is left out: it is served by its own shard alone)."""
    groups: dict[int, set[Group]] = defaultdict(set)
    for loc in locations:
        groups[loc.rank].add(group_of(loc))
    return {owner: [list(g) for g in sorted(gs)] for owner, gs in sorted(groups.items())
            if any(gs)}


def groups_of(owner: int, groups: CopyGroups) -> list[Group]:
    """The copy groups of ``owner``'s items (``[()]``: none of them has a copy)."""
    return [tuple(g) for g in groups.get(owner) or [()]]


def holders(owner: int, group: Group, holdings: Holdings) -> set[Hashable]:
    """The nodes holding the items of ``owner`` in copy group ``group``: its shard whole or
    a partial replica listing that group, or the whole shard of a rank keeping their copies.
    (A partial replica never carries the copies its owner keeps of other ranks' items.)"""
    out = {n for n, held in holdings.get(owner, {}).items() if held.holds(group)}
    for rank in group:
        out.update(n for n, held in holdings.get(rank, {}).items() if held.whole)
    return out


def unreadable(required: Iterable[int], groups: CopyGroups, holdings: Holdings) -> list[int]:
    """Owners among ``required`` with an item on no node."""
    return [owner for owner in required
            if any(not holders(owner, g, holdings) for g in groups_of(owner, groups))]


def fewest_places(owner: int, groups: CopyGroups, holdings: Holdings,
                  place_of: PlaceOf = _itself) -> int:
    """On how many distinct places (``place_of`` each node) the least-held item of ``owner``
    is."""
    return min(len({place_of(n) for n in holders(owner, g, holdings)})
               for g in groups_of(owner, groups))


def protected(required: Iterable[int], groups: CopyGroups, holdings: Holdings, places: int,
              metadata_nodes: Iterable[Hashable], place_of: PlaceOf = _itself) -> bool:
    """Whether the metadata and every item of the required owners are on ``places`` places:
    the rule of a *protected* step."""
    return (len({place_of(n) for n in metadata_nodes}) >= places
            and all(fewest_places(owner, groups, holdings, place_of) >= places
                    for owner in required))


def to_send(owner: int, groups: CopyGroups, holdings: Holdings, places: int, target: Hashable,
            place_of: PlaceOf = _itself) -> list[Group]:
    """The copy groups of ``owner`` that lack places (on fewer than ``places``) and that the
    node ``target`` does not hold yet: what a replica there must carry. A node stores an item
    once: what it holds as a copy is never sent to it again."""
    out = []
    for g in groups_of(owner, groups):
        nodes = holders(owner, g, holdings)
        if len({place_of(n) for n in nodes}) < places and target not in nodes:
            out.append(g)
    return out


def as_saved(node_of_rank: Mapping[int, Hashable]) -> dict[int, dict[Any, Held]]:
    """Holdings of a save before any replica: each rank's shard whole on its own node."""
    return {rank: {node: WHOLE} for rank, node in node_of_rank.items()}


class StepItems:
    """The primary items of each owner of one save, by copy group (from its metadata's item
    locations): which manifest items a group is, and how many bytes."""

    def __init__(self, locations: Iterable[ItemLocation]):
        # (plain dicts: a store, caches included, is pickled into DCP's checkpoint process)
        self.by_owner: dict[int, dict[Group, list[ItemLocation]]] = {}
        for loc in locations:
            self.by_owner.setdefault(loc.rank, {}).setdefault(group_of(loc), []).append(loc)

    def groups(self) -> dict[int, list[list[int]]]:
        """The copy groups of the save (``copy_groups``: an owner none of whose items has a
        copy is left out)."""
        return {owner: [list(g) for g in sorted(by_group)]
                for owner, by_group in sorted(self.by_owner.items()) if any(by_group)}

    def of(self, owner: int, group: Group) -> list[ItemLocation]:
        """``owner``'s primary items in copy group ``group``."""
        return list(self.by_owner.get(owner, {}).get(group, ()))

    def nbytes(self, owner: int, groups: Iterable[Group]) -> int:
        """The bytes of ``owner``'s items in ``groups``."""
        return sum(loc.nbytes for g in groups for loc in self.of(owner, g))

    def held(self, owner: int, listed: Iterable[Recorded]) -> Held:
        """What a partial replica of ``owner``'s shard whose manifest lists ``listed`` holds:
        the items it lists as this save recorded them (the same place, size and checksum),
        and the groups it lists every item of. A group listed only in part counts as not
        held: replication sends groups whole."""
        listing = Listing(listed)
        by_group = self.by_owner.get(owner, {})
        items = frozenset(loc.offset for locs in by_group.values() for loc in locs
                          if listing.holds(loc))
        return Held(items, frozenset(g for g, locs in by_group.items()
                                     if locs and all(loc.offset in items for loc in locs)))


# Bounds on what a header may carry (a corrupt or hostile file is refused, not parsed on).
MAX_OWNERS = 1 << 20
