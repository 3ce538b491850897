"""Which places hold each item of a step: the one home of *complete* and *protected*.

A data-parallel job (DDP, HSDP's replica groups) holds the same item on several ranks. DCP
writes it once, in the shard of the rank it chose (the item's *primary*); a save may also keep
agreeing copies of it in other ranks' shards. The global metadata records both: per item, its
primary location and its copies (``ItemLocation.copies``, only copies whose checksum agrees):
the one record of copies. From it, per owner rank, its *copy groups* (``StepItems.groups``): the
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
- ``lacking``: which of an owner's groups lack places, and the nodes holding each
  (replication sends a partner those it does not hold yet).

The store (is a step whole here?), the replicator (what must it send, and to whom?
``plan_push``), the room a node keeps for what arrives (``arriving_bytes``: the room check,
``inventory.Arrivals``, after a save; ``dcp/copies.py`` ``choose`` at it, before any
metadata), and the recovery planner (is a step complete, protected?) all ask these functions,
so the rule is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..integrity.verify import Listing, Recorded
from ..topology import Topology
from .layout import ItemLocation
from .manifest import Manifest, ManifestItem
from .shards import align

if TYPE_CHECKING:
    from .inventory import StepState  # (which imports this module)

Group = tuple[int, ...]  # the ranks whose shards hold copies of an item (sorted; () for none)
# owner rank -> the distinct groups of its items (an owner none of whose items has a copy may
# be left out)
CopyGroups = Mapping[int, Sequence[Group]]


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


def groups_of(owner: int, groups: CopyGroups) -> Sequence[Group]:
    """The copy groups of ``owner``'s items (``[()]``: none of them has a copy)."""
    return groups.get(owner) or [()]


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


def lacking(owner: int, groups: CopyGroups, holdings: Holdings, places: int,
            place_of: PlaceOf = _itself) -> list[tuple[Group, set[Hashable]]]:
    """The copy groups of ``owner`` on fewer than ``places`` places, each with the nodes
    holding it. What a node is sent: those of them it does not hold (a node stores an item
    once: what it holds as a copy is never sent to it again)."""
    out = []
    for g in groups_of(owner, groups):
        nodes = holders(owner, g, holdings)
        if len({place_of(n) for n in nodes}) < places:
            out.append((g, nodes))
    return out


def as_saved(owner: int, groups: CopyGroups,
             node_of: Callable[[int], Hashable]) -> dict[int, dict[Any, Held]]:
    """Where the owner's items are before any replica (``Holdings``): its own shard, and the
    shards of the ranks keeping copies of them, each whole on its rank's node."""
    ranks = {owner, *(r for g in groups_of(owner, groups) for r in g)}
    return {r: {node_of(r): WHOLE} for r in ranks}


class StepItems:
    """The primary items of each owner of one save, by copy group (from its metadata's item
    locations): which manifest items a group is, and how many bytes."""

    def __init__(self, locations: Iterable[ItemLocation]):
        # (plain dicts: a store, caches included, is pickled into DCP's checkpoint process)
        self.by_owner: dict[int, dict[Group, list[ItemLocation]]] = {}
        for loc in locations:
            self.by_owner.setdefault(loc.rank, {}).setdefault(group_of(loc), []).append(loc)

    def groups(self) -> dict[int, list[Group]]:
        """The copy groups of the save, per owner (an owner none of whose items has a copy is
        left out: it is served by its own shard alone)."""
        return {owner: sorted(by_group)
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
        items: set[int] = set()
        groups: set[Group] = set()
        for g, locs in self.by_owner.get(owner, {}).items():
            # Each item asked as itself: an offset does not name an item (an empty tensor
            # shares the next item's), so a group counts only the items the replica holds.
            held = [listing.holds(loc) for loc in locs]
            items.update(loc.offset for loc, ok in zip(locs, held, strict=True) if ok)
            if locs and all(held):
                groups.add(g)
        return Held(frozenset(items), frozenset(groups))


# ---------------------------------------------------------------------------- what is sent
# What replication sends of one rank's shard, partner by partner: only the items that lack
# their places. A shard whose every item lacks its places goes whole, as before copies
# existed; one whose items all have them sends nothing. So a DDP job sends only its per-rank
# entries (an RNG state, a data loader's position), and an FSDP job with one uncovered item
# only that item, as a partial replica at the items' own offsets (``Manifest.only``).

# What one partner gets: None, the whole shard; [], nothing; else these items (a partial replica)
Push = list[ManifestItem] | None


def plan_push(m: Manifest, st: StepState, items: StepItems | None, save_id: str,
              topology: Topology, places: int, targets: Sequence[int]) -> dict[int, Push]:
    """Per partner rank in ``targets``, what to send of this rank's shard ``m`` of save
    ``save_id``, from the metadata of that save here (``st``, ``items``). Without it (rank 0
    sends it to every node before naming a round, ``Replicator._propose_next``), the whole
    shard goes to everyone."""
    whole: dict[int, Push] = dict.fromkeys(targets)
    if st.save_id != save_id or st.required_ranks is None or items is None:
        return whole
    owner, groups = m.rank, st.copy_groups
    lack = lacking(owner, groups, as_saved(owner, groups, topology.node_of), places,
                   topology.place_of_node)
    listing = Listing(m.items)
    out: dict[int, Push] = {}
    for peer in targets:
        node = topology.node_of(peer)
        locs = [loc for g, nodes in lack if node not in nodes for loc in items.of(owner, g)]
        if not listing.holds_all(locs):
            return whole  # the manifest and the metadata disagree: send what is certain
        chosen = [listing.listed(o) for o in sorted({loc.offset for loc in locs})]
        # (a rank that holds no item of its own, or none lacking places, sends nothing)
        out[peer] = None if len(chosen) == len(m.items) else chosen
    return out


def pushed_bytes(m: Manifest, push: Push) -> int:
    """The bytes ``push`` sends of shard ``m``."""
    return m.data_bytes if push is None else sum(it.nbytes for it in push)


def arriving_bytes(items: StepItems, sources: Mapping[Any, Iterable[int]],
                   node_of: Callable[[int], Hashable], places: int,
                   place_of: PlaceOf = _itself) -> dict[Any, int]:
    """Per node in ``sources`` (a node -> the ranks whose shards it keeps replicas of), the
    room those replicas take there: the bytes, each item aligned as a shard stores it, of the
    items ``lacking`` sends it (the rule their senders follow, ``plan_push``): those of a save
    laid out as ``items`` (each on its owner's node and the nodes of the ranks keeping copies
    of it, ``node_of`` each rank) that lack places and that the node does not hold.

    The one rule of that room, asked with what each side knows: the room check after a save
    (``inventory.Arrivals``) with the save's metadata; ``dcp/copies.py`` ``choose``, before
    any, with the locations the copies it would keep make."""
    groups = items.groups()
    # per owner, its groups lacking places: (group, the nodes holding it, aligned bytes)
    short: dict[int, list[tuple[Group, set[Hashable], int]]] = {}
    out: dict[Any, int] = {}
    for node, owners in sources.items():
        total = 0
        for owner in owners:
            if owner not in short:
                holdings = as_saved(owner, groups, node_of)
                short[owner] = [(g, nodes, sum(align(loc.nbytes) for loc in items.of(owner, g)))
                                for g, nodes in lacking(owner, groups, holdings, places, place_of)]
            total += sum(n for _, nodes, n in short[owner] if node not in nodes)
        out[node] = total
    return out
