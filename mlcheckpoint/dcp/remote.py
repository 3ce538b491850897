"""What the reader needs from other nodes: which nodes hold an item's bytes, and reads of byte
ranges from them; and ``fetch_items``, the one loop that reads items from the nodes holding
any of their places, spread over them and dealt again over the places left when a node fails
(the reader's, and the rebuild of a replaced node's shard in recovery).

Declared here, in layer 2, so the reader never imports recovery or replication (layers 3
and 4); recovery's ``Holders`` (recovery/holders.py) is the implementation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future as ConcurrentFuture
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from ..errors import ProtocolError, ShardNotFoundError
from ..integrity import copier, digests
from ..store.layout import ItemLocation
from .places import deal, places_of

log = logging.getLogger(__name__)
K = TypeVar("K", bound=Hashable)


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

    Items are dealt over the holders (``places.deal``: the nodes with the fewest bytes to
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

