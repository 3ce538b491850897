"""Which rank of each node keeps a copy of a replicated item: data parallelism's copies.

A data-parallel job (DDP, HSDP's replica groups) holds the same item on several ranks, often
on several nodes. DCP's planner writes each such item once, in the shard of the rank it
chooses (the item's *primary*). Every other node that holds the item already has its bytes
in memory: keeping one copy there, in the shard of one of its ranks, puts the item on two
nodes without sending a byte, so replication need not send it (``store/coverage.py`` counts
the places; the replicator skips a shard whose items are all on enough of them).

``choose`` is the pure decision, made once per save on DCP's coordinator
(``MemoryStorageWriter.prepare_global_plan``) from every rank's full item list (before DCP
de-duplicated it), the de-duplicated plans, the node of each rank and each node's room:

- a node keeps each item it holds but whose primary is elsewhere once (one rank: the one with
  the fewest bytes so far, lowest rank on a tie), never per rank;
- a node whose own items, copies and what the replicas of its sources' shards then bring
  would not fit its room keeps none (``dedup`` mode): its items reach other nodes by
  replication, as without copies. What arrives is the room check's own count
  (``store/coverage.py`` ``arriving_bytes``: the items that lack places, aligned), asked over
  the locations the copies would make; a node that keeps none adds no place, which can leave
  another node more to receive, so the question is asked again until no node changes.

The records that travel in DCP's plans (``LocalItems`` up, ``PlanData`` down) and in its write
results (``KeptCopy``) live here too.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from torch.distributed.checkpoint.metadata import MetadataIndex

from .._messages import plural
from ..integrity.verify import records_agree
from ..store.coverage import StepItems, arriving_bytes
from ..store.layout import ItemLocation

log = logging.getLogger(__name__)

DP_COPIES = "dp-copies"  # the node keeps a copy of each replicated item it holds
DEDUP = "dedup"  # too little room: it keeps none; DCP's de-duplication plus replication
UNIQUE = "unique"  # it holds no item whose primary is on another node: nothing to keep

Key = tuple[str, tuple[int, ...] | None]  # an item's identity: FQN and chunk offset


def key_of(index: MetadataIndex) -> Key:
    """An item's identity across ranks (``MetadataIndex.index`` is only a hint)."""
    return index.fqn, None if index.offset is None else tuple(index.offset)


@dataclass(frozen=True)
class CopyPolicy:
    """What the writer needs to offer copies (``CheckpointManager`` makes one when the job
    replicates across nodes).

    Args:
        node_of_rank: the node of each rank of the save's process group, in rank order.
        room: the bytes one step of this node's shards may take (asked at each save).
        sources: per node, the nodes whose shards it keeps replicas of (the pairing's: what
            they bring counts against a node's room beside its own items and its copies).
        replicas: how many partner nodes keep replicas of each node's shards.
        place_of_node: per node, where what it holds counts as one place (its failure domain
            where it named one, ``Topology.place_of_node``); () each node itself.
    """

    node_of_rank: tuple[int, ...]
    room: Callable[[], int]
    sources: tuple[tuple[int, ...], ...]
    replicas: int = 1
    place_of_node: tuple[Hashable, ...] = ()
    # which nodes kept copies at the last save planned here (the coordinator's): log and stats
    modes: ModeLog = field(default_factory=lambda: ModeLog(), compare=False)


@dataclass(frozen=True)
class LocalItems:
    """One rank's offer, in its local plan's ``storage_data``: every item it holds (before
    DCP de-duplicates), with its bytes (0 for a byte item: its size is not known yet)."""

    node: int
    room: int
    items: tuple[tuple[MetadataIndex, int], ...]


@dataclass(frozen=True)
class PlanData:
    """The coordinator's word to one rank, in its final plan's ``storage_data``: the save id,
    the items this rank keeps a copy of, and each node's mode (for the log and ``stats``)."""

    save_id: str
    copies: tuple[MetadataIndex, ...] = ()
    modes: tuple[str, ...] = ()


@dataclass(frozen=True)
class KeptCopy:
    """A write result's ``storage_data`` for a copy (a primary's is its ItemLocation): the
    coordinator attaches it to the primary's location if the checksums agree."""

    location: ItemLocation


