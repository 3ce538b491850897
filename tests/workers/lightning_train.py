"""Worker: a 2-process CPU Lightning Trainer with FSDP2 (ModelParallelStrategy's path).

argv: phase folder
  save      - MLCheckpointStrategy; to memory every 2 steps (MemoryCheckpoint) and Lightning's
              own sharded checkpoint into ``folder`` every 2 steps (ModelCheckpoint); after step
              7 (memory holds step 6) every rank SIGKILLs itself.
  resume    - MLCheckpointStrategy, fit(ckpt_path=LATEST): resumes through the strategy.
  lightning - plain ModelParallelStrategy, fit(ckpt_path=<folder>/step=6): Lightning's own
              sharded resume of the same step.
  fresh     - as save, with fit(ckpt_path=LATEST) and nothing in memory or ``folder``: a
              fresh start, trained to step 10.
  plain     - as fresh, with plain ModelParallelStrategy and no ckpt_path: the same training
              without mlcheckpoint.
  preempt   - as save, with Lightning's own checkpoint every 10 steps, each step reported
              ("progress") and slowed by 50 ms, until SIGTERM (LIGHTNING_STEPS at most).
Nodes and processes: what torchrun started. env LIGHTNING_STEPS: the steps to train (10);
LIGHTNING_EVERY: MemoryCheckpoint's interval (2); LIGHTNING_KILL: any phase dies after step 7
as save does (after waiting for step 6 to reach the partner node, on several nodes);
LIGHTNING_DEFAULT_MESH: MLCheckpointStrategy without data_parallel_size/tensor_parallel_size;
LIGHTNING_CKPT: the checkpoint the lightning phase resumes (default <folder>/step=6.ckpt).
The module's on_save_checkpoint/on_load_checkpoint write and read a key of their own.
Every phase but save trains to LIGHTNING_STEPS and reports "lightning_<tag>" (env LIGHTNING_TAG,
default the phase): losses per step, the global step and epoch it started at, the resume
source; rank 0 saves the full final parameters and optimizer state to <TEST_OUT_DIR>/lightning_<tag>.pt.
"""

import os
import sys
import time

import lightning as L
import torch
from common import report
from fsdp_train import full_tensors
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from mlcheckpoint.integrations.lightning import (
    LATEST,
    MemoryCheckpoint,
    MLCheckpointStrategy,
)
from mlcheckpoint.testing.cluster import sigkill_self

KILL_AFTER, RESUME_STEP = 7, 6
MAX_STEPS = int(os.environ.get("LIGHTNING_STEPS", "10"))
EVERY = int(os.environ.get("LIGHTNING_EVERY", "2"))  # MemoryCheckpoint's every_n_train_steps


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    # A hook that reads what it wrote, as users' hooks do: called only when a checkpoint is
    # restored (a fresh start has no "my_counter" to read).
    def on_save_checkpoint(self, checkpoint):
        checkpoint["my_counter"] = self.trainer.global_step

    def on_load_checkpoint(self, checkpoint):
        self.loaded_counter = checkpoint["my_counter"]

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g))
        return DataLoader(data, batch_size=4, shuffle=True)


class Record(Callback):
    """Losses by global step; after KILL_AFTER in the save phase, the job dies."""

    def __init__(self, kill: bool, progress: bool = False):
        self.kill, self.progress, self.losses, self.start = kill, progress, {}, None

    def on_train_start(self, trainer, pl_module):
        self.start = (trainer.global_step, trainer.current_epoch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = outputs["loss"].item()
        if self.progress:
            report("progress", {"step": trainer.global_step})
            time.sleep(0.05)
        if self.kill and trainer.global_step == KILL_AFTER:
            trainer.strategy.checkpoints.wait()  # step 6 is committed in memory
            if trainer.num_nodes > 1:  # and on the partner node: a node may be lost now
                trainer.strategy.checkpoints.wait_replicated(RESUME_STEP, timeout=60)
            sigkill_self(f"rank {trainer.global_rank}: step {KILL_AFTER} is protected")


class Logged(Logger):
    """A Lightning logger that keeps what it is given, by step (as TensorBoard would plot it),
    on every rank."""

    def __init__(self):
        super().__init__()
        self.logged: dict[int, dict] = {}

    @property
    def name(self):
        return "logged"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.logged.setdefault(step, {}).update(metrics)


def main() -> None:
    phase, folder = sys.argv[1], sys.argv[2]
    tag = os.environ.get("LIGHTNING_TAG", phase)
    # Resumes start from another seed: what they load must decide where they go.
    L.seed_everything(1 if phase in ("save", "fresh", "plain", "preempt") else 2, verbose=False)
    world, devices = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if phase in ("lightning", "plain"):
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        mesh = ({} if os.environ.get("LIGHTNING_DEFAULT_MESH")  # Lightning's: dp = nodes
                else {"data_parallel_size": world, "tensor_parallel_size": 1})
        strategy = MLCheckpointStrategy(folder=folder, **mesh)
    record = Record(kill=phase == "save" or bool(os.environ.get("LIGHTNING_KILL")),
                    progress=phase == "preempt")
    memory = [] if phase in ("lightning", "plain") else [MemoryCheckpoint(every_n_train_steps=EVERY)]
    own = ModelCheckpoint(dirpath=folder if phase in ("save", "fresh", "preempt") else f"{folder}-{tag}",
                          filename="{step}", every_n_train_steps=10 if phase == "preempt" else 2,
                          save_top_k=-1)
    logged = Logged()
    trainer = L.Trainer(accelerator="cpu", devices=devices, num_nodes=world // devices,
                        max_steps=MAX_STEPS, strategy=strategy,
                        callbacks=[record, own] + memory,
                        logger=logged, enable_progress_bar=False, enable_model_summary=False)
    model = Net()
    ckpt_path = {"save": None, "resume": LATEST, "fresh": LATEST, "plain": None, "preempt": None,
                 "lightning": os.environ.get("LIGHTNING_CKPT",
                                             os.path.join(folder, f"step={RESUME_STEP}.ckpt"))}[phase]
    trainer.fit(model, ckpt_path=ckpt_path)
    msd, osd = get_state_dict(model, trainer.optimizers[0])
    tensors = full_tensors({"model": msd, "optim": osd})
    if trainer.global_rank == 0:
        torch.save(tensors, os.path.join(os.environ["TEST_OUT_DIR"], f"lightning_{tag}.pt"))
    info = getattr(strategy, "last_resume", None)
    report(f"lightning_{tag}", {"losses": record.losses, "start": record.start,
                                  "source": info and info.source, "global_step": trainer.global_step,
                                  "counter": getattr(model, "loaded_counter", None),
                                  "metrics": logged.logged})
    # Done: leave without the interpreter's teardown. With Lightning 2.6 and torch 2.13 (gloo),
    # about one process exit in four aborts there ("terminate called without an active
    # exception", SIGABRT) after all work is done, with or without mlcheckpoint (Lightning's
    # own strategy too); the exit code must say whether the work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
