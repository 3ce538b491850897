"""Worker: a DDP-like job (every rank holds the same model and AdamW state) with guarded,
overlapped saves every step, where DCP's plan gives each rank about half of the items.

argv: phase
  train   - 2 ranks, one per node. STEPS steps, ``async_save`` after each. At the CHANGED
            steps rank 0 adds a large tensor of its own first in its state dict: DCP's
            de-duplication then gives rank 1 every shared item, though rank 1's stage
            predicted half (its state dict did not change). Reports ("saves") per step what
            each rank staged, committed and replicated, the bytes the metadata assigns it,
            and whether every step loads back exactly what was saved; then ("ready") and
            waits to be killed.
  resume  - resume the job (node 1 was lost and wiped), report ("resumed") the digest of
            the state it loaded.
"""

import hashlib
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import init, report
from torch import nn

from mlcheckpoint import CheckpointManager
from mlcheckpoint.store.shards import align
from mlcheckpoint.testing import internals

STEPS = 7
CHANGED = (3, 4)  # rank 0's state dict has an extra entry at these steps


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same on every rank, as DDP keeps it
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)  # the same batch on every rank: equal gradients
    optim.zero_grad()
    model(torch.randn(16, 64, generator=g)).square().mean().backward()
    optim.step()  # the guard waits here for the previous step's snapshot


def state(model: nn.Module, optim: torch.optim.Optimizer, rank: int, step: int) -> dict:
    sd = {"model": model.state_dict(), "optim": optim.state_dict()}
    if rank == 0 and step in CHANGED:  # first in the plan: DCP weighs it before the rest
        sd = {"big0": torch.full((96 * 1024,), float(step)), **sd}
    return sd


def tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensors(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(tensors(v, f"{prefix}{i}."))
    elif isinstance(obj, torch.Tensor):
        out[prefix.removesuffix(".")] = obj.detach().clone()  # DCP's fqn of the tensor
    return out


def digest(flat: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(flat):
        h.update(k.encode() + flat[k].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def without_copies(ckpt: CheckpointManager) -> CheckpointManager:
    """The de-duplicated mode (what a node without room for data parallelism's copies falls
    back to, dcp/copies.py): with copies, each node would keep the whole state and send none."""
    internals(ckpt).saver.copy_policy = None
    return ckpt


def train(rank: int) -> None:
    ckpt = without_copies(CheckpointManager(keep=STEPS + 1))
    model, optim = build()
    train_step(model, optim, -1)  # AdamW's state exists before the guard takes its storages
    ckpt.guard(optim)
    futures, expected, state_bytes = [], {}, {}
    for step in range(STEPS):
        train_step(model, optim, step)
        sd = state(model, optim, rank, step)
        expected[step] = tensors(sd)
        state_bytes[step] = sum(t.numel() * t.element_size() for t in expected[step].values())
        futures.append(ckpt.async_save(sd, step))  # the next train_step changes what it saved
    saves = [f.result() for f in futures]
    replicated = ckpt.wait_replicated(STEPS - 1, timeout=60)
    out = {}
    for step, s in enumerate(saves):
        md = ckpt.storage_reader(step).read_metadata()
        mine = [loc for loc in md.storage_data.values() if loc.rank == rank]
        # This rank's own items, read from its shard (the other rank checks the rest; a step
        # that was superseded has no replica here to read the others from).
        loaded = {idx.fqn: torch.zeros_like(expected[step][idx.fqn])
                  for idx, loc in md.storage_data.items()
                  if loc.rank == rank and idx.fqn in expected[step]}
        dcp.load(loaded, storage_reader=ckpt.storage_reader(step))
        st = ckpt.replication_state(step)
        out[step] = {
            "state_bytes": state_bytes[step],
            "data_bytes": s.bytes,
            "staged_bytes": getattr(s, "staged_bytes", None),
            "referenced_end": max((loc.offset + loc.nbytes for loc in mine), default=0),
            "referenced_aligned": sum(align(loc.nbytes) for loc in mine),
            "referenced": sum(loc.nbytes for loc in mine),
            "referenced_tensors": sum(align(loc.nbytes) for loc in mine if loc.is_tensor),
            "replicated_bytes": st.bytes if st is not None and st.state == "replicated" else None,
            "checked": len(loaded),
            "differs": sorted(k for k, v in loaded.items() if not torch.equal(v, expected[step][k])),
        }
    report("saves", out)
    report("ready", {"replicated": replicated, "digest": digest(expected[STEPS - 1])})
    while True:  # the node is lost here (SIGKILL)
        time.sleep(1)


def resume(rank: int) -> None:
    ckpt = without_copies(CheckpointManager(keep=STEPS + 1))
    model, optim = build()
    train_step(model, optim, -1)  # AdamW's state, to load into
    sd = state(model, optim, rank, STEPS - 1)
    info = ckpt.resume(sd)
    report("resumed", {"step": info.step, "sources": info.sources,
                       "digest": digest(tensors(sd))})
    ckpt.close()


def main() -> None:
    phase = sys.argv[1]
    rank, _ = init()
    if phase == "train":
        train(rank)
    else:
        resume(rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
