"""Shared helpers for worker scripts launched by torchrun in tests."""

import json
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mlcheckpoint.testing.cluster import write_result

# TEST_NO_LOGGING_SETUP=1: a worker that, like many training scripts, never sets logging up.
if not os.environ.get("TEST_NO_LOGGING_SETUP"):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s r%(process)d %(name)s %(levelname)s %(message)s")


def run_specs(run_job) -> None:
    """Run each job spec of ``sys.argv[1]`` (a JSON list) in turn as ``run_job(spec, rank,
    world, mesh)``, on one process group and a 1-D CPU device mesh."""
    rank, world = init()
    mesh = init_device_mesh("cpu", (world,))
    for spec in json.loads(sys.argv[1]):
        run_job(spec, rank, world, mesh)
    dist.destroy_process_group()


def init() -> tuple[int, int]:
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def model_state(rank: int, step: int, world: int = 2) -> dict:
    """A deterministic state dict of (rank, step): what a test expects to get back."""
    g = torch.Generator().manual_seed(1000 * step)  # replicated: equal on every rank
    r = torch.Generator().manual_seed(1000 * step + rank + 1)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g),
            "b16": torch.randn(128, generator=g).to(torch.bfloat16),
            "i64": torch.arange(10, dtype=torch.int64) * (step + 1),
            "view": torch.randn(16, 8, generator=g).t(),  # non-contiguous
        },
        # replicated across ranks (DDP-style): DCP writes it once, from the lowest rank
        "shared": torch.full((32,), float(step)),
        "extra": {"step": step, "name": f"run-{step}", "lr": [0.1, 0.01 * step]},
        # per-rank tensors under per-rank keys, so every rank's shard holds its own bytes
        f"rank{rank}": {"opt": torch.randn(1024, generator=r), "id": torch.full((4,), rank)},
    }


def empty_like(sd):
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: empty_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [empty_like(v) for v in sd]
    return type(sd)() if isinstance(sd, (int, float, str)) else None


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def report(name: str, data: dict) -> None:
    write_result(name, dist.get_rank() if dist.is_initialized() else 0, data)


def diff(a, b, path="") -> list[str]:
    """Paths where two state dicts differ (for test failure messages)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: missing" for k in a.keys() ^ b.keys()]
        for k in a.keys() & b.keys():
            out += diff(a[k], b[k], f"{path}.{k}")
        return out
    return [] if equal(a, b) else [path]
