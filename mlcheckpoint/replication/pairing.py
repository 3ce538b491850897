"""Which node keeps a replica of which: a small, replaceable strategy.

Pairs: node i <-> node i^1 (0<->1, 2<->3, ...). With an odd node count the last three nodes
form a ring (n-3 -> n-2 -> n-1 -> n-3), so every node still sends its shards to exactly one
other node and holds exactly one other node's replicas. A single node has nobody to pair with.
Rank by rank: local rank l on node a replicates to local rank l on its partner node.

When nodes name their failure domains (a rack, a switch, a power feed: what takes several
machines out at once), ``DomainPairing`` replaces the pairs: every node's partner is in
another domain whenever that is possible while each node still sends to one node and
receives from one (see ``domain_targets``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class PairingStrategy(Protocol):
    def targets(self, node: int, num_nodes: int) -> list[int]:
        """Nodes that keep replicas of ``node``'s shards."""
        ...


class PairwiseRing:
    """Buddy pairs (i <-> i^1); a 3-node ring at the end when the count is odd."""

    def targets(self, node: int, num_nodes: int) -> list[int]:
        if not 0 <= node < num_nodes:
            raise ValueError(f"node {node} not in [0, {num_nodes})")
        if num_nodes == 1:
            return []
        if num_nodes % 2 == 1 and node >= num_nodes - 3:
            first = num_nodes - 3
            return [first + (node - first + 1) % 3]
        return [node ^ 1]


class DomainPairing:
    """Partners across failure domains: ``domains[n]`` is node n's domain ("" for a node
    that names none: it shares a domain with no other node)."""

    def __init__(self, domains: Sequence[str]):
        self.domains = list(domains)
        self._targets = domain_targets(self.domains)

    def targets(self, node: int, num_nodes: int) -> list[int]:
        if num_nodes != len(self.domains):
            raise ValueError(f"{num_nodes} nodes, but {len(self.domains)} failure domains")
        if not 0 <= node < num_nodes:
            raise ValueError(f"node {node} not in [0, {num_nodes})")
        return [self._targets[node]] if num_nodes > 1 else []


def domain_targets(domains: Sequence[str]) -> list[int]:
    """Node n's partner for every n (a permutation without fixed points), given each node's
    failure domain ("": none named, a domain of its own).

    Nodes are laid out in a circle, each domain's nodes side by side, and every node sends
    to the node ``shift`` places further on. With ``shift`` = n // 2 ("farthest on a ring")
    no node lands in its own domain as long as no domain holds more than half the nodes, and
    with an even count the pairs are mutual. When one domain holds m > n/2 nodes, only n - m
    of them can have a partner outside it (each node receives from one node), so
    ``shift`` = n - m sends every other node into that domain and exactly 2m - n of its
    nodes to one another: the fewest possible. (``pairing_for`` keeps today's pairs when all
    nodes share one domain.)
    """
    n = len(domains)
    if n < 2:
        return []  # nobody to pair with
    named = [d if d else f"\0node{i}" for i, d in enumerate(domains)]  # unnamed: alone
    circle = sorted(range(n), key=lambda i: (named[i], i))
    largest = max(named.count(d) for d in set(named))
    shift = n // 2 if 2 * largest <= n or largest == n else n - largest
    targets = [0] * n
    for place, node in enumerate(circle):
        targets[node] = circle[(place + shift) % n]
    return targets


def pairing_for(domains: Sequence[str]) -> PairingStrategy:
    """The pairing for a job whose nodes named these failure domains: today's pairs when
    fewer than two distinct domains were named (nothing to spread over)."""
    named = {d for d in domains if d}
    if not named or (len(named) == 1 and all(domains)):
        return PairwiseRing()
    return DomainPairing(domains)


def sources(strategy: PairingStrategy, node: int, num_nodes: int) -> list[int]:
    """Nodes whose replicas ``node`` keeps."""
    return [n for n in range(num_nodes) if node in strategy.targets(n, num_nodes)]


def rank_targets(strategy: PairingStrategy, rank: int, local_world_size: int, num_nodes: int) -> list[int]:
    node, local = divmod(rank, local_world_size)
    return [t * local_world_size + local for t in strategy.targets(node, num_nodes)]


def rank_sources(strategy: PairingStrategy, rank: int, local_world_size: int, num_nodes: int) -> list[int]:
    node, local = divmod(rank, local_world_size)
    return [s * local_world_size + local for s in sources(strategy, node, num_nodes)]
