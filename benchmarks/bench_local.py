#!/usr/bin/env python
"""Single-process benchmark: mlcheckpoint against memcpy, DCP's file system storage and torch.save.

One run measures, on a state dict shaped like a real model (a few large matrices, a few hundred
small tensors, float32 and bfloat16, plus non-tensor values):

* memcpy into warm buffers (the limit), DCP FileSystemWriter save / FileSystemReader load into
  /dev/shm, and torch.save into a /dev/shm file (the baselines);
* mlcheckpoint: the first (cold) save, steady-state saves, load, and the time async_save holds
  the caller, with the anonymous memory it uses on the side.

Run from the repository root:

    python benchmarks/bench_local.py                # ~1 GiB state dict
    python benchmarks/bench_local.py --quick        # small smoke run
    python benchmarks/bench_local.py --json out.json

``main(argv)`` runs the same thing and returns every figure as a dict. Everything the benchmark
writes lives in one temporary directory under /dev/shm that is removed at the end, also on error.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from a checkout: import the package from it
    sys.path.insert(0, REPO_ROOT)

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import mlcheckpoint
from mlcheckpoint import CheckpointManager

StateDict = dict[str, Any]

GB = 1e9  # throughput is reported in decimal GB/s
MiB = 1 << 20
GiB = 1 << 30

# State dict shape: most bytes in a few large matrices (embeddings, MLP weights), the rest in
# a few hundred small tensors (norms, biases, small projections) of 4 KiB-1 MiB.
LARGE_COUNT = 5
LARGE_SHARE = 0.75
LARGE_COLS = 4096
SMALL_MIN, SMALL_MAX = 4 << 10, 1 << 20
SMALL_SUFFIXES = ("ln_1.weight", "ln_1.bias", "attn.proj.bias", "ln_2.weight", "mlp.fc.bias")

# Targets (see the "targets" section of the output).
TARGET_SAVE_VS_MEMCPY = 0.7
TARGET_SAVE_VS_FS = 10.0
TARGET_LOAD_VS_MEMCPY = 0.6
TARGET_LOAD_VS_FS = 10.0
TARGET_ASYNC_BLOCKING_MEMCPYS = 1.5
TARGET_ANON_GROWTH = 0.25

RSS_FIELDS = ("RssAnon", "RssShmem", "RssFile")


# ---------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Config:
    size_bytes: int
    saves: int  # mlcheckpoint saves per series (sync, then async)
    steady: int  # the last `steady` saves of a series count as steady state
    memcpy_reps: int  # per batch; one batch before and one after the other measurements
    fs_reps: int  # DCP FileSystemWriter saves and FileSystemReader loads
    torch_save_reps: int
    loads: int
    shm_dir: str
    sample_interval_s: float
    quick: bool
    json_path: str | None
    threads: int | None


def parse_args(argv: list[str] | None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=None,
                   help="state dict size in GiB (default 1.0; 0.0625 with --quick)")
    p.add_argument("--saves", type=int, default=None,
                   help="saves per series, at least 4 (default 10; 5 with --quick)")
    p.add_argument("--json", metavar="PATH", help="also write every figure to PATH as JSON")
    p.add_argument("--quick", action="store_true", help="small state dict, few repetitions")
    p.add_argument("--shm-dir", default="/dev/shm", help="tmpfs to work in (default /dev/shm)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for the whole run (default: torch's default)")
    args = p.parse_args(argv)
    size_gb = args.size_gb if args.size_gb is not None else (0.0625 if args.quick else 1.0)
    saves = args.saves if args.saves is not None else (5 if args.quick else 10)
    if size_gb < 0.01:
        p.error("--size-gb must be at least 0.01")
    # Buffers are recycled from about the 3rd-4th save on (keep=2, then the pool).
    if saves < 4:
        p.error("--saves must be at least 4 (the first three warm the buffer pool)")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    return Config(size_bytes=int(size_gb * GiB), saves=saves, steady=max(1, min(5, saves - 3)),
                  memcpy_reps=2 if args.quick else 5, fs_reps=1 if args.quick else 3,
                  torch_save_reps=1 if args.quick else 2, loads=2 if args.quick else 5,
                  shm_dir=args.shm_dir, sample_interval_s=0.002, quick=args.quick,
                  json_path=args.json, threads=args.threads)


# ---------------------------------------------------------------------------------- state dict
@dataclass
class Composition:
    total_bytes: int
    large: list[tuple[str, list[int], str, int]]  # name, shape, dtype, bytes
    small: list[tuple[str, list[int], str, int]]
    non_tensors: dict[str, str]  # name -> type

    def as_dict(self) -> dict[str, Any]:
        small_sizes = [b for *_, b in self.small]
        return {
            "total_bytes": self.total_bytes,
            "tensors": len(self.large) + len(self.small),
            "large": [{"name": n, "shape": s, "dtype": d, "bytes": b} for n, s, d, b in self.large],
            "small": {"count": len(self.small), "bytes": sum(small_sizes),
                      "min_bytes": min(small_sizes, default=0),
                      "median_bytes": int(statistics.median(small_sizes)) if small_sizes else 0,
                      "max_bytes": max(small_sizes, default=0),
                      "dtypes": _dtype_counts(self.small)},
            "non_tensors": self.non_tensors,
        }


def _dtype_counts(rows: list[tuple[str, list[int], str, int]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, _, dtype, _ in rows:
        counts[dtype] = counts.get(dtype, 0) + 1
    return counts


def _fill(t: torch.Tensor, pool: torch.Tensor, gen: torch.Generator) -> None:
    """Fill ``t`` by tiling a random pool from a random start: realistic (finite, non-constant)
    values at memcpy speed, where torch.randn would take several seconds per GiB."""
    flat, n, p = t.view(-1), t.numel(), pool.numel()
    start, pos = int(torch.randint(0, p, (1,), generator=gen)), 0
    while pos < n:
        k = min(n - pos, p - start)
        flat[pos:pos + k].copy_(pool[start:start + k])
        pos, start = pos + k, 0


def build_state_dict(size_bytes: int, seed: int = 0) -> tuple[StateDict, Composition]:
    """A nested {"model": {...}, "step": int, "run_name": str} state dict of ~size_bytes."""
    gen = torch.Generator().manual_seed(seed)
    pools = {dt: torch.randn(1 << 20, generator=gen).to(dt) for dt in (torch.float32, torch.bfloat16)}
    model: dict[str, torch.Tensor] = {}
    large, small = [], []

    def add(name: str, shape: list[int], dtype: torch.dtype, table: list) -> int:
        t = torch.empty(shape, dtype=dtype)
        _fill(t, pools[dtype], gen)
        model[name] = t
        table.append((name, shape, str(dtype).removeprefix("torch."), t.nbytes))
        return t.nbytes

    per_large = int(size_bytes * LARGE_SHARE) // LARGE_COUNT
    used = 0
    for i in range(LARGE_COUNT):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        n_rows = max(1, per_large // (LARGE_COLS * dtype.itemsize))
        used += add(f"blocks.{i}.mlp.fc.weight", [n_rows, LARGE_COLS], dtype, large)
    j = 0
    while size_bytes - used >= SMALL_MIN:
        nbytes = min(size_bytes - used, int(torch.randint(SMALL_MIN, SMALL_MAX + 1, (1,), generator=gen)))
        dtype = torch.bfloat16 if torch.rand(1, generator=gen).item() < 0.5 else torch.float32
        name = f"blocks.{j // len(SMALL_SUFFIXES)}.{SMALL_SUFFIXES[j % len(SMALL_SUFFIXES)]}"
        used += add(name, [nbytes // dtype.itemsize], dtype, small)
        j += 1
    sd = {"model": model, "step": 123456, "run_name": "bench-local"}
    return sd, Composition(used, large, small, {"step": "int", "run_name": "str"})


def tensors_of(sd: StateDict) -> list[torch.Tensor]:
    return list(sd["model"].values())


def warm_target(sd: StateDict) -> StateDict:
    """Same structure and shapes, tensors allocated and touched (copied once), values reset."""
    model = {k: torch.empty_like(t).copy_(t) for k, t in sd["model"].items()}
    return {"model": model, "step": 0, "run_name": ""}


def check_equal(expected: StateDict, got: StateDict, what: str) -> None:
    """Fail loudly if a load did not reproduce the state dict (a fast wrong load is no result)."""
    for k, t in expected["model"].items():
        if not torch.equal(t, got["model"][k]):
            raise AssertionError(f"{what}: tensor {k!r} differs after load")
    for k in ("step", "run_name"):
        if got[k] != expected[k]:
            raise AssertionError(f"{what}: {k} is {got[k]!r}, expected {expected[k]!r}")


def scrub(target: StateDict) -> None:
    """Reset the target between loads, so a load that silently does nothing fails check_equal."""
    for t in target["model"].values():
        t.zero_()
    target["step"], target["run_name"] = 0, ""


# ---------------------------------------------------------------------------------- measuring
@dataclass
class Series:
    """Reps of one operation, each paired with a memcpy of the whole state dict timed right
    before it.

    On a shared machine the load changes from second to second: the ratio of two measurements
    taken a moment apart is much steadier than a ratio of medians taken minutes apart (which
    can even show a save "faster than memcpy").
    """

    seconds: list[float] = field(default_factory=list)
    memcpy_s: list[float] = field(default_factory=list)

    def run(self, memcpy: Callable[[], float], fn: Callable[[], Any],
            prepare: Callable[[], None] | None = None) -> Any:
        """Time ``memcpy``, then ``prepare`` (untimed), then ``fn``; return what fn returns."""
        self.memcpy_s.append(memcpy())
        if prepare is not None:
            prepare()
        dt, out = timed(fn)
        self.seconds.append(dt)
        return out

    def head(self, n: int) -> Series:
        return Series(self.seconds[:n], self.memcpy_s[:n])

    def tail(self, n: int) -> Series:
        return Series(self.seconds[-n:], self.memcpy_s[-n:])


@dataclass
class Measurement:
    label: str
    series: Series
    nbytes: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return statistics.median(self.series.seconds)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / GB

    @property
    def best_gbps(self) -> float:
        """The fastest rep: what the code does when the (shared) machine leaves it alone."""
        return self.nbytes / min(self.series.seconds) / GB

    @property
    def x_memcpy(self) -> float:
        """Throughput in memcpys: median over reps of (paired memcpy time / this time)."""
        return statistics.median(m / t for m, t in zip(self.series.memcpy_s, self.series.seconds))

    @property
    def in_memcpys(self) -> float:
        """Duration in memcpys: median over reps of (this time / paired memcpy time)."""
        return statistics.median(t / m for m, t in zip(self.series.memcpy_s, self.series.seconds))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def read_rss() -> dict[str, int]:
    """RssAnon/RssShmem/RssFile of this process in bytes, from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in RSS_FIELDS:
                out[name] = int(value.split()[0]) * 1024
    return out


