"""Reading items from other nodes: where each item is (its *places*), which node serves it,
what the reader needs from those nodes (which hold an item's bytes, reads of byte ranges from
them), and ``fetch_items``, the one loop that reads items from the nodes holding any of their
places, spread over them and dealt again over the places left when a node fails (the reader's,
and the rebuild of a replaced node's shard in recovery).

An item's places are its primary location (its owner rank's shard, at the offset the global
metadata records) and the copies data parallelism kept of it in other ranks' shards
(``ItemLocation.copies``): each a (rank whose shard holds the bytes, offset in that shard).
Any node may hold a shard (its own rank's, a replica, or a partial replica that lists only
some of its owner's items), so which node holds which place is asked of the shard's manifest
on this node and of the holders elsewhere; ``places_of`` and ``deal`` only decide, and are
pure.

Declared here, in layer 2, so the reader never imports recovery or replication (layers 3
and 4); recovery's ``Holders`` (recovery/holders.py) is the implementation.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future as ConcurrentFuture
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from ..errors import ProtocolError, ShardNotFoundError
from ..integrity import copier, digests
from ..store.layout import ItemLocation

log = logging.getLogger(__name__)
K = TypeVar("K", bound=Hashable)


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


@dataclass
class RemoteRun:
    """Byte ranges ``(offset, nbytes)`` of ``owner``'s shard to read from ``node``, each
    straight into its sink (a writable uint8 array of ``nbytes``)."""

    owner: int
    node: int
    ranges: list[tuple[int, int]]
    sinks: list[np.ndarray]


class RemoteReads(Protocol):
    """Reads of shards held by other nodes, for one step being loaded."""

    def nodes_holding(self, step: int, owner: int, offset: int) -> list[int]:
        """The other nodes whose copy of ``owner``'s shard of ``step`` (the one being loaded)
        holds the item at ``offset``, in the order this rank should prefer them on a tie;
        [] when none does."""
        ...

    def read_runs(self, step: int, runs: list[RemoteRun], on_range: Callable[[int, int], None],
                  *, paced: bool = False) -> list[BaseException | None]:
        """Read every run from its node, the nodes at once, calling ``on_range(run, range)``
        as each range lands (from any thread). Returns, per run, None or the error that
        stopped it (no rank of its node could serve it: ShardNotFoundError when they answered
        that they do not hold it), once nothing writes into any sink any more. The caller
        verifies the checksums. ``paced``: the holders send within their bandwidth budget
        (background work), not at the link's speed (a load waiting for the bytes)."""
        ...


def fetch_items(remote: RemoteReads, step: int, wanted: Mapping[K, ItemLocation],
                sinks: Mapping[K, np.ndarray], nowhere: Callable[[K], str], *,
                paced: bool = False) -> dict[K, tuple[int, int, ConcurrentFuture]]:
    """Fill each wanted item's sink (``wanted``: the item's location, whose places are its
    primary and its copies) from a node that holds one of its places; per item, the rank
    whose shard it came from, that node, and its digest (each item is hashed on the copier's
    threads as soon as it lands, while the next ones arrive). The caller compares them.

    Items are dealt over the holders (``deal``: the nodes with the fewest bytes to
    serve first, so a replaced node's reads spread over all of them) and read from every
    node at once. The items of a run that fails (its node died, hung past the timeout, or
    answered that it lacks the shard) are dealt again over the places left, their copies
    included, until none is left: only then is the item lost (ShardNotFoundError, with
    ``nowhere(item)`` saying what is missing)."""
    came_from: dict[K, tuple[int, int, ConcurrentFuture]] = {}
    lacking: set[tuple[int, int]] = set()  # (rank, node): that node lacks rank's shard
    down: set[int] = set()  # nodes that failed otherwise: asked nothing more
    failures: list[str] = []
    pending = list(wanted)
    while pending:
        options = [(wanted[item].nbytes,
                    [(place, [n for n in remote.nodes_holding(step, *place)
                              if n not in down and (place[0], n) not in lacking])
                     for place in places_of(wanted[item])]) for item in pending]
        runs: dict[tuple[int, int], tuple[RemoteRun, list[K]]] = {}  # (rank, node) -> run
        for item, choice in zip(pending, deal(options), strict=True):
            if choice is None:
                tried = f"; failed: {'; '.join(failures)}" if failures else ""
                raise ShardNotFoundError(f"step {step}: {nowhere(item)} on any node{tried}")
            (rank, offset), node = choice
            run, items = runs.setdefault((rank, node), (RemoteRun(rank, node, [], []), []))
            run.ranges.append((offset, wanted[item].nbytes))
            run.sinks.append(sinks[item])
            items.append(item)
        batch = list(runs.values())

        def landed(r: int, j: int, batch: list[tuple[RemoteRun, list[K]]] = batch) -> None:
            run, items = batch[r]
            sink = sinks[items[j]]
            came_from[items[j]] = (run.owner, run.node, copier.hash_later(
                copier.Span(src=sink.ctypes.data, nbytes=sink.nbytes,
                            algorithm=digests.of(wanted[items[j]]))))

        pending = []
        errors = remote.read_runs(step, [r for r, _ in batch], landed, paced=paced)
        for (run, items), error in zip(batch, errors, strict=True):
            if error is None and all(item in came_from for item in items):
                continue
            if error is None:  # (a holder that answered "ok" must have sent every range)
                error = ProtocolError(f"the read returned before all {len(items)} items landed")
            if isinstance(error, ShardNotFoundError):
                lacking.add((run.owner, run.node))
            else:
                down.add(run.node)
            failures.append(f"node {run.node} (rank {run.owner}'s shard): {error}")
            log.warning("mlcheckpoint: reading %d items of rank %d's shard of step %d from node "
                        "%d failed (%s): reading them from another place", len(items), run.owner,
                        step, run.node, error)
            for item in items:
                came_from.pop(item, None)  # some may have landed before the failure
            pending += items
    return came_from

