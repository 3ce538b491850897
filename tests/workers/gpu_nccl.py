"""Worker: replication over a dedicated NCCL group between two simulated nodes (one GPU each)."""

import os

import torch
import torch.distributed as dist
from common import report
from states import make_state

from mlcheckpoint import CheckpointManager
from mlcheckpoint.store import LocalStore
from mlcheckpoint.testing import internals


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    # simulated nodes share one machine: node k uses GPUs after those of nodes < k
    torch.cuda.set_device(int(os.environ["GROUP_RANK"]) * int(os.environ["LOCAL_WORLD_SIZE"]) + local)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank = dist.get_rank()
    ckpt = CheckpointManager(replication="nccl")
    replicator = internals(ckpt).replicator
    assert replicator is not None and replicator.transport.name == "pg/nccl"
    sd = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in make_state(1, rank).items()}
    ckpt.async_save(sd, 1).result()
    protected = ckpt.wait_replicated(1, 120)
    dist.barrier()
    held = sorted(LocalStore().inventory.step_state(1).committed_ranks)
    report("nccl", {"protected": protected, "held": held})
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