class RssSampler:
    """Polls /proc/self/status from a thread and keeps the peak of each Rss field.

    The baseline is read on entry, right before the measured work starts. The main thread's big
    copies release the GIL, so the sampler keeps running while they happen.
    """

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.baseline: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.end: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        for k, v in read_rss().items():
            self.peak[k] = max(self.peak.get(k, 0), v)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> RssSampler:
        gc.collect()
        self.baseline = read_rss()
        self.peak = dict(self.baseline)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.end = read_rss()

    def report(self, state_bytes: int) -> dict[str, Any]:
        growth = {k: self.peak[k] - self.baseline[k] for k in self.baseline}
        return {"samples": self.samples, "baseline": self.baseline, "peak": self.peak,
                "end": self.end, "peak_growth": growth,
                "anon_growth_fraction": growth["RssAnon"] / state_bytes}



# ---------------------------------------------------------------------------------- baselines
def make_memcpy(src: list[torch.Tensor], dst: list[torch.Tensor]) -> Callable[[], float]:
    """A function that copies every tensor into its already-touched twin and returns the time."""
    def once() -> float:
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s)
        return time.perf_counter() - t0
    return once


def bench_torch_save(sd: StateDict, root: str, reps: int, memcpy: Callable[[], float]) -> Series:
    out = Series()
    for i in range(reps):
        path = os.path.join(root, f"torch-save-{i}.pt")
        out.run(memcpy, lambda p=path: torch.save(sd, p))
        os.unlink(path)  # free the tmpfs pages before the next measurement
    return out


