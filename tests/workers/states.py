"""The state dicts tests save and expect back, and how they are compared: one home for the test
modules (through tests/helpers.py) and the worker scripts alike. It lives here because a
worker runs with tests/workers first on its path; tests/tcp_job.py (imported by conftest.py)
puts the folder on the test modules' path too. Needs only torch.

- ``make_state``: a deterministic state dict of a step, of one process or of a job's rank;
- ``zeros_like_state``: what a load fills (same structure, tensors zeroed);
- ``clone_state``: a copy that training may not change;
- ``differences`` (the paths where two state dicts differ, bit-exact), and ``assert_same``.
"""

from __future__ import annotations

from typing import Any

import torch


def make_state(step: int = 0, rank: int | None = None) -> dict[str, Any]:
    """A deterministic state dict of ``step``: what a test saves and expects back.

    Without ``rank``: every dtype and layout DCP must carry (NaN/inf/-0.0, empty, strided,
    non-tensors), as one process saves it. With ``rank``: what that rank of a job saves:
    tensors equal on every rank (DCP writes them once, from the lowest rank) and, under the
    rank's own key, tensors of its own, so that every rank's shard holds bytes of its own."""
    if rank is not None:
        return _rank_state(rank, step)
    g = torch.Generator().manual_seed(step)
    f32 = torch.randn(17, 9, generator=g)
    f32[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, float("-inf")])
    base = torch.randn(12, 10, generator=g, dtype=torch.float64)
    return {
        "model": {
            "f32": f32,
            "f16": torch.randn(33, generator=g).to(torch.float16),
            "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
            "f64": torch.randn(3, 3, generator=g, dtype=torch.float64),
            "layer": {"i8": torch.randint(-128, 127, (19,), generator=g, dtype=torch.int8),
                      "i32": torch.randint(-2**31, 2**31 - 1, (4, 4), generator=g, dtype=torch.int32)},
        },
        "i64": torch.randint(-2**62, 2**62, (6,), generator=g, dtype=torch.int64),
        "mask": torch.rand(23, generator=g) > 0.5,
        "c64": torch.randn(8, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(3.25 + step),
        "scalar_i": torch.tensor(-7 - step, dtype=torch.int64),
        "empty": torch.empty(0),
        "empty2d": torch.zeros(0, 5, dtype=torch.int32),
        "transposed": torch.randn(6, 4, generator=g).t(),
        "strided": base[::3, 1::2],
        "extra": {"step": 10 + step, "lr": 0.125 * (step + 1), "name": f"run-{step}",
                  "hist": [1, 2.5, "three"], "nested": {"deep": {"k": [step, step + 1]}}},
    }


def _rank_state(rank: int, step: int) -> dict[str, Any]:
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


def zeros_like_state(sd):
    """Same structure, tensors zeroed (contiguous), non-tensors replaced by placeholders."""
    if isinstance(sd, torch.Tensor):
        return torch.zeros(sd.shape, dtype=sd.dtype)
    if isinstance(sd, dict):
        return {k: zeros_like_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like_state(v) for v in sd]
    return None


def clone_state(sd):
    """A copy whose tensors training may not change (detached from autograd)."""
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone()
    if isinstance(sd, dict):
        return {k: clone_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [clone_state(v) for v in sd]
    return sd


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, as a flat uint8 tensor (a view where ``t`` is contiguous on the CPU)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def raw_bytes(t: torch.Tensor) -> bytes:
    # A copy first: numpy sharing a live tensor's storage would make it unresizable.
    return bits(t).clone().numpy().tobytes()


def differences(expected, actual, path: str = "sd") -> list[str]:
    """The paths where ``actual`` differs from ``expected``: tensors bit for bit (NaN and -0.0
    included) with their dtype and shape, dicts and lists entry by entry, other values by type
    and ``==``."""
    if isinstance(expected, torch.Tensor):
        same = (isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype
                and actual.shape == expected.shape and torch.equal(bits(actual), bits(expected)))
        return [] if same else [path]
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [path]
        out = [f"{path}.{k}: missing" for k in expected.keys() ^ actual.keys()]
        for k in expected.keys() & actual.keys():
            out += differences(expected[k], actual[k], f"{path}.{k}")
        return out
    if isinstance(expected, list) and any(isinstance(v, (torch.Tensor, dict, list)) for v in expected):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return [path]
        return [d for i, (e, a) in enumerate(zip(expected, actual))
                for d in differences(e, a, f"{path}.{i}")]
    return [] if type(actual) is type(expected) and actual == expected else [path]


def assert_same(expected, actual, path: str = "sd") -> None:
    """``differences`` finds none."""
    assert differences(expected, actual, path) == []
