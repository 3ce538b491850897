"""A small transformer language model trained with FSDP2 + AdamW, checkpointed by mlcheckpoint.

Runs on CPU with gloo (as in the demo) and unchanged on GPUs with NCCL:

    torchrun --nnodes=2 --nproc-per-node=2 ... examples/train_fsdp.py --steps 20 --out run.json

Every step is saved to memory with async_save (replicated to the partner node), overlapped
with the next step: ``ckpt.guard(optim)`` makes ``optim.step()`` wait for the snapshot, so
``async_save`` returns at once and the copy runs during the next forward and backward. Every
``--persist-every`` steps a persistent DCP checkpoint is written too. At start the job resumes
from the newest checkpoint that survived. Data and initialisation are seeded, so a resumed
run reproduces an uninterrupted one bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from mlcheckpoint import CheckpointManager

log = logging.getLogger("train_fsdp")

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 256, 64, 4, 2, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch_for(step: int, rank: int, device: torch.device) -> torch.Tensor:
    """Synthetic data, a pure function of (step, rank): a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    # a learnable pattern: token t+1 = (token t * 3 + 1) mod VOCAB, from a random start
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    seq = [start]
    for _ in range(SEQ):
        seq.append((seq[-1] * 3 + 1) % VOCAB)
    return torch.cat(seq, dim=1).to(device)


class TrainingState(Stateful):
    """What a checkpoint holds: the sharded model and optimizer states and the loss history.
    DCP calls ``state_dict`` only when it saves or loads a checkpoint, so a fresh start never
    reads the optimizer's state: ``get_state_dict`` creates it on an optimizer that has not
    stepped yet, and the run would no longer train as it does without checkpoints."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, losses: torch.Tensor):
        self.model, self.optim, self.losses = model, optim, losses

    def state_dict(self) -> dict:
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd, "losses": self.losses}  # losses: loaded in place

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])


def params_digest(model: nn.Module) -> str:
    """A hash of the full (unsharded) parameters; collective."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(name.encode())
        h.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--persist-every", type=int, default=10)
    ap.add_argument("--persistent-dir", default=os.environ.get("PERSISTENT_DIR"))
    ap.add_argument("--out", help="JSON file for rank 0's losses and final digest")
    ap.add_argument("--progress", help="file rank 0 appends 'step' lines to (the demo watches it)")
    ap.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [rank %(rank)s] %(message)s")
    cuda = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank = dist.get_rank()
    for h in logging.getLogger().handlers:
        h.addFilter(lambda r: setattr(r, "rank", rank) or True)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.use_deterministic_algorithms(True)

    torch.manual_seed(0)  # identical init on every rank, then sharded
    model = TinyLM().to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)

    ckpt = CheckpointManager(persistent_dir=args.persistent_dir)
    # Fixed-shape tensors round-trip exactly; DCP matches keys, so a list that grows would not.
    losses = torch.zeros(args.steps, dtype=torch.float64)
    state = {"training": TrainingState(model, optim, losses)}
    info = ckpt.resume(state)  # nothing is read on a fresh start
    start = 0 if info.step is None else info.step + 1
    ckpt.guard(optim)  # optim.step() waits for the snapshot in flight: async_save need not
    if rank == 0:
        log.info("resume: step=%s source=%s sources=%s %.3fs %s", info.step, info.source,
                     info.sources, info.seconds, info.reason or "")

    for step in range(start, args.steps):
        tokens = batch_for(step, rank, device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        # The job's mean loss: equal on every rank. (DCP treats a plain tensor saved under the
        # same key by every rank as replicated and keeps one copy, so it must be equal.)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses[step] = mean.item() / dist.get_world_size()
        t0 = time.perf_counter()
        ckpt.async_save(state, step,
                        persistent=bool(args.persistent_dir) and (step + 1) % args.persist_every == 0)
        blocked = time.perf_counter() - t0
        if rank == 0:
            log.info("step %d loss %.4f (checkpoint blocked training %.1f ms; longest wait at "
                     "the guard %.1f ms)", step, losses[step], blocked * 1e3,
                     ckpt.stats()["mlcheckpoint/guard_longest_wait_seconds"] * 1e3)
            if args.progress:
                with open(args.progress, "a") as f:
                    f.write(f"{step}\n")
        if args.step_delay:
            time.sleep(args.step_delay)

    ckpt.wait()
    digest = params_digest(model)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses.tolist(), "digest": digest, "resumed_from": info.step,
                       "resume_source": info.source, "resume_sources": info.sources,
                       "resume_labels": info.labels, "resume_summary": info.summary,
                       "resume_seconds": info.seconds}, f)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