def bench_fs(sd: StateDict, target: StateDict, root: str, reps: int,
             memcpy: Callable[[], float]) -> tuple[Series, Series]:
    """DCP FileSystemWriter saves, each into a fresh directory, then FileSystemReader loads."""
    saves, loads = Series(), Series()
    path = ""
    for i in range(reps):
        if path:
            shutil.rmtree(path)  # keep only the last one (for the loads)
        path = os.path.join(root, f"dcp-fs-{i}")
        saves.run(memcpy, lambda p=path: dcp.save(sd, storage_writer=FileSystemWriter(p)))
    for _ in range(reps):
        # The paired memcpy writes into `target` too: scrub it afterwards.
        loads.run(memcpy, lambda: dcp.load(target, storage_reader=FileSystemReader(path)),
                  prepare=lambda: scrub(target))
    check_equal(sd, target, "FileSystemReader load")
    shutil.rmtree(path)
    return saves, loads


# ---------------------------------------------------------------------------------- mlcheckpoint
@dataclass
class OursResult:
    saves: Series = field(default_factory=Series)  # ckpt.save wall time; the first is cold
    loads: Series = field(default_factory=Series)
    async_blocking: Series = field(default_factory=Series)  # until ckpt.async_save returned
    async_total_s: list[float] = field(default_factory=list)  # SaveResult.seconds: to commit
    save_bytes: list[int] = field(default_factory=list)  # SaveResult.bytes of each save
    memory: dict[str, dict[str, Any]] = field(default_factory=dict)
    mapped_shmem_end: int = 0  # RssShmem after the async saves: the buffers this process maps


