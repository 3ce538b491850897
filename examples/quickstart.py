# examples/quickstart.py -- run: MLCHECKPOINT_JOB_ID=quickstart torchrun --nproc-per-node=2 examples/quickstart.py
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel

import mlcheckpoint

total_steps = 20


def make_model():                    # your model and optimizer
    torch.manual_seed(0)             # the same initial weights at every launch
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model, optimizer, step):   # your data, forward, backward and optimizer step
    batch = torch.Generator().manual_seed(step * dist.get_world_size() + dist.get_rank())
    x = torch.randn(32, 16, generator=batch)   # this rank's batch of this step, after a restart too
    loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


# What a checkpoint holds (add schedulers, data loader, ...). DCP calls state_dict() only to save
# or load one: a fresh start never reads the optimizer's state, which would create it.
class TrainingState(Stateful):
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, sd):   # what resume loaded: hand it to the model and optimizer
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                       optim_state_dict=sd["optimizer"])


def main():
    dist.init_process_group("gloo")  # "nccl" on GPUs; torchrun gives rank and world size
    model, optimizer = make_model()
    state = {"training": TrainingState(model, optimizer)}
    ckpt = mlcheckpoint.CheckpointManager(persistent_dir="checkpoints")  # a shared folder or URL
    info = ckpt.resume(state)        # newest complete: local RAM > peer RAM > persistent
    if dist.get_rank() == 0:
        print(f"resumed: step {info.step} from {info.source}")
    ckpt.guard(optimizer)            # once: optimizer.step() waits for the snapshot in flight
    start = 0 if info.step is None else info.step + 1   # a checkpoint's step is the last one done
    for step in range(start, total_steps):
        loss = train_step(model, optimizer, step)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss}")
        ckpt.async_save(state, step, persistent=(step % 10 == 9))   # returns at once
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
