"""Worker: drives mlcheckpoint's torchtitan checkpointer the way torchtitan 0.3.0's Trainer does.

Built through the config (``Config.build`` with the trainer's keyword arguments), then
``load(step=load_step)`` at start, ``save(step, last_step=...)`` after each step,
``maybe_wait_for_staging()`` before the optimizer step, and ``close()`` (inside ``except`` on an
error, as torchtitan's train.py does). FSDP2 (fully_shard on a CPU/gloo mesh), AdamW, a LambdaLR
schedule and a per-rank dataloader state, held in Stateful containers shaped like torchtitan's
(whose own containers need torchtitan's full dependencies).

argv: base_folder total_steps [save_until]
  Steps after ``save_until`` are trained but not checkpointed: the run is then both the
  "checkpointed until step S" job and the uninterrupted reference.
env TITAN_LOAD_STEP: checkpoint.load_step (default -1).
env TITAN_FLOAT8=1: float8 training as torchtitan's converter sets it up (``to_float8``).
env TITAN_RAISE_AT_END=1: after reporting, rank 1 raises in its next step while rank 0 waits
  in that step's collective (a rank that fails mid-training); both close() from ``except``.
env TITAN_WAIT_AT_END=1: after reporting, wait (120 s at most) for a SIGTERM before close():
  a job preempted while memory holds a step newer than its folder's.
Reports "titan_<tag>" (env TITAN_TAG): the resume, per-step losses; rank 0 writes the full
final model and optimizer tensors to <TEST_OUT_DIR>/titan_<tag>.pt.
"""

import os
import pickle
import sys
import time

import torch
import torch.distributed as dist
import torchtitan
from common import init, report
from fsdp_train import full_tensors
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from mlcheckpoint.integrations.torchtitan import MemoryCheckpointManager

INTERVAL, PERSISTENT_INTERVAL = 2, 4
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Optimizers(Stateful):
    """torchtitan's OptimizersContainer: a flat, FQN-keyed optimizer state."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.optim = torch.optim.AdamW(model.parameters(), lr=0.02, betas=(0.9, 0.95),
                                       weight_decay=0.1)

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optim, options=FLAT)

    def load_state_dict(self, sd):
        set_optimizer_state_dict(self.model, self.optim, optim_state_dict=sd, options=FLAT)


class Schedulers(Stateful):
    """torchtitan's LRSchedulersContainer: warmup then linear decay; saves only last_epoch."""

    def __init__(self, optim: torch.optim.Optimizer, total: int):
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            optim, lambda s: min(1.0, (s + 1) / 3) * max(0.1, 1 - s / total))

    def state_dict(self):
        return {"last_epoch": self.sched.last_epoch}

    def load_state_dict(self, sd):
        self.sched.last_epoch = sd["last_epoch"]
        self.sched._step_count = sd["last_epoch"] + 1
        self.sched._last_lr = self.sched.get_lr()


class DataLoader(Stateful):
    """torchtitan's ParallelAwareDataloader state: pickled under a per-dp-rank key."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.position = rank, world, 0

    def next_batch(self):
        g = torch.Generator().manual_seed(7919 * self.position + self.rank)
        self.position += 1
        return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)

    def state_dict(self):
        return {f"dp_rank_{self.rank}": pickle.dumps({"position": self.position}),
                "world_size": self.world}

    def load_state_dict(self, sd):
        assert sd["world_size"] == self.world
        self.position = pickle.loads(sd[f"dp_rank_{self.rank}"])["position"]


class MetricLoggers:
    """torchtitan's ``trainer.metrics_processor.logger`` (its TensorBoard/W&B container):
    keeps what is logged, by step."""

    def __init__(self):
        self.logged: dict[int, dict] = {}

    def log(self, metrics: dict, step: int) -> None:
        self.logged.setdefault(step, {}).update(metrics)


class MetricsProcessor:
    def __init__(self):
        self.logger = MetricLoggers()


class TrainState(Stateful):
    """torchtitan's Trainer as the "train_state" entry (with its metrics processor)."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0
        self.metrics_processor = MetricsProcessor()

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def build_model(world: int) -> nn.Module:
    torch.manual_seed(int(os.environ.get("TITAN_SEED", "0")))  # a resumed run starts elsewhere
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))
    if os.environ.get("TITAN_FLOAT8"):
        to_float8(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def to_float8(model: nn.Module) -> None:
    """Float8 training as torchtitan 0.3.0's Float8LinearConverter sets it up on a machine
    without float8 hardware (``emulate=True``): torchao's Float8Linear for every Linear whose
    dims are multiples of 16. (The converter module itself imports torchtitan's trainer
    dependencies, so its torchao config is built here, as it builds it.)"""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True), module_filter_fn=(
        lambda m, _fqn: m.in_features % 16 == 0 and m.out_features % 16 == 0))


