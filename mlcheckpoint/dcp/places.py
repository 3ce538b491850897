"""Where the reader takes each item from: a place on this node first, else the holder with
the fewest bytes to serve.

An item's *places* are its primary location (its owner rank's shard, at the offset the global
metadata records) and the copies data parallelism kept of it in other ranks' shards
(``ItemLocation.copies``): each a (rank whose shard holds the bytes, offset in that shard).
Any node may hold a shard (its own rank's, a replica, or a partial replica that lists only
some of its owner's items), so which node holds which place is asked of the shard's manifest
here and of the holders elsewhere; these functions only decide, and are pure.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from ..store.layout import ItemLocation

Place = tuple[int, int]  # (rank whose shard holds the bytes, offset in that shard)


def places_of(loc: ItemLocation) -> list[Place]:
    """The item's places, its primary first."""
    return [(loc.rank, loc.offset), *((rank, offset) for rank, offset in loc.copies if rank != loc.rank)]


def deal(items: Sequence[tuple[int, Sequence[tuple[Place, Sequence[int]]]]]
         ) -> list[tuple[Place, int] | None]:
    """For each item ``(nbytes, [(place, the other nodes holding it, in this rank's order of
    preference), ...])`` (places in order of preference), the place and node to read it from.

    Items are dealt largest first, each to the node with the fewest bytes dealt so far among
    those holding any of its places (a tie goes to the node named first), and from that node
    its first place: a replaced node's reads spread over every node that can serve them, and
    one item comes from one node, so a checksum mismatch names that one copy. None: no node
    holds any of its places."""
    load: dict[int, int] = defaultdict(int)
    out: list[tuple[Place, int] | None] = [None] * len(items)
    for i in sorted(range(len(items)), key=lambda i: -items[i][0]):
        nbytes, options = items[i]
        rank_of: dict[int, int] = {}  # node -> its position in the order the options name nodes
        for place, nodes in options:
            for node in nodes:
                rank_of.setdefault(node, len(rank_of))
        if not rank_of:
            continue
        node = min(rank_of, key=lambda n: (load[n], rank_of[n]))
        place = next(p for p, nodes in options if node in nodes)
        load[node] += nbytes
        out[i] = (place, node)
    return out