def run_saves(ckpt: CheckpointManager, sd: StateDict, steps: range, cfg: Config,
              memcpy: Callable[[], float], out: OursResult) -> None:
    """Blocking saves; the RSS sampler covers the steady-state window (the last cfg.steady)."""
    def one(step: int) -> None:
        out.save_bytes.append(out.saves.run(memcpy, lambda: ckpt.save(sd, step)).bytes)

    n_warm = len(steps) - cfg.steady
    for step in steps[:n_warm]:
        one(step)
    with RssSampler(cfg.sample_interval_s) as sampler:
        for step in steps[n_warm:]:
            one(step)
    out.memory["steady-state saves"] = sampler.report(cfg.size_bytes)


def run_loads(ckpt: CheckpointManager, sd: StateDict, target: StateDict, step: int, reps: int,
              memcpy: Callable[[], float], out: OursResult) -> None:
    for _ in range(reps):
        out.loads.run(memcpy, lambda: dcp.load(target, storage_reader=ckpt.storage_reader(step)),
                      prepare=lambda: scrub(target))
    check_equal(sd, target, "mlcheckpoint load")


def run_async_saves(ckpt: CheckpointManager, sd: StateDict, steps: range, cfg: Config,
                    memcpy: Callable[[], float], out: OursResult) -> None:
    """Time only the async_save call (staging); the wait for the commit is outside the timing."""
    with RssSampler(cfg.sample_interval_s) as sampler:
        for step in steps:
            fut = out.async_blocking.run(memcpy, lambda s=step: ckpt.async_save(sd, s))
            out.async_total_s.append(fut.result().seconds)
    out.memory["async saves"] = sampler.report(cfg.size_bytes)
    out.mapped_shmem_end = sampler.end.get("RssShmem", 0)