def resume_summary(info) -> dict | None:
    return None if info is None else {"step": info.step, "source": info.source,
                                      "sources": info.sources, "reason": info.reason}


def main() -> None:
    base_folder, total = sys.argv[1], int(sys.argv[2])
    save_until = int(sys.argv[3]) if len(sys.argv) > 3 else total
    tag = os.environ.get("TITAN_TAG", "run")
    rank, world = init()
    model = build_model(world)
    optimizers = Optimizers(model)
    schedulers = Schedulers(optimizers.optim, total)
    dataloader, train_state = DataLoader(rank, world), TrainState()
    config = MemoryCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=INTERVAL, persistent_interval=PERSISTENT_INTERVAL,
        keep_latest_k=2, last_save_model_only=False, keep=2,
        load_step=int(os.environ.get("TITAN_LOAD_STEP", "-1")))
    checkpointer = config.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=schedulers, states={"train_state": train_state},
                                sd_adapter=None, base_folder=base_folder)
    try:
        checkpointer.load(step=config.load_step)
        resumed = train_state.step
        in_memory = sorted({e.step for e in checkpointer.checkpoints.checkpoints() if e.location == "memory"})
        losses = {}
        while train_state.step < total:
            train_state.step += 1
            step = train_state.step
            x, y = dataloader.next_batch()
            optimizers.optim.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            checkpointer.maybe_wait_for_staging()
            optimizers.optim.step()
            schedulers.sched.step()
            train_state.ntokens_seen += x.numel()
            losses[step] = loss.item()
            if step <= save_until:
                checkpointer.save(step, last_step=(step == total))
            if step == save_until:  # what survives the "crash" is complete and on both nodes
                checkpointer.checkpoints.wait()
                assert checkpointer.checkpoints.wait_replicated(step - step % INTERVAL, timeout=60)
        tensors = full_tensors({"model": model.state_dict(), "optim": optimizers.state_dict()})
        if rank == 0:
            torch.save(tensors, os.path.join(os.environ["TEST_OUT_DIR"], f"titan_{tag}.pt"))
        report(f"titan_{tag}", {"resumed_step": resumed, "losses": losses,
                                "resume": resume_summary(checkpointer.last_resume),
                                "position": dataloader.position, "memory_after_load": in_memory,
                                "lr": optimizers.optim.param_groups[0]["lr"],
                                "folder": sorted(os.listdir(checkpointer.folder)),
                                "torchtitan": os.path.dirname(torchtitan.__file__),
                                "layers": sorted({type(m).__name__ for m in model}),
                                "metrics": train_state.metrics_processor.logger.logged})
        if os.environ.get("TITAN_WAIT_AT_END"):
            time.sleep(120)
        if os.environ.get("TITAN_RAISE_AT_END"):
            if rank == 1:
                raise RuntimeError("injected failure on rank 1")
            dist.all_reduce(torch.ones(1))  # never completes: rank 1 is gone
    except Exception:
        checkpointer.close()
        raise
    else:
        checkpointer.close()


if __name__ == "__main__":
    main()
