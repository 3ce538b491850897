"""Worker: FSDP2 (fully_shard on a 1-D CPU mesh) training with an async in-memory checkpoint.

argv: phase
  save   - train SAVE_STEP steps, dump the full model/optimizer tensors (fsdp_expected.pt),
           async_save {"model", "optim"} at SAVE_STEP and overwrite the live tensors with NaN
           while the save is in flight; then restore them, train EXTRA_STEPS more steps and
           report their losses ("fsdp_save").
  resume - build the model fresh (other init), resume into get_state_dict's dicts,
           set_state_dict, dump the full tensors (fsdp_resumed.pt), train the same EXTRA_STEPS
           steps; report the resume info and losses ("fsdp_resume").
"""

import os
import sys

import torch
import torch.distributed as dist
from common import init, report
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mlcheckpoint import CheckpointManager

SAVE_STEP = 2
EXTRA_STEPS = 2


def build(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(),
                          nn.Linear(24, 8))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    return model, optim


def train_step(model: nn.Module, optim: torch.optim.Optimizer, rank: int, step: int) -> float:
    g = torch.Generator().manual_seed(10_000 + 100 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
    optim.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    return loss.item()


def full_tensors(sd, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict as a full plain tensor (collective for DTensors)."""
    out = {}
    if isinstance(sd, dict):
        for k in sorted(sd, key=str):
            out.update(full_tensors(sd[k], f"{prefix}{k}."))
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            out.update(full_tensors(v, f"{prefix}{i}."))
    elif isinstance(sd, DTensor):
        out[prefix[:-1]] = sd.full_tensor().detach().clone()
    elif isinstance(sd, torch.Tensor):
        out[prefix[:-1]] = sd.detach().clone()
    return out


def full_tensor_leaves(sd) -> list[torch.Tensor]:
    if isinstance(sd, dict):
        return [t for v in sd.values() for t in full_tensor_leaves(v)]
    if isinstance(sd, (list, tuple)):
        return [t for v in sd for t in full_tensor_leaves(v)]
    return [sd] if isinstance(sd, torch.Tensor) else []


def dump(model, optim, name: str, rank: int) -> None:
    msd, osd = get_state_dict(model, optim)
    tensors = full_tensors({"model": msd, "optim": osd})
    if rank == 0:
        torch.save(tensors, os.path.join(os.environ["TEST_OUT_DIR"], name))


def main() -> None:
    phase = sys.argv[1]
    rank, world = init()
    ckpt = CheckpointManager()
    if phase == "save":
        model, optim = build(world, seed=0)
        for step in range(SAVE_STEP):
            train_step(model, optim, rank, step)
        dump(model, optim, "fsdp_expected.pt", rank)
        msd, osd = get_state_dict(model, optim)
        fut = ckpt.async_save({"model": msd, "optim": osd}, SAVE_STEP)
        # At once, while the save is in flight, overwrite the live parameters and optimizer
        # state in place (a correct async_save already holds its own copy) ...
        live = [t._local_tensor if isinstance(t, DTensor) else t
                for t in full_tensor_leaves({"model": msd, "optim": osd})]
        backup = [t.clone() for t in live]
        for t in live:
            t.fill_(float("nan"))
        scribbled = all(p.to_local().isnan().all().item() for p in model.parameters())
        res = fut.result()
        # ... then put them back and train on.
        for t, b in zip(live, backup):
            t.copy_(b)
        losses = [train_step(model, optim, rank, SAVE_STEP + i) for i in range(EXTRA_STEPS)]
        report("fsdp_save", {"losses": losses, "saved_step": res.step, "bytes": res.bytes,
                             "scribbled_live_params": scribbled,
                             "local_keys": sorted(k for k, v in msd.items() if isinstance(v, DTensor))})
    else:
        model, optim = build(world, seed=1234)  # different init: only a real load can match
        msd, osd = get_state_dict(model, optim)
        info = ckpt.resume({"model": msd, "optim": osd})
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
        dump(model, optim, "fsdp_resumed.pt", rank)
        losses = [train_step(model, optim, rank, SAVE_STEP + i) for i in range(EXTRA_STEPS)]
        report("fsdp_resume", {"step": info.step, "source": info.source, "reason": info.reason,
                               "losses": losses})
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
