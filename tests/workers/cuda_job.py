"""Worker: jobs whose training state lives on a CUDA device (every rank on the one GPU it sees).

argv: phase
  nccl_one_gpu - ``CheckpointManager(replication="nccl")`` on simulated nodes whose ranks
                 all use the one GPU: reports ("nccl") the error it raised (it must not hang).
  train        - 2 simulated nodes x 1 rank: first TOTAL steps with no checkpoint (the
                 reference: losses and a digest of parameters and AdamW state), then a fresh
                 run checkpointing every step with overlapped saves (``guard``), replicating
                 over TCP; reports "ready" once step STOP is replicated, then waits to be killed.
  resume       - the same job resumes straight into CUDA tensors and trains on to TOTAL;
                 reports "resumed".
  registrations - 2 simulated nodes x 1 rank replicating over a gloo group ("pg", whose
                 sender maps each committed shard whole): SAVES blocking saves, each waited
                 replicated; reports ("registrations") the cudaHostRegister calls each save's
                 thread made (the buffer warmer's apart).
  contexts     - 1 rank on cuda:1 (two GPUs or more): overlapped saves (staging thread,
                 buffer warmer, retention releasing buffers) and a resume; reports ("contexts")
                 whether device 0 has a primary context (the driver's own answer).

Each rank trains its own model (bf16 and fp32 parameters, AdamW) under keys of its own, so
every rank's shard holds its own bytes; the loss is averaged over ranks on the CPU (gloo).
"""

import hashlib
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: bit-exact runs

import torch
import torch.distributed as dist
from common import init, report
from torch import nn

from mlcheckpoint import CheckpointManager, ConfigError

STOP, TOTAL = 3, 7


