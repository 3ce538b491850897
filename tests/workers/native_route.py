"""Worker: the DCP-native route as docs/integration.md writes it, under FSDP2 on gloo.

argv: phase
  train   - first TOTAL steps without checkpoints (the reference: losses and a digest of the
            parameters), then a fresh run that saves every step up to STOP with
            ``dcp.async_save(..., storage_writer=ckpt.storage_writer(step),
            process_group=ckpt.process_group)`` while a ``FileSystemWriter`` ``dcp.async_save``
            every PERSIST_EVERY steps, on a group of its own, is in flight beside it; waits
            for STOP to be replicated, reports "ready" (and what the manager says), then waits
            to be killed.
  resume  - resume the same job into a model built differently, train on to TOTAL, report
            "resumed".
  refused - one node: ``dcp.async_save`` with the manager's writer on the default group is
            refused on every rank before any collective; the same save with
            ``process_group=ckpt.process_group`` then commits. Reports "refused".
  routes  - argv[2:]: "<job id>:<route>" specs, one job each: SAVES saves by ``route``
            ("manager": ``ckpt.async_save``; "dcp": ``dcp.save``; "dcp_async": THREAD mode;
            "dcp_async_process": PROCESS mode), then close. Reports "route-<job id>".
"""

import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import init, report
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mlcheckpoint import CheckpointManager, ConfigError
from mlcheckpoint.testing import internals

STOP, TOTAL, PERSIST_EVERY = 21, 25, 5  # also in tests/jobs/test_native_route.py
SAVES = 4


class TrainState:
    """The data position: the next step to train."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def build(world: int, seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 32),
                          nn.LayerNorm(32), nn.Linear(32, 8))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, (nn.Linear, nn.LayerNorm)):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + 0.1 * s))
    return model, optim, sched


def train_step(model, optim, sched, rank: int) -> float:
    """One step on data drawn from the global RNG (which the checkpoint holds per rank)."""
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    optim.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    sched.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # the training thread's own collective on the default group
    return mean.item()


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode() + full.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def watch_warmer(ckpt: CheckpointManager) -> list[int]:
    """The owners whose next buffers the manager asks its warmer to prepare, from now on."""
    warmer, asked = internals(ckpt).warmer, []
    prepare = warmer.prepare

    def watched(owner: int, nbytes: int) -> None:
        asked.append(owner)
        prepare(owner, nbytes)

    warmer.prepare = watched  # type: ignore[method-assign]
    return asked


def states(model, optim, sched, train_state: TrainState, rank: int) -> dict:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "sched": sched, "train": train_state,
            f"rng/{rank}": torch.get_rng_state()}


def train(rank: int, world: int) -> None:
    model, optim, sched = build(world, seed=0)
    torch.manual_seed(1000 + rank)
    losses = [train_step(model, optim, sched, rank) for _ in range(TOTAL)]
    report("reference", {"losses": losses, "digest": digest(model)})

    folder = os.environ["TEST_PERSISTENT_DIR"]
    ckpt = CheckpointManager(persistent_dir=folder, keep=2)
    warmed = watch_warmer(ckpt)
    persist_pg = dist.new_group(backend="gloo")  # the persistent saves' own group
    model, optim, sched = build(world, seed=0)
    torch.manual_seed(1000 + rank)
    train_state = TrainState()
    ram = disk = None
    for step in range(STOP + 1):
        train_step(model, optim, sched, rank)
        train_state.step = step + 1
        sd = states(model, optim, sched, train_state, rank)
        if ram is not None:
            ram.result()  # one in-memory save in flight at a time, as with any DCP save
        ram = dcp.async_save(sd, storage_writer=ckpt.storage_writer(step),
                             process_group=ckpt.process_group)
        if step % PERSIST_EVERY == 0:
            if disk is not None:
                disk.result()
            path = os.path.join(folder, f"step-{step:012d}")  # the layout persistent_dir reads
            disk = dcp.async_save(sd, storage_writer=FileSystemWriter(path), process_group=persist_pg)
    ram.result()
    disk.result()
    ckpt.wait()  # publishes the last save
    replicated = ckpt.wait_replicated(STOP, timeout=90)
    report("ready", {"replicated": replicated,
                     "stats_step": ckpt.stats().get("mlcheckpoint/save_step"),
                     "warmed": rank in warmed})
    while True:  # the node is lost here (SIGKILL)
        time.sleep(1)


def resume(rank: int, world: int) -> None:
    ckpt = CheckpointManager(persistent_dir=os.environ["TEST_PERSISTENT_DIR"], keep=2)
    model, optim, sched = build(world, seed=1234)  # another init: only a real load matches
    torch.manual_seed(5)
    train_step(model, optim, sched, rank)  # creates AdamW's state to load into
    train_state = TrainState()
    sd = states(model, optim, sched, train_state, rank)
    info = ckpt.resume(sd)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    torch.set_rng_state(sd[f"rng/{rank}"])
    losses = [train_step(model, optim, sched, rank) for _ in range(train_state.step, TOTAL)]
    report("resumed", {"step": info.step, "sources": info.sources, "next": train_state.step,
                       "losses": losses, "digest": digest(model)})
    ckpt.close()


def refused(rank: int) -> None:
    ckpt = CheckpointManager(replication="none")
    sd = {f"r{rank}": torch.arange(1000, dtype=torch.float32) + rank}
    try:
        dcp.async_save(sd, storage_writer=ckpt.storage_writer(0)).result(timeout=60)
        error = None
    except ConfigError as e:
        error = str(e)
    dcp.async_save(sd, storage_writer=ckpt.storage_writer(1),
                   process_group=ckpt.process_group).result(timeout=60)
    ckpt.wait()
    report("refused", {"error": error, "complete": internals(ckpt).store.inventory.complete_steps()})
    ckpt.close()


def routes(rank: int, specs: list[str]) -> None:
    for spec in specs:
        job_id, route = spec.split(":")
        ckpt = CheckpointManager(job_id=job_id, keep=2)
        warmed = watch_warmer(ckpt)
        for step in range(SAVES):
            sd = {f"r{rank}": torch.full((64, 1024), float(step + rank)), "shared": torch.ones(256) * step}
            if route == "manager":
                ckpt.async_save(sd, step)
            elif route == "dcp":
                dcp.save(sd, storage_writer=ckpt.storage_writer(step), process_group=ckpt.process_group)
            else:
                kind = (AsyncCheckpointerType.PROCESS if route == "dcp_async_process"
                        else AsyncCheckpointerType.THREAD)
                dcp.async_save(sd, storage_writer=ckpt.storage_writer(step),
                               process_group=ckpt.process_group,
                               async_checkpointer_type=kind).result(timeout=120)
        ckpt.wait()
        replicated = ckpt.wait_replicated(SAVES - 1, timeout=90)
        report(f"route-{job_id}", {"replicated": replicated,
                                   "stats_step": ckpt.stats().get("mlcheckpoint/save_step"),
                                   "warmed": rank in warmed})
        ckpt.close()


def main() -> None:
    phase = sys.argv[1]
    rank, world = init()
    if phase == "train":
        train(rank, world)
    elif phase == "resume":
        resume(rank, world)
    elif phase == "refused":
        refused(rank)
    else:
        routes(rank, sys.argv[2:])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