def bench_ours(sd: StateDict, target: StateDict, root: str, cfg: Config,
               memcpy: Callable[[], float]) -> OursResult:
    out = OursResult()
    ckpt = CheckpointManager(job_id=f"bench-{secrets.token_hex(4)}",
                             local_dir=os.path.join(root, "mlcheckpoint"), keep=2, replication="none")
    try:
        run_saves(ckpt, sd, range(cfg.saves), cfg, memcpy, out)
        run_loads(ckpt, sd, target, cfg.saves - 1, cfg.loads, memcpy, out)
        run_async_saves(ckpt, sd, range(cfg.saves, 2 * cfg.saves), cfg, memcpy, out)
    finally:
        ckpt.close()  # the caller removes the directory itself
    return out


# ---------------------------------------------------------------------------------- report
def machine_info(shm_dir: str) -> dict[str, Any]:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                   platform.processor())
    vfs = os.statvfs(shm_dir)
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "kernel": platform.release(),
            "load_average": os.getloadavg(), "mlcheckpoint": mlcheckpoint.__version__,
            "shm_dir": shm_dir, "shm_total_bytes": vfs.f_blocks * vfs.f_frsize,
            "shm_free_bytes": vfs.f_bavail * vfs.f_frsize}


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"


def _signed(n: int) -> str:
    return ("+" if n >= 0 else "-") + _size(abs(n))


def _fmt(xs: list[float]) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


def print_header(machine: dict[str, Any], comp: dict[str, Any], cfg: Config) -> None:
    print("mlcheckpoint local benchmark (single process, no process group)")
    print(f"machine: {machine['cores']} cores ({machine['usable_cores']} usable), {machine['cpu']}, "
          f"Linux {machine['kernel']}, load average {machine['load_average'][0]:.2f} at start")
    print(f"         torch {machine['torch']} ({machine['torch_threads']} intra-op threads), "
          f"Python {machine['python']}, mlcheckpoint {machine['mlcheckpoint']}")
    print(f"tmpfs:   {machine['shm_dir']} {_size(machine['shm_total_bytes'])} "
          f"({_size(machine['shm_free_bytes'])} free)")
    small = comp["small"]
    print(f"state dict: {_size(comp['total_bytes'])} in {comp['tensors']} tensors + "
          f"{len(comp['non_tensors'])} non-tensor values "
          f"({', '.join(f'{k}: {v}' for k, v in comp['non_tensors'].items())})")
    for t in comp["large"]:
        print(f"  large  {t['name']:<24} {t['shape']!s:<14} {t['dtype']:<9} {_size(t['bytes'])}")
    dtypes = ", ".join(f"{d} x{n}" for d, n in small["dtypes"].items())
    print(f"  small  {small['count']} tensors, {_size(small['bytes'])} in all, "
          f"{_size(small['min_bytes'])}-{_size(small['max_bytes'])} "
          f"(median {_size(small['median_bytes'])}); {dtypes}")
    print(f"runs: {cfg.saves} saves per series (steady state = last {cfg.steady}), {cfg.loads} loads, "
          f"{cfg.fs_reps} DCP FS saves/loads, {cfg.torch_save_reps} torch.save; a memcpy before each "
          f"of those\n      and {cfg.memcpy_reps} more at the start and at the end"
          + (" [--quick]" if cfg.quick else ""))
    print()


def print_table(rows: dict[str, Measurement]) -> None:
    print("ours = mlcheckpoint CheckpointManager(keep=2, replication='none'). GB = 1e9 bytes.")
    print("seconds, GB/s: median of the reps (steady state and async_save: the last reps of the "
          "series, after buffers\nare recycled); best GB/s: the fastest rep.")
    print("x memcpy: median over the reps of (memcpy time / this time), each rep paired with a "
          "memcpy of the whole\nstate dict timed right before it, so both see the same machine load. "
          "x DCP FS: best GB/s over the best\nGB/s of FileSystemWriter (saves) or FileSystemReader "
          "(loads). Higher is faster.")
    print(f"{'measurement':<34}{'reps':>5}{'seconds':>9}{'GB/s':>8}{'best GB/s':>11}"
          f"{'x memcpy':>10}{'x DCP FS':>10}")
    print("-" * 87)
    fs_save, fs_load = rows["fs_save"], rows["fs_load"]
    for key, m in rows.items():
        vs_fs = "-"
        if key.startswith("ours_") or key == "torch_save":
            ref = fs_load if "load" in key else fs_save
            vs_fs = f"{m.best_gbps / ref.best_gbps:.2f}x"
        print(f"{m.label:<34}{len(m.series.seconds):>5}{m.seconds:>9.4f}{m.gbps:>8.2f}"
              f"{m.best_gbps:>11.2f}{m.x_memcpy:>9.2f}x{vs_fs:>10}")
    print()


