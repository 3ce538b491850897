"""Worker: real HSDP, FSDP2 ``fully_shard`` on a 2-D device mesh (replicate across nodes, shard
within a node), gloo on CPU, checkpointed with replication over TCP.

argv: phase
  save   - train LAST steps, ``save`` {"model", "optim"} after each; dump the full tensors of
           the last step (hsdp_expected.pt, rank 0) and report ("hsdp_save") whether it is
           protected and the mesh's shape.
  resume - build the model fresh (another init) on a (nodes, ranks per node) mesh of this
           launch (any shape: 1 x 2 reshards a 2 x 2 save), resume into get_state_dict's
           dicts, set_state_dict, dump the full tensors (hsdp_resumed.pt, rank 0) and report
           the resume ("hsdp_resume").
"""

import os
import sys

import torch
import torch.distributed as dist
from common import init, report
from fsdp_train import full_tensors
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from mlcheckpoint import CheckpointManager

LAST = 3


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    nodes = dist.get_world_size() // int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (nodes, int(os.environ["LOCAL_WORLD_SIZE"])),
                            mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(10_000 + 100 * step + dist.get_rank())
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
    optim.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()  # reduce-scatter in a node, all-reduce across
    optim.step()


def dump(model: nn.Module, optim: torch.optim.Optimizer, name: str) -> None:
    msd, osd = get_state_dict(model, optim)
    tensors = full_tensors({"model": msd, "optim": osd})  # collective
    if dist.get_rank() == 0:
        torch.save(tensors, os.path.join(os.environ["TEST_OUT_DIR"], name))


def main() -> None:
    phase = sys.argv[1]
    init()
    ckpt = CheckpointManager(replication="tcp")
    if phase == "save":
        model, optim = build(seed=0)
        for step in range(1, LAST + 1):
            train_step(model, optim, step)
            msd, osd = get_state_dict(model, optim)
            ckpt.save({"model": msd, "optim": osd}, step)
        dump(model, optim, "hsdp_expected.pt")
        protected = ckpt.wait_replicated(LAST, timeout=60)
        state = ckpt.replication_state(LAST)
        report("hsdp_save", {"protected": protected,
                             "newest_protected": ckpt.protection().newest_protected,
                             "reason": None if state is None else state.reason,
                             "sent": None if state is None else state.bytes})
    else:
        model, optim = build(seed=1234)  # another init: only a real load can match
        msd, osd = get_state_dict(model, optim)
        info = ckpt.resume({"model": msd, "optim": osd})
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
        dump(model, optim, "hsdp_resumed.pt")
        report("hsdp_resume", {"step": info.step, "source": info.source, "reason": info.reason,
                               "sources": info.sources, "bytes_fetched": info.bytes_fetched,
                               "bytes_served": info.bytes_served, "resharded": info.resharded})
    dist.barrier()
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
