"""Who this process is: rank, node and local rank, from torch.distributed and the launcher;
and, once the ranks have agreed them, every node's failure domain."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from .config import env_int, env_str


@dataclass(frozen=True)
class Topology:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    # Each node's failure domain ("" where none was named); empty until agreed (with_domains).
    domains: tuple[str, ...] = ()

    @classmethod
    def detect(cls) -> Topology:
        """Read the launcher's view (torchrun sets LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK)."""
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = env_int("RANK", 0, minimum=0), env_int("WORLD_SIZE", 1)
        # No launcher info (LOCAL_WORLD_SIZE unset, or 0): treat the job as one node.
        local_world = env_int("LOCAL_WORLD_SIZE", 0, minimum=0) or world
        local_rank = env_int("LOCAL_RANK", rank % local_world, minimum=0)
        node_rank = env_int("GROUP_RANK", rank // local_world, minimum=0)
        num_nodes = max(1, world // local_world)
        return cls(rank, world, local_rank, local_world, node_rank, num_nodes)

    def ranks_of_node(self, node: int) -> list[int]:
        """Ranks on ``node`` (torchrun numbers ranks node by node)."""
        return list(range(node * self.local_world_size, (node + 1) * self.local_world_size))

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


def slurm_failure_domain() -> str | None:
    """The leaf switch above this node, from SLURM's topology plugin: ``SLURM_TOPOLOGY_ADDR``
    names the switches from the top down and ends with the node (``spine1.leaf7.node42``,
    pattern ``switch.switch.node``). None without switches (pattern ``node``) or outside
    SLURM."""
    addr, pattern = env_str("SLURM_TOPOLOGY_ADDR"), env_str("SLURM_TOPOLOGY_ADDR_PATTERN")
    if addr is None or pattern is None:
        return None
    parts, kinds = addr.split("."), pattern.split(".")
    if len(parts) != len(kinds) or len(kinds) < 2 or kinds[-1] != "node" or kinds[-2] != "switch":
        return None
    return ".".join(parts[:-1])  # the whole path: leaf switches of two spines may share a name
