"""Hugging Face accelerate with mlcheckpoint: the recipe of docs/integration.md, runnable on CPU.

    MLCHECKPOINT_JOB_ID=demo ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu \\
        --num_processes 2 examples/accelerate_train.py --steps 20 --folder accel-ckpts

(``--multi_gpu`` is accelerate's torchrun launcher; ``ACCELERATE_USE_CPU=1`` makes its processes
one DDP job over gloo on the CPU; leave it out on GPUs.) Every step goes to memory with ``async_save``, every ``--persistent-every`` steps also to
``--folder`` as a stock DCP checkpoint. Kill the job at any point and launch it again: it goes
on from the newest step in memory (this node's, or the partner node's copy), else from the
folder. accelerate's ``save_state``/``load_state`` are not used: they write with DCP's
``FileSystemWriter`` only.

``--out DIR`` writes what a test compares (losses, the resume, final parameters and optimizer
state); ``--hang-after STEP`` makes the job wait, once STEP is saved, to be killed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch
from accelerate import Accelerator
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader, TensorDataset

import mlcheckpoint

BATCH = 4


def make_data(steps: int, world: int) -> TensorDataset:
    """Enough fixed samples for ``steps`` steps of every process, the same on every launch."""
    g = torch.Generator().manual_seed(0)
    n = steps * BATCH * world
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, (x @ torch.randn(16, 1, generator=g)).squeeze(1))


class TrainState(Stateful):
    """Everything a resume needs. DCP calls ``state_dict`` only when it saves and
    ``load_state_dict`` only when it loads: reading an optimizer's state before its first step
    would create that state, which a fresh start must not."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def state_dict(self) -> dict:
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optimizer": osd, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                       optim_state_dict=sd["optimizer"])
        self.scheduler.load_state_dict(sd["scheduler"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--folder", default="accel-ckpts", help="persistent DCP checkpoints")
    parser.add_argument("--persistent-every", type=int, default=10)
    parser.add_argument("--out", help="write results here (for tests)")
    parser.add_argument("--hang-after", type=int, help="after saving this step, wait to be killed")
    args = parser.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(0)  # the same initial model on every process and every launch
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    loader = DataLoader(make_data(args.steps, accelerator.num_processes), batch_size=BATCH)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    # What the resume restored, in one line on rank 0: a fallback that lost steps is a WARNING,
    # shown without this; a resume of the newest step is INFO, shown with it.
    logging.basicConfig(format="%(message)s")
    logging.getLogger("mlcheckpoint.recovery.resume").setLevel(logging.INFO)
    train = TrainState(model, optimizer, scheduler)
    ckpt = mlcheckpoint.CheckpointManager(persistent_dir=args.folder)
    info = ckpt.resume({"app": train})  # memory (local or partner), else the folder, else fresh
    start = 0 if info.step is None else info.step + 1  # a checkpoint's step is the last one done
    losses: dict[int, float] = {}
    for step, (x, y) in enumerate(accelerator.skip_first_batches(loader, start), start=start):
        if step == args.steps:
            break
        loss = nn.functional.mse_loss(model(x).squeeze(1), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
        ckpt.async_save({"app": train}, step, persistent=(step + 1) % args.persistent_every == 0)
        if step == args.hang_after:
            ckpt.wait()  # committed in memory on this rank; the test kills the job now
            if args.out:
                open(os.path.join(args.out, f"saved-{accelerator.process_index}"), "w").close()
            while True:
                time.sleep(1)
    ckpt.close()

    if args.out:
        rank = accelerator.process_index
        with open(os.path.join(args.out, f"result-{rank}.json"), "w") as f:
            json.dump({"losses": losses, "resumed": info.step, "source": info.source,
                       "lr": scheduler.get_last_lr()[0]}, f)
        if rank == 0:  # DDP: every process holds the whole model and optimizer state
            msd, osd = get_state_dict(model, optimizer)
            torch.save({"model": msd, "optimizer": osd}, os.path.join(args.out, "final.pt"))


if __name__ == "__main__":
    main()
