# examples/quickstart.py -- run: MLCHECKPOINT_JOB_ID=quickstart torchrun --nproc-per-node=2 examples/quickstart.py
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import mlcheckpoint

dist.init_process_group("gloo")      # "nccl" on GPUs; torchrun gives rank and world size
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
total_steps = 20


def state_dict():                    # what a checkpoint holds (add schedulers, data loader, ...)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


ckpt = mlcheckpoint.CheckpointManager(persistent_dir="checkpoints")  # a shared folder or URL
sd = state_dict()
info = ckpt.resume(sd)               # newest complete: local RAM > peer RAM > persistent
if info.step is not None:            # resume loaded into sd: hand it to the model and optimizer
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
if dist.get_rank() == 0:
    print(f"resumed: step {info.step} from {info.source}")
ckpt.guard(optimizer)                # once: optimizer.step() waits for the snapshot in flight
start = 0 if info.step is None else info.step + 1   # a checkpoint's step is the last one done
for step in range(start, total_steps):
    x = torch.randn(32, 16)          # your data and forward pass
    loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    ckpt.async_save(state_dict(), step, persistent=(step % 10 == 9))   # returns at once
ckpt.close()
dist.destroy_process_group()
