"""Which shards can serve an owner's items: the copies that data parallelism keeps.

A data-parallel job (DDP, HSDP's replica groups) holds the same item on several ranks. DCP
writes it once, in the shard of the rank it chose (the item's *primary*); a save may also keep
agreeing copies of it in other ranks' shards. The global metadata records both: per item, its
primary location and its copies (``ItemLocation.copies``, only copies whose checksum agrees),
and, per owner rank, its *copy groups* (``MetadataHeader.copy_groups``): the distinct sets of
other ranks whose shards hold copies of some of the owner's items, an empty set standing for
items that have no copy.

From the copy groups alone these pure functions answer whether an owner's items can all be
read from a set of available shards, and on how many places each of them is held. The store
(is a step whole here?), the replicator (does a shard need sending?) and the recovery planner
(is a step complete, protected?) ask them, so the rule is written once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence

from .layout import ItemLocation

# owner rank -> the distinct sets of ranks whose shards hold copies of some of its items
CopyGroups = Mapping[int, Sequence[Sequence[int]]]


def copy_groups(locations: Iterable[ItemLocation]) -> dict[int, list[list[int]]]:
    """The copy groups of a step, from its items' locations (an owner whose items have no
    copies at all is left out: it is served by its own shard alone)."""
    groups: dict[int, set[tuple[int, ...]]] = defaultdict(set)
    for loc in locations:
        groups[loc.rank].add(tuple(sorted({rank for rank, _ in loc.copies} - {loc.rank})))
    return {owner: [list(g) for g in sorted(gs)] for owner, gs in sorted(groups.items())
            if any(gs)}


def unreadable(required: Iterable[int], groups: CopyGroups, available: Collection[int]) -> list[int]:
    """Owners among ``required`` with an item in none of the ``available`` shards (neither
    the owner's own shard nor a shard holding a copy of it)."""
    missing = []
    for owner in required:
        if owner in available:
            continue
        owner_groups = groups.get(owner) or [()]
        if any(not any(rank in available for rank in g) for g in owner_groups):
            missing.append(owner)
    return missing


def fewest_places(owner: int, groups: CopyGroups,
                  places_of: Callable[[int], Collection[Hashable]]) -> int:
    """On how many distinct places (nodes, or failure domains) the least-held item of
    ``owner`` is: ``places_of(rank)`` names the places holding ``rank``'s shard (its own node,
    and every node a replica of it reached)."""
    own = set(places_of(owner))
    return min(len(own.union(*(places_of(rank) for rank in g)))
               for g in (groups.get(owner) or [()]))


def to_header(groups: CopyGroups) -> dict[str, list[list[int]]]:
    """Copy groups as the metadata header's JSON keeps them (keys are strings)."""
    return {str(owner): [list(g) for g in gs] for owner, gs in groups.items()}


def from_header(raw: object) -> dict[int, list[list[int]]]:
    """Copy groups from a metadata header (a peer's bytes: checked); raises ValueError."""
    if not isinstance(raw, dict) or len(raw) > MAX_OWNERS:
        raise ValueError("malformed copy groups")
    out: dict[int, list[list[int]]] = {}
    for key, gs in raw.items():
        if not isinstance(key, str) or not key.isdigit() or not isinstance(gs, list):
            raise ValueError(f"malformed copy groups of {key!r}")
        if len(gs) > MAX_GROUPS or not all(
                isinstance(g, list) and all(isinstance(r, int) and not isinstance(r, bool)
                                            and r >= 0 for r in g) for g in gs):
            raise ValueError(f"malformed copy groups of rank {key}")
        out[int(key)] = [list(g) for g in gs]
    return out


# Bounds on what a header may carry (a corrupt or hostile file is refused, not parsed on).
MAX_OWNERS = 1 << 20
MAX_GROUPS = 1 << 12