@dataclass(frozen=True)
class Choice:
    """``choose``'s answer: per rank the items it keeps a copy of; per node its mode."""

    copies: dict[int, list[MetadataIndex]]
    modes: tuple[str, ...]
    copy_bytes: tuple[int, ...]  # per node, the bytes of the copies it keeps
    # per node, the bytes its sources' replicas bring with these copies (the room check's)
    arriving: tuple[int, ...] = ()


def choose(held: Mapping[int, Sequence[tuple[MetadataIndex, int]]],
           planned: Mapping[int, Sequence[MetadataIndex]], node_of_rank: Sequence[int],
           room: Mapping[int, int], replicas: int = 1, *, sources: Sequence[Sequence[int]],
           place_of_node: Sequence[Hashable] = ()) -> Choice:
    """Choose the copy keepers of one save.

    Args:
        held: per rank, every item it holds and its bytes (its local plan).
        planned: per rank, the items DCP's de-duplicated plan gives it (the primaries).
        node_of_rank: the node of each rank.
        room: per node, the bytes one step of its shards may take.
        replicas: partner nodes that keep replicas of each node's shards.
        sources: per node, the nodes whose shards it keeps replicas of.
        place_of_node: per node, its place (failure domain); () each node itself.
    """
    nbytes: dict[Key, int] = {}
    holders: dict[Key, set[int]] = defaultdict(set)
    index_of: dict[Key, MetadataIndex] = {}
    for rank, items in held.items():
        for index, n in items:
            k = key_of(index)
            holders[k].add(rank)
            nbytes[k] = max(n, nbytes.get(k, 0))
            index_of.setdefault(k, index)
    primary: dict[Key, int] = {}
    twice: set[Key] = set()  # planned on several ranks (a planner that does not de-duplicate)
    for rank, indexes in planned.items():
        for index in indexes:
            k = key_of(index)
            if k in primary:
                twice.add(k)
            primary[k] = rank
    # Written more than once already: no copy of it is kept; the metadata records the last
    # rank's write (``finish`` reads the results in rank order), on that rank alone.
    recorded = {k: primary.pop(k) for k in twice}
    num_nodes = max(node_of_rank, default=-1) + 1
    own = [0] * num_nodes  # bytes of the primaries on each node
    load: dict[int, int] = defaultdict(int)  # bytes each rank's shard holds so far
    for k, rank in primary.items():
        own[node_of_rank[rank]] += nbytes.get(k, 0)
        load[rank] += nbytes.get(k, 0)
    # Per node, the items to keep: held by one of its ranks, primary on another node.
    wanted: dict[int, list[Key]] = defaultdict(list)
    for k, ranks in holders.items():
        p = primary.get(k)
        if p is None:
            continue
        for node in sorted({node_of_rank[r] for r in ranks} - {node_of_rank[p]}):
            wanted[node].append(k)
    # Each node's keepers, were it to keep copies: largest first, each to the node's holder
    # with the fewest bytes, so shards stay even (a node's choice touches only its ranks).
    keepers: dict[int, dict[Key, int]] = {}
    for node in sorted(wanted):
        keepers[node] = {}
        for k in sorted(wanted[node], key=lambda k: (-nbytes[k], k[0], k[1] or ())):
            keeper = min((r for r in holders[k] if node_of_rank[r] == node),
                         key=lambda r: (load[r], r))
            load[keeper] += nbytes[k]
            keepers[node][k] = keeper
    extra = {node: sum(nbytes[k] for k in keys) for node, keys in keepers.items()}
    keeping = set(keepers)
    ranks_of: dict[int, list[int]] = defaultdict(list)
    for rank, node in enumerate(node_of_rank):
        ranks_of[node].append(rank)
    source_ranks = {node: [r for s in (sources[node] if node < len(sources) else ())
                           for r in ranks_of.get(s, ())] for node in range(num_nodes)}
    places = max(2, 1 + replicas)  # (the replicator's count: this node and every partner)
    # Plain lookups, not functions of this module: the store layer calls them, and a lower
    # layer never calls up.
    node_of = tuple(node_of_rank).__getitem__
    place_of = tuple(place_of_node).__getitem__ if place_of_node else tuple(range(num_nodes)).__getitem__

    while True:
        # What the sources' replicas bring each node, counted as the room check counts it
        # after the save, over the locations these copies make (each item on its primary's
        # node and its keepers'; offsets and checksums are not known yet, nor needed).
        locations = [ItemLocation(rank, 0, nbytes.get(k, 0), 0) for k, rank in recorded.items()]
        kept_by: dict[Key, list[int]] = defaultdict(list)
        for node in keeping:
            for k, keeper in keepers[node].items():
                kept_by[k].append(keeper)
        locations += [ItemLocation(rank, 0, nbytes.get(k, 0), 0,
                                   copies=tuple((r, 0) for r in sorted(kept_by.get(k, ()))))
                      for k, rank in primary.items()]
        arriving = arriving_bytes(StepItems(locations), source_ranks,
                                  node_of, places, place_of)
        # A node that keeps none adds no place: others may then receive more (never less),
        # so the nodes that fit are asked again until none drops out.
        short = {node for node in keeping
                 if own[node] + extra[node] + arriving[node] > room.get(node, 0)}
        if not short:
            break
        keeping -= short
    modes, copy_bytes = [UNIQUE] * num_nodes, [0] * num_nodes
    copies: dict[int, list[MetadataIndex]] = defaultdict(list)
    for node in sorted(keepers):
        if node not in keeping:
            modes[node] = DEDUP
            continue
        modes[node], copy_bytes[node] = DP_COPIES, extra[node]
        for k, keeper in keepers[node].items():
            copies[keeper].append(index_of[k])
    return Choice(dict(copies), tuple(modes), tuple(copy_bytes),
                  tuple(arriving[node] for node in range(num_nodes)))


