"""Who this process is: rank, node and local rank, from torch.distributed and the launcher;
and, once the ranks have agreed them, every node's failure domain."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from .settings import Launcher, default


@dataclass(frozen=True)
class Topology:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    # Where the job meets (MASTER_ADDR, MASTER_PORT): the TCP listener binds the address that
    # routes there unless told otherwise (replication/core/network.py).
    master_addr: str = default("master_addr")
    master_port: int = default("master_port")
    # Each node's failure domain ("" where none was named); empty until agreed (with_domains).
    domains: tuple[str, ...] = ()

    @classmethod
    def detect(cls, launcher: Launcher) -> Topology:
        """From the process group, else the launcher's view; torchrun's LOCAL_RANK,
        LOCAL_WORLD_SIZE and GROUP_RANK place the rank on its node."""
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = launcher.rank, launcher.world_size
        # No launcher info (LOCAL_WORLD_SIZE unset, or 0): treat the job as one node.
        local_world = launcher.local_world_size or world
        local_rank = rank % local_world if launcher.local_rank is None else launcher.local_rank
        node_rank = rank // local_world if launcher.group_rank is None else launcher.group_rank
        num_nodes = max(1, world // local_world)
        return cls(rank, world, local_rank, local_world, node_rank, num_nodes,
                   launcher.master_addr, launcher.master_port)

    @property
    def is_node_leader(self) -> bool:
        """Whether this rank speaks for its node (its first rank): it writes the node-wide
        records, says the node-wide lines once, and answers for the node's store."""
        return self.local_rank == 0

    def ranks_of_node(self, node: int) -> list[int]:
        """Ranks on ``node`` (torchrun numbers ranks node by node)."""
        return list(range(node * self.local_world_size, (node + 1) * self.local_world_size))

    def node_of(self, rank: int) -> int:
        """The node ``rank`` runs on (torchrun numbers ranks node by node)."""
        return rank // self.local_world_size

    def place_of_rank(self, rank: int) -> str | int:
        """Where ``rank``'s shard counts as one place: its node's failure domain where the
        node named one, else its node."""
        return self.place_of_node(self.node_of(rank))

    def place_of_node(self, node: int) -> str | int:
        """Where what ``node`` holds counts as one place: its failure domain where it named
        one, else the node itself."""
        return self.domains[node] if node < len(self.domains) and self.domains[node] else node

    def with_domains(self, per_rank: Sequence[str | None]) -> Topology:
        """This topology with every node's failure domain, from each rank's (gathered in
        rank order): a node's domain is its local rank 0's."""
        domains = tuple(per_rank[node * self.local_world_size] or ""
                        for node in range(self.num_nodes))
        return dataclasses.replace(self, domains=domains)

    def describe_node(self, node: int) -> str:
        """"node 2 (rack-b)", or "node 2" when it named no domain."""
        domain = self.domains[node] if node < len(self.domains) else ""
        return f"node {node} ({domain})" if domain else f"node {node}"
