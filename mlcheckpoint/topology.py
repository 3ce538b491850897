"""Who this process is: rank, node and local rank, from torch.distributed and the launcher."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .config import env_int


@dataclass(frozen=True)
class Topology:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1

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