class ModeLog:
    """Says once, and again whenever it changes, which nodes keep copies (one line)."""

    def __init__(self) -> None:
        self.modes: tuple[str, ...] = ()

    def seen(self, modes: tuple[str, ...]) -> None:
        """A save's modes, as the coordinator sent them (any rank; no log)."""
        self.modes = modes

    def note(self, choice: Choice) -> None:
        """The coordinator chose: log if the modes changed."""
        if choice.modes == self.modes:
            return
        self.modes = choice.modes
        level = logging.WARNING if DEDUP in choice.modes else logging.INFO
        log.log(level, "mlcheckpoint: data-parallel copies: %s", describe(choice))


def describe(choice: Choice) -> str:
    """One line on which nodes keep copies and which fall back to replication."""
    parts = []
    for node, mode in enumerate(choice.modes):
        if mode == DP_COPIES:
            parts.append(f"node {node} keeps {choice.copy_bytes[node] / 2**20:.1f} MiB of "
                         "copies (replication skips what they cover)")
        elif mode == DEDUP:
            parts.append(f"node {node} has too little room for its copies: it keeps none, "
                         "its items are replicated as usual")
        else:
            parts.append(f"node {node} holds no item kept on another node")
    return "; ".join(parts)


def attach(primaries: dict[MetadataIndex, ItemLocation],
           kept: Sequence[tuple[MetadataIndex, ItemLocation]]) -> dict[MetadataIndex, ItemLocation]:
    """The primaries' locations with every kept copy whose bytes agree attached (``copies``).
    A copy that differs (a replica that is not bit-identical: a non-deterministic reduction)
    is left out, with one WARNING per save naming such items and ranks: it is no copy, and
    replication sends its primary's shard."""
    extra: dict[MetadataIndex, list[tuple[int, int]]] = defaultdict(list)
    differ: list[str] = []
    for index, copy in kept:
        loc = primaries.get(index)
        if loc is None:
            continue  # (DCP planned every item somewhere; a copy without one is not ours to add)
        if (copy.nbytes, copy.is_tensor) == (loc.nbytes, loc.is_tensor) and records_agree(loc, copy):
            extra[index].append((copy.rank, copy.offset))
        else:
            differ.append(f"{index.fqn} (rank {loc.rank}, rank {copy.rank})")
    if differ:
        shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        log.warning("mlcheckpoint: %s differ between data-parallel replicas: %s; not counted "
                    "as copies (replication sends them)", plural(len(differ), "item"), shown)
    out = dict(primaries)
    for index, places in extra.items():
        loc = out[index]
        out[index] = replace(loc, copies=tuple(sorted({*loc.copies, *places})))
    return out