def print_series(nbytes: int, memcpy_before: list[float], memcpy_after: list[float],
                 ours: OursResult) -> None:
    """Every rep, in order: shows warm-up, buffer recycling and noise."""
    print(f"memcpy alone: {nbytes / statistics.median(memcpy_before) / GB:.2f} GB/s at the start, "
          f"{nbytes / statistics.median(memcpy_after) / GB:.2f} GB/s at the end (medians)")
    print("ours, seconds per rep, in order:")
    series = (("saves", ours.saves), ("loads", ours.loads), ("async_save blocking", ours.async_blocking))
    for name, s in series:
        print(f"  {name:<24}{_fmt(s.seconds)}")
        print(f"  {'  paired memcpy':<24}{_fmt(s.memcpy_s)}")
    print(f"  {'async_save to commit':<24}{_fmt(ours.async_total_s)}")
    print()


def print_memory(memory: dict[str, dict[str, Any]], mapped_shmem: int, interval_s: float) -> None:
    print(f"memory: peak growth over the value right before each phase (sampled every "
          f"{interval_s * 1000:.0f} ms)")
    print(f"{'phase':<22}{'samples':>8}{'RssAnon':>24}{'RssShmem':>12}{'RssFile':>12}")
    for phase, r in memory.items():
        g = r["peak_growth"]
        anon = f"{_signed(g['RssAnon'])} ({r['anon_growth_fraction']:.1%})"
        print(f"{phase:<22}{r['samples']:>8}{anon:>24}{_signed(g['RssShmem']):>12}"
              f"{_signed(g['RssFile']):>12}")
    print(f"RssShmem at the end: {_size(mapped_shmem)} (the shard buffers this process keeps mapped: "
          "kept steps and pooled buffers).")
    print("Note: mlcheckpoint's shard buffers are tmpfs files mapped into the process, so their pages "
          "count as RssShmem\n(and RssFile on some kernels): they ARE the checkpoint, not a copy of it. "
          "A hidden full copy of the state\ndict would show as RssAnon growth, which is what the target "
          "checks.")
    print()


