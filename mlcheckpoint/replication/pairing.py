"""Which node keeps a replica of which: a small, replaceable strategy.

Pairs: node i <-> node i^1 (0<->1, 2<->3, ...). With an odd node count the last three nodes
form a ring (n-3 -> n-2 -> n-1 -> n-3), so every node still sends its shards to exactly one
other node and holds exactly one other node's replicas. A single node has nobody to pair with.
Rank by rank: local rank l on node a replicates to local rank l on its partner node.
"""

from __future__ import annotations

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


def sources(strategy: PairingStrategy, node: int, num_nodes: int) -> list[int]:
    """Nodes whose replicas ``node`` keeps."""
    return [n for n in range(num_nodes) if node in strategy.targets(n, num_nodes)]


def rank_targets(strategy: PairingStrategy, rank: int, local_world_size: int, num_nodes: int) -> list[int]:
    node, local = divmod(rank, local_world_size)
    return [t * local_world_size + local for t in strategy.targets(node, num_nodes)]


def rank_sources(strategy: PairingStrategy, rank: int, local_world_size: int, num_nodes: int) -> list[int]:
    node, local = divmod(rank, local_world_size)
    return [s * local_world_size + local for s in sources(strategy, node, num_nodes)]
