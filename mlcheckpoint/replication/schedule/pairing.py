"""Which node keeps a replica of which: a small, replaceable strategy.

Pairs: node i <-> node i^1 (0<->1, 2<->3, ...). With an odd node count the last three nodes
form a ring (n-3 -> n-2 -> n-1 -> n-3), so every node still sends its shards to exactly one
other node and holds exactly one other node's replicas. A single node has nobody to pair with.
Rank by rank: local rank l on node a replicates to local rank l on its partner node.

When nodes name their failure domains (a rack, a switch, a power feed: what takes several
machines out at once), ``DomainPairing`` replaces the pairs: every node's partner is in
another domain whenever that is possible while each node still sends to one node and
receives from one (see ``domain_targets``).

With ``replicas`` = k > 1 (``ReplicaPairing``), every node sends to k nodes and keeps the
replicas of k: in distinct domains where possible, else as far apart on the ring as the count
allows (see ``replica_targets``). Losing any k nodes then leaves a copy of every shard.
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


class ReplicaPairing:
    """``replicas`` partners per node (see ``replica_targets``); ``domains[n]`` is node n's
    failure domain ("" for none named)."""

    def __init__(self, domains: Sequence[str], replicas: int):
        self.domains, self.replicas = list(domains), replicas
        self._targets = replica_targets(self.domains, replicas)

    def targets(self, node: int, num_nodes: int) -> list[int]:
        if num_nodes != len(self.domains):
            raise ValueError(f"{num_nodes} nodes, but {len(self.domains)} failure domains")
        if not 0 <= node < num_nodes:
            raise ValueError(f"node {node} not in [0, {num_nodes})")
        return list(self._targets[node])


def replica_targets(domains: Sequence[str], replicas: int) -> list[list[int]]:
    """Node n's ``replicas`` partners for every n (fewer when there are not that many other
    nodes), given each node's failure domain ("": none named, a domain of its own).

    Every node sends to its j-th partner by the same rule: the node ``shift_j`` places further
    on a circle of the nodes. One shift is a permutation, so however many are used, every node
    sends to k nodes and receives from k, and distinct shifts give distinct partners. Three
    candidates, each domain's nodes side by side on the circle unless said otherwise: shifts
    spread evenly round the ring (n/(k+1) apart: farthest on the ring); ``domain_targets``'
    shift, then each next shift the one that puts the fewest nodes' partner in a domain that
    node covers already (its own, or an earlier partner's), ties going to the shift farthest
    from those taken; and the same greedy choice on a circle that deals the domains in turn.
    The candidate whose copies share the fewest domains wins; on a tie, the earlier.
    """
    n = len(domains)
    k = max(0, min(replicas, n - 1))
    if k == 0:
        return [[] for _ in range(n)]
    named = [d if d else f"\0node{i}" for i, d in enumerate(domains)]  # unnamed: alone
    grouped = sorted(range(n), key=lambda i: (named[i], i))  # as domain_targets lays them out
    first_shift = (grouped.index(domain_targets(domains)[grouped[0]])) % n
    by_domain: dict[str, list[int]] = {}
    for node in grouped:
        by_domain.setdefault(named[node], []).append(node)
    dealt = [members[turn] for turn in range(n) for members in by_domain.values() if turn < len(members)]
    evenly = sorted({round(j * n / (k + 1)) % n for j in range(1, k + 1)} - {0})
    layouts = [_shifted_targets(grouped, named, evenly, k),  # farthest apart: first on a tie
               _shifted_targets(grouped, named, [first_shift], k),
               _shifted_targets(dealt, named, [], k)]
    return min(layouts, key=lambda layout: layout[1])[0]


def _shifted_targets(circle: list[int], named: list[str], shifts: list[int], k: int
                     ) -> tuple[list[list[int]], int]:
    """Targets on ``circle`` by ``shifts`` and then by the best next shifts until there are
    ``k``, and how many partners land in a domain their node covers already."""
    n = len(circle)
    targets: list[list[int]] = [[] for _ in range(n)]
    covered = [{named[node]} for node in range(n)]
    shared = 0
    taken = {0}

    def clashes(shift: int) -> int:
        return sum(named[circle[(p + shift) % n]] in covered[node] for p, node in enumerate(circle))

    def on_ring(shift: int) -> int:  # the distance to the nearest shift taken
        return min(min((shift - t) % n, (t - shift) % n) for t in taken)

    while len(taken) <= k:
        if shifts:
            shift = shifts.pop(0)
        else:
            shift = min((s for s in range(1, n) if s not in taken),
                        key=lambda s: (clashes(s), -on_ring(s), s))
        shared += clashes(shift)
        taken.add(shift)
        for p, node in enumerate(circle):
            partner = circle[(p + shift) % n]
            targets[node].append(partner)
            covered[node].add(named[partner])
    return targets, shared


def pairing_for(domains: Sequence[str], replicas: int = 1) -> PairingStrategy:
    """The pairing for a job whose nodes named these failure domains, each node keeping
    ``replicas`` partners: today's pairs when that is one and fewer than two distinct domains
    were named (nothing to spread over)."""
    if replicas > 1:
        return ReplicaPairing(domains, replicas)
    named = {d for d in domains if d}
    if not named or (len(named) == 1 and all(domains)):
        return PairwiseRing()
    return DomainPairing(domains)


def sources(strategy: PairingStrategy, node: int, num_nodes: int) -> list[int]:
    """Nodes whose replicas ``node`` keeps."""
    return every_source(strategy, num_nodes)[node]


def every_source(strategy: PairingStrategy, num_nodes: int) -> list[list[int]]:
    """Per node, the nodes whose replicas it keeps (``sources`` of every node at once)."""
    out: list[list[int]] = [[] for _ in range(num_nodes)]
    for n in range(num_nodes):
        for t in strategy.targets(n, num_nodes):
            out[t].append(n)
    return out


def rank_targets(strategy: PairingStrategy, rank: int, local_world_size: int, num_nodes: int) -> list[int]:
    node, local = divmod(rank, local_world_size)
    return [t * local_world_size + local for t in strategy.targets(node, num_nodes)]


def rank_sources(strategy: PairingStrategy, rank: int, local_world_size: int, num_nodes: int) -> list[int]:
    node, local = divmod(rank, local_world_size)
    return [s * local_world_size + local for s in sources(strategy, node, num_nodes)]