def evaluate_targets(estimates: dict[str, dict[str, float]],
                     memory: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """PASS/FAIL per target, each on the estimate that is robust for it on a shared machine.

    memcpy ratios: paired (memcpy and the rep see the same load). DCP FS ratios: best reps.
    Pairing does not normalise the FS baselines: they are mostly single-threaded, and under CPU
    contention torch's multi-threaded memcpy slows down far more than a file write does.
    """
    checks = [  # name, key in the estimates, basis, op, threshold
        ("steady-state save >= 0.7x memcpy", "save_vs_memcpy", "paired", ">=", TARGET_SAVE_VS_MEMCPY),
        ("steady-state save >= 10x FileSystemWriter", "save_vs_fs_writer", "best", ">=", TARGET_SAVE_VS_FS),
        ("load >= 0.6x memcpy", "load_vs_memcpy", "paired", ">=", TARGET_LOAD_VS_MEMCPY),
        ("load >= 10x FileSystemReader", "load_vs_fs_reader", "best", ">=", TARGET_LOAD_VS_FS),
        ("async_save blocking <= 1.5x one memcpy", "async_blocking_in_memcpys", "paired", "<=",
         TARGET_ASYNC_BLOCKING_MEMCPYS),
    ]
    ops = {">=": float.__ge__, "<=": float.__le__, "<": float.__lt__}
    targets = []
    for name, key, basis, op, threshold in checks:
        value = estimates[basis][key]
        targets.append({"name": name, "value": value, "basis": basis, "op": op, "threshold": threshold,
                        "estimates": {b: e[key] for b, e in estimates.items()},
                        "pass": bool(ops[op](float(value), float(threshold)))})
    anon = max(r["anon_growth_fraction"] for r in memory.values())
    targets.append({"name": "peak RssAnon growth < 25% of state dict", "value": anon, "basis": "peak",
                    "op": "<", "threshold": TARGET_ANON_GROWTH, "estimates": {},
                    "pass": bool(anon < TARGET_ANON_GROWTH)})
    return targets


def print_targets(targets: list[dict[str, Any]]) -> None:
    print("targets: memcpy ratios judged on the paired estimate, DCP FS ratios on the best reps (see the\n"
          "README); the other estimates are shown for reference")
    for t in targets:
        value = f"{t['value']:.1%}" if not t["estimates"] else f"{t['value']:.2f}x"
        others = ", ".join(f"{b} {v:.2f}x" for b, v in t["estimates"].items() if b != t["basis"])
        line = f"  {'PASS' if t['pass'] else 'FAIL'}  {t['name']:<42}{value:>8} {t['basis']:<7}"
        print((line + (f"  ({others})" if others else "")).rstrip())
    passed = sum(t["pass"] for t in targets)
    print(f"  {passed}/{len(targets)} passed")


# ---------------------------------------------------------------------------------- driver
def make_workspace(shm_dir: str, size_bytes: int) -> str:
    # Peak tmpfs use: keep=2 steps + one in flight + up to two pooled buffers, or one DCP/torch
    # checkpoint at a time; ask for a margin on top.
    vfs = os.statvfs(shm_dir)
    free = vfs.f_bavail * vfs.f_frsize
    if free < 6 * size_bytes:
        raise SystemExit(f"{shm_dir} has {_size(free)} free; this run needs about {_size(6 * size_bytes)}")
    return tempfile.mkdtemp(prefix="mlckpt-bench-local-", dir=shm_dir)


def build_rows(cfg: Config, nbytes: int, memcpy_all: list[float], torch_save: Series,
               fs_save: Series, fs_load: Series, ours: OursResult) -> dict[str, Measurement]:
    async_total = ours.async_total_s[-cfg.steady:]
    return {
        "memcpy": Measurement("memcpy into warm buffers (limit)", Series(memcpy_all, memcpy_all), nbytes),
        "torch_save": Measurement("torch.save -> /dev/shm file", torch_save, nbytes),
        "fs_save": Measurement("DCP FileSystemWriter save", fs_save, nbytes),
        "fs_load": Measurement("DCP FileSystemReader load", fs_load, nbytes),
        "ours_save_first": Measurement("ours: save, first (cold)", ours.saves.head(1), nbytes),
        "ours_save_steady": Measurement("ours: save, steady state", ours.saves.tail(cfg.steady), nbytes,
                                        info={"all": asdict(ours.saves), "bytes": ours.save_bytes}),
        "ours_load": Measurement("ours: load (dcp.load)", ours.loads, nbytes),
        "ours_async_blocking": Measurement("ours: async_save, blocking", ours.async_blocking.tail(cfg.steady),
                                           nbytes, info={"all": asdict(ours.async_blocking)}),
        "ours_async_total": Measurement("ours: async_save, until commit",
                                        Series(async_total, ours.async_blocking.memcpy_s[-cfg.steady:]),
                                        nbytes, info={"all": ours.async_total_s}),
    }


def ratios(rows: dict[str, Measurement]) -> dict[str, dict[str, float]]:
    """Every comparison, estimated three ways (see the README):

    paired:  medians of per-rep ratios against the memcpy timed right before each rep;
    medians: ratio of the rows' medians, taken at different times;
    best:    ratio of the rows' fastest reps (each operation when the machine was quietest).
    """
    save, load, blocking = rows["ours_save_steady"], rows["ours_load"], rows["ours_async_blocking"]
    out: dict[str, dict[str, float]] = {"paired": {
        "save_vs_memcpy": save.x_memcpy,
        "save_vs_fs_writer": save.x_memcpy / rows["fs_save"].x_memcpy,
        "first_save_vs_memcpy": rows["ours_save_first"].x_memcpy,
        "load_vs_memcpy": load.x_memcpy,
        "load_vs_fs_reader": load.x_memcpy / rows["fs_load"].x_memcpy,
        "async_blocking_in_memcpys": blocking.in_memcpys,
        "torch_save_vs_memcpy": rows["torch_save"].x_memcpy,
    }}
    for basis, stat in (("medians", statistics.median), ("best", min)):
        t = {k: stat(m.series.seconds) for k, m in rows.items()}
        out[basis] = {"save_vs_memcpy": t["memcpy"] / t["ours_save_steady"],
                      "save_vs_fs_writer": t["fs_save"] / t["ours_save_steady"],
                      "first_save_vs_memcpy": t["memcpy"] / t["ours_save_first"],
                      "load_vs_memcpy": t["memcpy"] / t["ours_load"],
                      "load_vs_fs_reader": t["fs_load"] / t["ours_load"],
                      "async_blocking_in_memcpys": t["ours_async_blocking"] / t["memcpy"],
                      "torch_save_vs_memcpy": t["memcpy"] / t["torch_save"]}
    return out


def measure(cfg: Config, root: str) -> dict[str, Any]:
    machine = machine_info(cfg.shm_dir)
    sd, comp = build_state_dict(cfg.size_bytes)
    composition = comp.as_dict()
    print_header(machine, composition, cfg)
    target = warm_target(sd)
    memcpy = make_memcpy(tensors_of(sd), tensors_of(target))
    nbytes = comp.total_bytes

    memcpy_before = [memcpy() for _ in range(cfg.memcpy_reps)]
    torch_save = bench_torch_save(sd, root, cfg.torch_save_reps, memcpy)
    fs_save, fs_load = bench_fs(sd, target, root, cfg.fs_reps, memcpy)
    gc.collect()
    ours = bench_ours(sd, target, root, cfg, memcpy)
    memcpy_after = [memcpy() for _ in range(cfg.memcpy_reps)]

    # The memcpy row: every memcpy of the run, the paired ones included.
    memcpy_all = (memcpy_before + torch_save.memcpy_s + fs_save.memcpy_s + fs_load.memcpy_s
                  + ours.saves.memcpy_s + ours.loads.memcpy_s + ours.async_blocking.memcpy_s + memcpy_after)
    rows = build_rows(cfg, nbytes, memcpy_all, torch_save, fs_save, fs_load, ours)
    estimates = ratios(rows)
    print_table(rows)
    print_series(nbytes, memcpy_before, memcpy_after, ours)
    print_memory(ours.memory, ours.mapped_shmem_end, cfg.sample_interval_s)
    targets = evaluate_targets(estimates, ours.memory)
    print_targets(targets)
    return {
        "config": asdict(cfg),
        "machine": {**machine, "load_average_end": os.getloadavg()},
        "state_dict": composition,
        "results": {k: {"label": m.label, "seconds": m.seconds, "gbps": m.gbps,
                        "best_gbps": m.best_gbps, "x_memcpy": m.x_memcpy, "in_memcpys": m.in_memcpys,
                        "samples": m.series.seconds, "paired_memcpy": m.series.memcpy_s, **m.info}
                    for k, m in rows.items()},
        "ratios": estimates,
        "memory": {**ours.memory, "rss_shmem_end": ours.mapped_shmem_end},
        "targets": targets,
        "all_pass": all(t["pass"] for t in targets),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the report and return every figure (see --json)."""
    cfg = parse_args(argv)
    root = make_workspace(cfg.shm_dir, cfg.size_bytes)
    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        with warnings.catch_warnings():
            # dcp.save/load without a process group warn once per call that they run single-process.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            figures = measure(cfg, root)
    finally:
        torch.set_num_threads(threads_before)  # main() may be called from a longer-lived process
        shutil.rmtree(root, ignore_errors=True)
    if cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(figures, f, indent=2)
        print(f"\nfigures written to {cfg.json_path}")
    return figures


if __name__ == "__main__":
    # Turn SIGTERM into SystemExit so the finally blocks remove what was written to /dev/shm.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    main()
