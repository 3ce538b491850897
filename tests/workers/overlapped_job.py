"""Worker: overlapped saves (``ckpt.guard(optimizer)``) in real multi-rank jobs.

argv: phase
  native    - 2 ranks. DCP-native ``dcp.async_save(sd, storage_writer=ckpt.storage_writer(s))``
              in THREAD and PROCESS modes with a guarded optimizer: an AsyncSaveResponse
              comes back, the rank waits on ``staging_completion`` before optimizer.step();
              then an overlapped save whose copy fails on rank 1 only (a guarded tensor
              resized before the copy ran). Reports ("native") what each rank saw.
  train     - an FSDP2 model with AdamW and an LR scheduler: first TOTAL steps with no
              checkpoint (the reference: losses and a digest of the parameters), then a fresh
              run checkpointing with overlapped saves every step up to STOP, waiting for the
              last one to be replicated; reports "ready", then waits to be killed.
  resume    - resume the same job, train on to TOTAL, report ("resumed").
"""

import hashlib
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import init, report
from states import clone_state, differences, zeros_like_state
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mlcheckpoint import CheckpointManager, StagingError
from mlcheckpoint.testing import internals

STOP, TOTAL = 3, 6


# --------------------------------------------------------------------------- native
def small(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def local_step(model: nn.Module, optim: torch.optim.Optimizer, i: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * i + rank)
    optim.zero_grad()
    model(torch.randn(8, 16, generator=g)).square().mean().backward()
    optim.step()


def differs(ckpt: CheckpointManager, step: int, expected: dict) -> list[str]:
    """Where ``step``, loaded, differs from ``expected``."""
    target = zeros_like_state(expected)
    dcp.load(target, storage_reader=ckpt.storage_reader(step))
    return differences(expected, target)


def native(rank: int) -> None:
    ckpt = CheckpointManager(replication="none", keep=16)
    model, optim = small(0)
    local_step(model, optim, 0, rank)
    ckpt.guard(optim)
    # Each rank's state under its own keys: every rank's shard holds bytes of its own.
    flat = lambda: {f"r{rank}": {**model.state_dict(), **{
        f"opt.{i}.{k}": v for i, st in enumerate(optim.state.values()) for k, v in st.items()}}}
    out: dict = {}
    for step, mode in ((1, AsyncCheckpointerType.THREAD), (2, AsyncCheckpointerType.PROCESS)):
        expected = clone_state(flat())
        writer = ckpt.storage_writer(step)
        resp = dcp.async_save(flat(), storage_writer=writer, process_group=ckpt.process_group,
                              async_checkpointer_type=mode)
        out[f"{mode.value}_response"] = isinstance(resp, AsyncSaveResponse)
        out[f"{mode.value}_overlapped"] = writer.overlapped_bytes
        resp.staging_completion.result()
        local_step(model, optim, step, rank)  # changes every tensor saved
        resp.upload_completion.result()
        out[f"{mode.value}_differs"] = differs(ckpt, step, expected)
        out[f"{mode.value}_changed"] = differences(expected, flat())

    # A failure of the background copy on rank 1 only.
    ckpt.save(flat(), 3)
    saved3 = clone_state(flat())
    gate = threading.Event()
    internals(ckpt).snapshots.submit(lambda copied: gate.wait(), label=-1)  # hold the staging thread
    fut = ckpt.async_save(flat(), 4)
    if rank == 1:
        weight = optim.state[model[0].weight]["exp_avg"]
        kept = weight.clone()
        weight.resize_(1 << 16)
    gate.set()
    try:
        local_step(model, optim, 4, rank)
        out["guard"] = "ok"
    except StagingError as e:
        out["guard"] = type(e).__name__
        weight.resize_(kept.shape).copy_(kept)
    out["future"] = type(fut.exception()).__name__ if fut.exception() else "ok"
    out["future_text"] = str(fut.exception())
    try:
        ckpt.async_save(flat(), 5).result()
        out["next_save"] = "ok"
    except StagingError as e:
        out["next_save"] = type(e).__name__
    out["after"] = ckpt.async_save(flat(), 6).result().step
    out["step4_complete"] = 4 in internals(ckpt).store.inventory.complete_steps()
    out["step3_differs"] = differs(ckpt, 3, saved3)
    ckpt.close()
    report("native", out)


# --------------------------------------------------------------------------- train / resume
def build(world: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, optim, torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)


def train_step(model, optim, sched, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(10_000 + 100 * step + rank)
    optim.zero_grad()
    loss = nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 8, generator=g))
    loss.backward()
    optim.step()  # the guard waits here for the previous step's snapshot
    sched.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item()


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode() + full.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def local_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in local_tensors(v)]
    if isinstance(obj, DTensor):
        return [obj.to_local()]
    return [obj] if isinstance(obj, torch.Tensor) else []


def train(rank: int, world: int) -> None:
    model, optim, sched = build(world)
    losses = [train_step(model, optim, sched, s, rank) for s in range(TOTAL)]
    report("reference", {"losses": losses, "digest": digest(model)})

    ckpt = CheckpointManager()
    model, optim, sched = build(world)
    ckpt.guard(optim)
    results, tensor_bytes = [], []
    for step in range(STOP + 1):
        train_step(model, optim, sched, step, rank)
        msd, osd = get_state_dict(model, optim)
        results.append(ckpt.async_save({"model": msd, "optim": osd, "sched": sched}, step))
        tensor_bytes.append(sum(t.numel() * t.element_size() for t in local_tensors([msd, osd])))
    saves = [f.result() for f in results]
    replicated = ckpt.wait_replicated(STOP, timeout=60)
    report("ready", {"replicated": replicated, "tensor_bytes": tensor_bytes,
                     "overlapped": [r.overlapped_bytes for r in saves]})
    while True:  # the node is lost here (SIGKILL)
        time.sleep(1)


def resume(rank: int, world: int) -> None:
    ckpt = CheckpointManager()
    model, optim, sched = build(world)
    # A fresh optimizer has no state to load into: one step creates it (then overwritten).
    train_step(model, optim, sched, 0, rank)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "sched": sched}
    info = ckpt.resume(state)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    ckpt.guard(optim)
    losses = []
    for step in range(info.step + 1, TOTAL):
        losses.append(train_step(model, optim, sched, step, rank))
        msd, osd = get_state_dict(model, optim)
        ckpt.async_save({"model": msd, "optim": osd, "sched": sched}, step)
    ckpt.wait()
    report("resumed", {"step": info.step, "source": info.source, "sources": info.sources,
                       "losses": losses, "digest": digest(model)})
    ckpt.close()


def main() -> None:
    phase = sys.argv[1]
    rank, world = init()
    if phase == "native":
        native(rank)
    elif phase == "train":
        train(rank, world)
    else:
        resume(rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
