"""The state dicts benchmarks save and load: seeded, shaped like a model's, rebuilt bit for bit
by a fresh process from the same seed; and the checks that a load reproduced them."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# Every tensor leaf of a nested state dict, in order: the library's own walker.
from mlcheckpoint.dcp.staging import tensors_of

__all__ = ["tensors_of"]  # and everything defined below

StateDict = dict[str, Any]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def fill_random(t: torch.Tensor, pool: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill ``t`` by tiling a random pool from a random start: realistic (finite, non-constant)
    values at memcpy speed, where torch.randn would take several seconds per GiB."""
    flat, src = t.view(-1), pool.to(t.dtype)
    start, pos, n = int(torch.randint(0, src.numel(), (1,), generator=gen)), 0, flat.numel()
    while pos < n:
        k = min(n - pos, src.numel() - start)
        flat[pos:pos + k].copy_(src[start:start + k])
        pos, start = pos + k, 0
    return t


def build_tensors(specs: list[TensorSpec], seed: int = 0, pool_elems: int = 1 << 20) -> dict[str, torch.Tensor]:
    """The tensors ``specs`` name, filled with seeded random values (the same seed, the same
    bytes: a fresh process can rebuild what it expects to load)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(pool_elems, generator=gen)
    return {s.name: fill_random(torch.empty(s.shape, dtype=s.dtype), pool, gen) for s in specs}


# Layout of bench_local, bench_gc, bench_first_saves: most bytes in a few large matrices
# (embeddings, MLP weights), the rest in a few hundred small tensors (norms, biases, small
# projections) of 4 KiB-1 MiB, float32 and bfloat16.
LARGE_COUNT = 5
LARGE_SHARE = 0.75
LARGE_COLS = 4096
SMALL_MIN, SMALL_MAX = 4 << 10, 1 << 20
SMALL_SUFFIXES = ("ln_1.weight", "ln_1.bias", "attn.proj.bias", "ln_2.weight", "mlp.fc.bias")


def model_layout(size_bytes: int, seed: int = 0) -> list[TensorSpec]:
    gen = torch.Generator().manual_seed(seed + 1)
    specs = []
    per_large = int(size_bytes * LARGE_SHARE) // LARGE_COUNT
    for i in range(LARGE_COUNT):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        rows = max(1, per_large // (LARGE_COLS * dtype.itemsize))
        specs.append(TensorSpec(f"blocks.{i}.mlp.fc.weight", (rows, LARGE_COLS), dtype))
    used, j = sum(s.nbytes for s in specs), 0
    while size_bytes - used >= SMALL_MIN:
        nbytes = min(size_bytes - used, int(torch.randint(SMALL_MIN, SMALL_MAX + 1, (1,), generator=gen)))
        dtype = torch.bfloat16 if torch.rand(1, generator=gen).item() < 0.5 else torch.float32
        name = f"blocks.{j // len(SMALL_SUFFIXES)}.{SMALL_SUFFIXES[j % len(SMALL_SUFFIXES)]}"
        specs.append(TensorSpec(name, (nbytes // dtype.itemsize,), dtype))
        used += specs[-1].nbytes
        j += 1
    return specs


def model_state_dict(size_bytes: int, seed: int = 0) -> tuple[StateDict, list[TensorSpec]]:
    """``{"model": {...}, "step": int, "run_name": str}`` of about ``size_bytes``, shaped like a
    model (see ``model_layout``), and its layout."""
    specs = model_layout(size_bytes, seed)
    return {"model": build_tensors(specs, seed), "step": 123456, "run_name": "bench-local"}, specs


# Layout of bench_replication's shard: 4 large matrices (90%), ~48 small float32 tensors.
SHARD_LARGE_COUNT, SHARD_LARGE_SHARE, SHARD_SMALL_COUNT = 4, 0.9, 48


def shard_layout(size_bytes: int, prefix: str = "", seed: int = 0) -> list[TensorSpec]:
    gen = torch.Generator().manual_seed(seed + 1)
    sizes = [int(SMALL_MIN * (SMALL_MAX / SMALL_MIN) ** float(torch.rand(1, generator=gen)))
             for _ in range(SHARD_SMALL_COUNT)]
    small_total = min(sum(sizes), int(size_bytes * (1 - SHARD_LARGE_SHARE)))
    per_large = (size_bytes - small_total) // SHARD_LARGE_COUNT
    specs = []
    for i in range(SHARD_LARGE_COUNT):
        dtype = torch.bfloat16 if i == SHARD_LARGE_COUNT - 1 else torch.float32
        rows = max(1, per_large // (LARGE_COLS * dtype.itemsize))
        specs.append(TensorSpec(f"{prefix}layers.{i}.mlp.weight", (rows, LARGE_COLS), dtype))
    used = 0
    for j, n in enumerate(sizes):
        n = min(n, small_total - used) // 4
        if n <= 0:
            break
        specs.append(TensorSpec(f"{prefix}layers.{j % SHARD_LARGE_COUNT}.norm{j}.weight", (n,), torch.float32))
        used += 4 * n
    return specs


def warm_target(sd: StateDict) -> StateDict:
    """Same structure and shapes, tensors allocated and touched (copied once), values reset:
    what a model's parameters are when it loads a checkpoint."""
    model = {k: torch.empty_like(t).copy_(t) for k, t in sd["model"].items()}
    target = {**sd, "model": model}
    scrub(target)
    return target


def scrub(target: StateDict) -> None:
    """Reset a load target, so a load that silently does nothing fails ``check_equal``."""
    for t in target["model"].values():
        t.zero_()
    for k, v in target.items():
        if k != "model":
            target[k] = type(v)()


def check_equal(expected: StateDict, got: StateDict, what: str) -> None:
    """Fail loudly if a load did not reproduce the state dict (a fast wrong load is no result)."""
    for k, t in expected["model"].items():
        if not torch.equal(t, got["model"][k]):
            raise AssertionError(f"{what}: tensor {k!r} differs after load")
    for k, v in expected.items():
        if k != "model" and got[k] != v:
            raise AssertionError(f"{what}: {k} is {got[k]!r}, expected {v!r}")


def state_dict_bytes(sd: StateDict) -> int:
    return sum(t.nbytes for t in sd["model"].values())


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """dcp.save/load without a process group warn on every call that they run single-process
    (and a FileSystemWriter that overwrites a checkpoint, on every call too)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*no_dist.*")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # we overwrite on purpose
        yield
