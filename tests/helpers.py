"""Helpers shared by the test modules (test modules never import each other).

- waiting: ``wait_for``
- damage: ``flip_byte``, ``flip_shard_byte``
- a real, small tmpfs: ``mounted_tmpfs``
- shards written straight into a LocalStore: ``payload``, ``begin``, ``put_shard``,
  ``put_metadata``, ``put_step``, ``pool_files``
- state dicts: ``make_state``, ``zeros_like_state``, ``clone_state``, ``assert_same``

Simulated clusters live in mlcheckpoint/testing: cluster.py (loopback; tests/cluster.py names
the workers directory) and netcluster.py (network namespaces joined by shaped links); TCP
endpoints joined in one job in tcp_job.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from mlcheckpoint import LocalStore
from mlcheckpoint.integrity.checksum import checksum
from mlcheckpoint.store.manifest import Manifest, ManifestItem
from mlcheckpoint.waiting import deadline_in, wait_until

WAIT = 120  # generous bound on waiting for another process/thread (never asserted on)

T = TypeVar("T")


# --------------------------------------------------------------------------- torchtitan
# Where scripts/setup.sh --test puts torchtitan 0.3.0: outside the environment's site-packages
# (its trainer's dependencies are not installed), so tests put it on the path themselves.
TORCHTITAN_0_3_0 = os.environ.get(
    "MLCHECKPOINT_TORCHTITAN",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "torchtitan-0.3.0"))


def torchtitan_integration(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``mlcheckpoint.integrations.torchtitan``, importable with torchtitan 0.3.0 from where
    scripts/setup.sh --test puts it; skips the test without it."""
    monkeypatch.syspath_prepend(TORCHTITAN_0_3_0)
    return pytest.importorskip("mlcheckpoint.integrations.torchtitan")


# --------------------------------------------------------------------------- waiting
def wait_for(cond: Callable[[], T], what: str, timeout: float = WAIT, interval: float = 0.02,
             diag: Callable[[], str] = lambda: "") -> T:
    """Poll ``cond`` until truthy and return its value; fail (with ``diag()``) when it never
    becomes so within ``timeout`` seconds (a bound on a hang, not a timing assertion)."""
    v = wait_until(cond, deadline_in(timeout), interval)
    if not v:
        pytest.fail(f"gave up waiting for {what}\n{diag()}")
    return v


def end_peer(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Let a peer worker that serves until its stdin closes finish; SIGKILL its process group
    if it is not gone within ``timeout`` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


# --------------------------------------------------------------------------- damage
def flip_byte(path: str, offset: int) -> None:
    """Invert every bit of the byte at ``offset`` of the file at ``path``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def flip_shard_byte(local_dir: str, job_id: str, step: int, owner: int) -> str:
    """Flip one byte in the middle of the largest item of a committed shard (located through
    its manifest); return the item's key."""
    store = LocalStore(local_dir, job_id, create=False)
    try:
        path, m = store.data_path(step, owner), store.read_manifest(step, owner)
    finally:
        store.close()
    item = max(m.items, key=lambda it: it.nbytes)
    assert item.nbytes > 0, m
    flip_byte(path, item.offset + item.nbytes // 2)
    return item.key


# --------------------------------------------------------------------------- a real, small tmpfs
@contextlib.contextmanager
def mounted_tmpfs(path: str, options: str) -> Iterator[str]:
    """A tmpfs of its own mounted at ``path`` (made if missing) with mount ``options`` (e.g.
    "size=8m"), unmounted afterwards, pass or fail; skips the test where mounting is refused."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path],
                         capture_output=True, text=True, check=False)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here (needs root/CAP_SYS_ADMIN): "
                    f"{res.stderr.strip() or res.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


# --------------------------------------------------------------------------- shards in a store
def payload(step: int, rank: int, nbytes: int = 4096) -> bytes:
    """Deterministic bytes that differ per (step, rank)."""
    return np.random.default_rng(step * 1000 + rank).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def begin(store: LocalStore, step: int, rank: int, data: bytes):
    """Fill an uncommitted shard with two items (halves of ``data``); return the writer."""
    sw = store.begin_shard(step, rank, len(data))
    sw.buffer.array[:] = np.frombuffer(data, dtype=np.uint8)
    half = len(data) // 2
    sw.add_item(ManifestItem("first", 0, half, checksum(data[:half]), dtype="uint8", shape=[half]))
    sw.add_item(ManifestItem("second", half, len(data) - half, checksum(data[half:])))
    return sw


def put_shard(store: LocalStore, step: int, rank: int, data: bytes | None = None) -> Manifest:
    return begin(store, step, rank, payload(step, rank) if data is None else data).commit()


def put_metadata(store: LocalStore, step: int, ranks=(0,)) -> None:
    store.write_metadata(step, f"meta-of-{step}".encode(), world_size=max(ranks) + 1,
                         ranks=ranks, total_bytes=4096 * len(ranks))


def put_step(store: LocalStore, step: int, ranks=(0,)) -> None:
    for r in ranks:
        put_shard(store, step, r)
    put_metadata(store, step, ranks)


def pool_files(store: LocalStore) -> list[str]:
    return sorted(os.path.join(store.pool_dir, n) for n in os.listdir(store.pool_dir))


# --------------------------------------------------------------------------- state dicts
def make_state(seed: int = 0) -> dict[str, Any]:
    """Every dtype and layout DCP must carry: NaN/inf/-0.0, empty, strided, non-tensors."""
    g = torch.Generator().manual_seed(seed)
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
        "scalar": torch.tensor(3.25 + seed),
        "scalar_i": torch.tensor(-7 - seed, dtype=torch.int64),
        "empty": torch.empty(0),
        "empty2d": torch.zeros(0, 5, dtype=torch.int32),
        "transposed": torch.randn(6, 4, generator=g).t(),
        "strided": base[::3, 1::2],
        "extra": {"step": 10 + seed, "lr": 0.125 * (seed + 1), "name": f"run-{seed}",
                  "hist": [1, 2.5, "three"], "nested": {"deep": {"k": [seed, seed + 1]}}},
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
    if isinstance(sd, torch.Tensor):
        return sd.clone()
    if isinstance(sd, dict):
        return {k: clone_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [clone_state(v) for v in sd]
    return sd


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(expected, actual, path="sd") -> None:
    """Bit-exact equality (NaN and -0.0 included), dtypes and shapes too."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert raw_bytes(actual) == raw_bytes(expected), path
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), path
        for k in expected:
            assert_same(expected[k], actual[k], f"{path}.{k}")
    else:
        assert type(actual) is type(expected) and actual == expected, (path, actual, expected)