class Mixed(nn.Module):
    """fp32 layers around a bf16 one: parameters and AdamW state of both dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 256)
        self.norm = nn.LayerNorm(256)
        self.mid = nn.Linear(256, 256).to(torch.bfloat16)
        self.out = nn.Linear(256, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.norm(self.inp(x)))
        return self.out(self.mid(h.to(torch.bfloat16)).float())


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Mixed().cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, rank: int) -> float:
    g = torch.Generator(device="cuda").manual_seed(10_000 + 100 * step + rank)
    x = torch.randn(32, 64, device="cuda", generator=g)
    y = torch.randn(32, 16, device="cuda", generator=g)
    optim.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()  # with a guard: waits here for the previous step's snapshot
    mean = loss.detach().cpu()
    dist.all_reduce(mean)  # on the CPU (gloo): both ranks share one GPU
    return mean.item()


def state(model: nn.Module, optim: torch.optim.Optimizer, rank: int) -> dict:
    return {f"r{rank}": {"model": model.state_dict(), "optim": optim.state_dict()}}


def digest(model: nn.Module, optim: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    tensors = [*model.state_dict().items()]
    tensors += [(f"{i}.{k}", v) for i, st in enumerate(optim.state.values()) for k, v in st.items()]
    for name, t in tensors:
        h.update(name.encode() + t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def nccl_one_gpu(rank: int) -> None:
    torch.cuda.set_device(0)
    started = time.monotonic()
    try:
        CheckpointManager(replication="nccl").close()
        out = {"error": None}
    except ConfigError as e:
        out = {"error": str(e)}
    report("nccl", {**out, "seconds": time.monotonic() - started})


def train(rank: int) -> None:
    model, optim = build()
    losses = [train_step(model, optim, s, rank) for s in range(TOTAL)]
    report("reference", {"losses": losses, "digest": digest(model, optim)})

    ckpt = CheckpointManager(replication="tcp")
    model, optim = build()
    ckpt.guard(optim)
    futures = []
    for step in range(STOP + 1):
        train_step(model, optim, step, rank)
        futures.append(ckpt.async_save(state(model, optim, rank), step))
    saves = [f.result() for f in futures]
    replicated = ckpt.wait_replicated(STOP, timeout=120)
    report("ready", {"replicated": replicated, "overlapped": [s.overlapped_bytes for s in saves],
                     "devices": sorted({t.device.type for t in model.parameters()})})
    while True:  # the node is lost here (SIGKILL)
        time.sleep(1)


def resume(rank: int) -> None:
    ckpt = CheckpointManager(replication="tcp")
    model, optim = build()
    train_step(model, optim, 0, rank)  # a fresh AdamW has no state to load into: one step makes it
    sd = state(model, optim, rank)
    info = ckpt.resume(sd)  # loads straight into the CUDA tensors of ``sd``
    optim.load_state_dict(sd[f"r{rank}"]["optim"])
    on_device = all(t.is_cuda for t in model.parameters()) and all(
        v.is_cuda for st in optim.state.values() for k, v in st.items() if k != "step")
    ckpt.guard(optim)
    losses = []
    for step in range(info.step + 1, TOTAL):
        losses.append(train_step(model, optim, step, rank))
        ckpt.async_save(state(model, optim, rank), step)
    ckpt.wait()
    report("resumed", {"step": info.step, "sources": info.sources, "losses": losses,
                       "digest": digest(model, optim), "on_device": on_device})
    ckpt.close()


SAVES = 8


def registrations(rank: int) -> None:
    import threading
    from collections import Counter

    from mlcheckpoint.store import buffers

    made: Counter[str] = Counter()  # buffers page-locked, by thread (counted for any revision)
    original = buffers.MappedFile.register_for_device_copies

    def counting(mapped, *args, **kwargs):
        before = mapped._cuda_registered
        original(mapped, *args, **kwargs)
        if not before and mapped._cuda_registered:
            made[threading.current_thread().name] += 1

    buffers.MappedFile.register_for_device_copies = counting
    from mlcheckpoint.store.pool import BufferPool

    prepared: list[tuple[int, int]] = []  # (owner, buffers made): why a save found none
    prewarm = BufferPool.prewarm

    def recording(pool, owner, nbytes, keep):
        made_now = prewarm(pool, owner, nbytes, keep)
        prepared.append((owner, made_now))
        return made_now

    BufferPool.prewarm = recording
    ckpt = CheckpointManager(replication="pg")
    model, optim = build()
    per_save = []
    for step in range(SAVES):
        train_step(model, optim, step, rank)
        before = sum(made.values()) - made["mlckpt-prepare"]
        ckpt.save(state(model, optim, rank), step)
        if not ckpt.wait_replicated(step, timeout=60):  # the sender has read the shard whole
            raise RuntimeError(f"step {step} was not replicated")
        per_save.append(sum(made.values()) - made["mlckpt-prepare"] - before)
    report("registrations", {"per_save": per_save, "warmer": made["mlckpt-prepare"],
                             "by_thread": dict(made), "prepared": prepared})
    ckpt.close()


def primary_context_active(device: int) -> bool:
    """Whether the driver holds a primary context of ``device`` in this process."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), device) == 0
    assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
    return bool(active.value)


def contexts(rank: int) -> None:
    torch.cuda.set_device(1)  # the rank's device: nothing of the library may touch device 0
    with CheckpointManager(replication="none", keep=2) as ckpt:
        model, optim = build()
        ckpt.guard(optim)
        for step in range(6):  # enough for retention to retire (release) buffers
            train_step(model, optim, step, rank)
            ckpt.async_save(state(model, optim, rank), step)
        ckpt.wait()
        model, optim = build()
        train_step(model, optim, 0, rank)
        ckpt.resume(state(model, optim, rank))
        torch.cuda.synchronize()
        time.sleep(1)  # the warmer's last buffer
    report("contexts", {"device0": primary_context_active(0), "device1": primary_context_active(1)})


def main() -> None:
    phase = sys.argv[1]
    torch.use_deterministic_algorithms(True)
    rank, _ = init()
    {"nccl_one_gpu": nccl_one_gpu, "train": train, "resume": resume,
     "registrations": registrations, "contexts": contexts}[phase](rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
