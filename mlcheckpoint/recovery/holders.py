"""Reads from other nodes during one resume attempt, and the rebuild of a replaced node's shard.

Every read of bytes this node lacks goes through ``Holders``: the byte ranges the reader
streams into the model (``read_ranges``, the ``dcp.remote.RemoteReads`` protocol), the step's
metadata for a node without it (``fetch_metadata``), and, after the load, the whole shard of a
replaced node's own rank (``rebuild``). Which holder to ask, and in what order, is decided in
one place: ``holder_order``. When a shard is on several other nodes (``replicas`` > 1, or
a node that kept its own copy), ``read_ranges`` deals its ranges (whole stored items) over
all of them (``stripe_over_holders``), so that no single survivor serves everything.

The resume waits for the first two, so the holder sends them at the link's full speed; the
rebuild runs in the background and is paced by the holder's bandwidth budget (``paced``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from .._words import plural
from ..errors import MLCheckpointError, ShardNotFoundError
from ..replication.core.streams import run_streams
from ..replication.core.transport import Transport
from ..store import LocalStore
from ..store.coverage import Group
from ..topology import Topology
from .planner import Decision

log = logging.getLogger(__name__)
T = TypeVar("T")


def holder_order(plan: Decision, topology: Topology, owner: int | None,
                 group: Group | None = None) -> list[int]:
    """Ranks on other nodes to ask for ``owner``'s shard (None: the metadata), in order: the
    source the plan chose for this node first (it balanced the bytes each holder serves),
    then every other holder, starting at an offset set by this rank so that the readers of
    one node spread over the holders. With ``group`` (items of that copy group are wanted),
    the ranks of nodes whose partial replica of the shard holds the group are holders too.
    A pure function of the plan and who asks."""
    node_of = topology.node_of
    here = topology.node_rank
    planned = [f.src_rank for f in plan.fetches if f.owner == owner and node_of(f.dst_rank) == here]
    held = plan.metadata_holders if owner is None else plan.holders.get(owner, [])
    if owner is not None and group is not None:
        held = held + [r for r, groups in plan.partial_holders.get(owner, []) if group in groups]
    others = [r for r in held if node_of(r) != here]
    start = topology.rank % len(others) if others else 0
    return list(dict.fromkeys(planned + others[start:] + others[:start]))


def stripe_over_holders(order: list[int], ranges: list[tuple[int, int]], local_world_size: int
                        ) -> list[tuple[list[int], list[int]]]:
    """Deal ``ranges`` (by index) over the holder nodes in ``order``, so that each serves
    about the same bytes: [(a run's range indices, ranks to ask for it, in order)]. Each run
    asks one node's first rank in ``order`` first, then the other holders in ``order``
    (``holder_order``'s fallback). Whole ranges are dealt, largest first to the node with the
    fewest bytes so far: a range is one stored item, checked as a whole, so a checksum
    mismatch names the one node it came from. A pure function."""
    first_per_node: dict[int, int] = {}  # node -> the first of its ranks in ``order``
    for rank in order:
        first_per_node.setdefault(rank // local_world_size, rank)
    sources = list(first_per_node.values())
    if len(sources) < 2 or len(ranges) < 2:
        return [(list(range(len(ranges))), order)]
    dealt: list[list[int]] = [[] for _ in sources]
    load = [0] * len(sources)
    for i in sorted(range(len(ranges)), key=lambda i: -ranges[i][1]):
        j = min(range(len(sources)), key=lambda j: (load[j], len(dealt[j]), j))
        dealt[j].append(i)
        load[j] += ranges[i][1]
    return [(sorted(indices), [src] + [r for r in order if r != src])
            for indices, src in zip(dealt, sources, strict=True) if indices]


class Holders:
    """The nodes that hold the step ``plan`` loads, seen from this rank.

    One per resume attempt (a plan names its step, save and holders). ``bytes_fetched``
    counts the shard bytes read from peers for the load, ``bytes_served`` the same per shard
    (its owner rank) and node they came from (how the reads spread over the holders).
    """

    def __init__(self, transport: Transport, store: LocalStore, topology: Topology, plan: Decision):
        assert plan.step is not None, "holders serve a step loaded from memory"
        self.transport, self.store, self.topo, self.plan = transport, store, topology, plan
        self.step: int = plan.step
        self.bytes_served: dict[int, dict[int, int]] = {}  # owner -> node -> bytes

    @property
    def bytes_fetched(self) -> int:
        return sum(n for by_node in self.bytes_served.values() for n in by_node.values())

    def read_ranges(self, step: int, owner: int, ranges: list[tuple[int, int]],
                    sinks: list[np.ndarray], on_range: Callable[[int], None],
                    group: Group | None = None) -> list[int]:
        """Stream byte ranges of ``owner``'s shard straight into ``sinks``, spread over the
        nodes that hold it (read at once, each its own run of ranges); return the node each
        range came from. Nothing lands in this node's store (see ``rebuild``)."""
        self._check_step(step)
        came_from = [-1] * len(ranges)
        lock = threading.Lock()

        def read_run(run: tuple[list[int], list[int]]) -> None:
            indices, order = run
            nbytes, src = self._from_first_that_serves(
                owner, lambda src: self.transport.read_items(
                    src, step, owner, [ranges[i] for i in indices], [sinks[i] for i in indices],
                    lambda j: on_range(indices[j]), paced=False), order=order)
            node = self.topo.node_of(src)
            with lock:
                by_node = self.bytes_served.setdefault(owner, {})
                by_node[node] = by_node.get(node, 0) + nbytes
                for i in indices:
                    came_from[i] = node

        runs = stripe_over_holders(holder_order(self.plan, self.topo, owner, group), ranges,
                                   self.topo.local_world_size)
        errors = run_streams(read_run, runs)  # returns once no run writes into the sinks
        if errors:
            raise errors[0]
        nodes = sorted(set(came_from))
        log.info("mlcheckpoint: read %s of rank %d's shard of step %d from %s %s",
                 plural(len(ranges), "range"), owner, step, "node" if len(nodes) == 1 else "nodes", nodes)
        return came_from

    def has_holders(self, step: int, owner: int, group: Group | None = None) -> bool:
        """Whether another node holds ``owner``'s shard of the step whole, or, with ``group``,
        a partial replica of it holding that group (``RemoteReads``): when none does, the
        reader reads the items from their copies."""
        self._check_step(step)
        return bool(holder_order(self.plan, self.topo, owner, group))

    def fetch_metadata(self) -> None:
        """Pull the step's global metadata into this node's store."""
        with self.store.fetch_lock(self.step, None):
            _, src = self._from_first_that_serves(
                None, lambda src: self.transport.fetch_metadata(src, self.step, paced=False))
        log.info("mlcheckpoint: fetched the metadata of step %d from rank %d", self.step, src)

    def rebuild(self, owner: int) -> bool:
        """Fetch ``owner``'s whole shard into this node's store, verified and committed, so
        replication can protect it again (a replaced node's own shard, after the load).
        Returns False when the shard is here already, or on no node at all (its items were
        read from their copies; the next save writes it again)."""
        if owner in self.plan.through_copies:
            log.info("mlcheckpoint: rank %d's shard of step %d is on no node (its items were read "
                     "from copies): not rebuilt; the next save protects them again", owner, self.step)
            return False
        with self.store.fetch_lock(self.step, owner):
            if owner in self.store.step_state(self.step).ranks_of(self.plan.save_id):
                return False
            _, src = self._from_first_that_serves(
                owner, lambda src: self.transport.fetch_shard(src, self.step, owner, paced=True))
        log.info("mlcheckpoint: rebuilt rank %d's shard of step %d from rank %d", owner, self.step, src)
        return True

    def _from_first_that_serves(self, owner: int | None, read: Callable[[int], T], *,
                                order: list[int] | None = None) -> tuple[T, int]:
        """``read(src)`` from each holder of ``owner``'s shard in turn (``order``, else
        ``holder_order``'s) until one succeeds."""
        errors = []
        for src in holder_order(self.plan, self.topo, owner) if order is None else order:
            try:
                return read(src), src
            except (MLCheckpointError, OSError) as e:
                errors.append(f"rank {src}: {e}")
        what = "the metadata" if owner is None else f"rank {owner}'s shard"
        raise ShardNotFoundError(f"no holder could serve {what} of step {self.step}: "
                                 f"{errors or 'no other node holds it'}")

    def _check_step(self, step: int) -> None:
        if step != self.step:
            raise ShardNotFoundError(f"asked for step {step} while loading step {self.step}")
