"""The recovery planner: a pure function from what survived to what to load.

No I/O, no torch.distributed: every rank runs it on the same gathered inputs and reaches
the same decision. Inputs: each node's inventory, the newest persistent step, the current
world size, and copies found bad so far. Output: the step and where its bytes come from,
or "persistent", or "fresh".
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

from .inventory import NodeInventory

MEMORY, PERSISTENT, FRESH = "memory", "persistent", "fresh"


@dataclass(frozen=True)
class Fetch:
    """``dst_rank`` pulls ``owner``'s shard of ``step`` (owner None: the metadata) from ``src_rank``."""

    dst_rank: int
    src_rank: int
    step: int
    owner: int | None
    nbytes: int = 0


@dataclass
class Decision:
    kind: str  # MEMORY, PERSISTENT or FRESH
    step: int | None
    fetches: list[Fetch] = field(default_factory=list)
    holders: dict[int, list[int]] = field(default_factory=dict)  # owner -> ranks that serve it
    metadata_holders: list[int] = field(default_factory=list)
    sources: dict[int, str] = field(default_factory=dict)  # rank -> "local" | "peer"
    resharded: bool = False  # saved with another world size: DCP reshards, reads fetch lazily
    newest_protected: int | None = None  # newest step with every shard on two nodes
    reason: str = ""


# A copy found unusable: (step, owner or None for metadata, node).
BadCopy = tuple[int, "int | None", int]


def plan_resume(nodes: list[NodeInventory], persistent_step: int | None, world_size: int, *,
                bad_copies: Iterable[BadCopy] = (), bad_steps: Iterable[int] = (),
                can_fetch: bool = True) -> Decision:
    """Pick the newest step complete among the surviving nodes; a newer persistent step wins.

    A step is complete when its metadata and every required rank's shard are on some node
    (not counting copies in ``bad_copies``; never a step in ``bad_steps``). Without a transport
    (``can_fetch`` False) every node must hold what its own ranks need.
    """
    bad = set(bad_copies)
    excluded_steps = set(bad_steps)
    view = _holdings(nodes, bad)
    reasons: list[str] = []
    newest_protected = _newest_protected(view)
    for step in sorted(view, reverse=True):
        if persistent_step is not None and persistent_step > step:
            reasons.append(f"persistent step {persistent_step} is newer than memory step {step}")
            break
        if step in excluded_steps:
            reasons.append(f"step {step} failed earlier")
            continue
        why = _incomplete(view[step])
        if why is None:
            decision = _fetch_plan(step, view[step], nodes, world_size, can_fetch)
            if decision is not None:
                decision.reason = "; ".join(reasons)
                decision.newest_protected = newest_protected
                return decision
            why = "needs fetching but replication is off"
        reasons.append(f"step {step} unusable: {why}")
    if persistent_step is not None:
        return Decision(PERSISTENT, persistent_step, reason="; ".join(reasons),
                        newest_protected=newest_protected)
    return Decision(FRESH, None, reason="; ".join(reasons) or "no checkpoint found",
                    newest_protected=newest_protected)


@dataclass
class _StepView:
    required: tuple[int, ...] | None = None
    world_size: int | None = None
    meta_nodes: list[int] = field(default_factory=list)
    owner_nodes: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    owner_bytes: dict[int, int] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)  # owners with a copy that failed verification


def _holdings(nodes: list[NodeInventory], bad: set[BadCopy]) -> dict[int, _StepView]:
    view: dict[int, _StepView] = defaultdict(_StepView)
    for inv in nodes:
        if not inv.ranks:
            continue  # a node without live ranks cannot serve anything
        for step, copy in inv.steps.items():
            v = view[step]
            if copy.has_metadata and (step, None, inv.node) not in bad:
                v.meta_nodes.append(inv.node)
                if v.required is None:
                    v.required, v.world_size = copy.required, copy.world_size
            for owner, nbytes in copy.shard_bytes:
                if (step, owner, inv.node) in bad:
                    v.refused.add(owner)
                else:
                    v.owner_nodes[owner].append(inv.node)
                    v.owner_bytes[owner] = nbytes
    return view


def _incomplete(v: _StepView) -> str | None:
    if not v.meta_nodes or v.required is None:
        return "no surviving node has its metadata"
    missing = [r for r in v.required if not v.owner_nodes.get(r)]
    if missing:
        corrupt = [r for r in missing if r in v.refused]
        lost = [r for r in missing if r not in v.refused]
        why = []
        if corrupt:
            why.append(f"every surviving copy of ranks {_few(corrupt)}'s shards failed verification")
        if lost:
            why.append(f"shards of ranks {_few(lost)} are on no surviving node")
        return "; ".join(why)
    return None


def _few(ranks: list[int]) -> list:
    return ranks[:8] + (["..."] if len(ranks) > 8 else [])


def _newest_protected(view: dict[int, _StepView]) -> int | None:
    for step in sorted(view, reverse=True):
        v = view[step]
        if (v.required is not None and len(set(v.meta_nodes)) >= 2
                and all(len(set(v.owner_nodes.get(r, ()))) >= 2 for r in v.required)):
            return step
    return None


def _fetch_plan(step: int, v: _StepView, nodes: list[NodeInventory], world_size: int,
                can_fetch: bool) -> Decision | None:
    node_ranks = {inv.node: inv.ranks for inv in nodes if inv.ranks}
    rank_node = {r: n for n, ranks in node_ranks.items() for r in ranks}
    load: dict[int, int] = defaultdict(int)  # bytes each holder node serves, to spread fetches
    turn: dict[int, int] = defaultdict(int)  # round-robin over a holder node's ranks

    def pick_src(holder_nodes: list[int], nbytes: int) -> int:
        node = min(holder_nodes, key=lambda n: (load[n], n))
        load[node] += nbytes
        ranks = node_ranks[node]
        turn[node] += 1
        return ranks[turn[node] % len(ranks)]

    d = Decision(MEMORY, step, resharded=v.world_size != world_size)
    d.holders = {o: [r for n in sorted(set(ns)) for r in node_ranks[n]] for o, ns in v.owner_nodes.items()}
    d.metadata_holders = [r for n in sorted(set(v.meta_nodes)) for r in node_ranks[n]]
    for node, ranks in sorted(node_ranks.items()):
        if node not in v.meta_nodes:
            d.fetches.append(Fetch(ranks[0], pick_src(v.meta_nodes, 1), step, None))  # 1: spread them too
    required = set(v.required or ())
    for rank in sorted(rank_node):
        node = rank_node[rank]
        if d.resharded or rank not in required:
            d.sources[rank] = "local"
            continue
        if node in v.owner_nodes[rank]:
            d.sources[rank] = "local"
        else:
            nbytes = v.owner_bytes.get(rank, 0)
            d.fetches.append(Fetch(rank, pick_src(v.owner_nodes[rank], nbytes), step, rank, nbytes))
            d.sources[rank] = "peer"
    if not can_fetch and d.fetches:
        return None
    return d
