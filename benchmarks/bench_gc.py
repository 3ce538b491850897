#!/usr/bin/env python
"""What Python's garbage collector costs a checkpoint, with mlcheckpoint's pause and without.

A save of a few hundred tensors allocates enough short-lived objects to start dozens of young
collections, and every few saves a full one that walks the whole Python heap. This runs a
simulated training loop (a Python heap of ``--heap-objects`` long-lived objects, and
``--garbage`` short-lived ones made per step) on the ~1 GiB benchmark state dict of
bench_local.py, and alternates blocks of saves with ``MLCHECKPOINT_PAUSE_GC`` on and off.

For each setting it prints the save (or async_save) times as median, mean, p90 and max, their
mean against a memcpy of the state dict timed right before each save, and the collections
that ran during the saves and during the training steps (with the time they took).

    python benchmarks/bench_gc.py                        # 1 GiB, 1M heap objects
    python benchmarks/bench_gc.py --heap-objects 0       # only what torch itself allocates
    python benchmarks/bench_gc.py --quick
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.harness.baselines import make_memcpy
from benchmarks.harness.processes import make_workspace
from benchmarks.harness.report import run_and_report
from benchmarks.harness.stats import median, p90
from benchmarks.harness.workloads import model_state_dict, tensors_of, warm_target
from mlcheckpoint import CheckpointManager

SETTINGS = (("paused", "1"), ("collector on", "0"))


class GcLog:
    """Collections by generation, and their time, tallied into the current bucket."""

    def __init__(self) -> None:
        self.bucket: dict | None = None
        self._start = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        b = self.bucket
        if b is None:
            return
        if phase == "start":
            self._start = time.perf_counter()
            b["n"][info["generation"]] += 1
        else:
            b["s"] += time.perf_counter() - self._start

    def close(self) -> None:
        gc.callbacks.remove(self)


def new_bucket() -> dict:
    return {"n": [0, 0, 0], "s": 0.0}


def training_step(garbage: int) -> None:
    """Python objects a step makes and drops (batches, logging, metrics), freed by refcount."""
    junk = [{"i": i, "v": [i, i + 1]} for i in range(garbage)]
    del junk


@dataclass(frozen=True)
class Config:
    size_gb: float = 1.0
    heap_objects: int = 1_000_000  # long-lived Python objects standing in for a trainer's heap
    garbage: int = 20_000  # short-lived objects each simulated training step makes
    saves: int = 10  # per block
    rounds: int = 3  # blocks per setting
    kinds: tuple[str, ...] = ("save", "async")
    shm_dir: str = "/dev/shm"


def run(args: Config) -> dict:
    """Per kind of save, per setting: the times, the memcpys beside them, the collections."""
    sd, _ = model_state_dict(int(args.size_gb * (1 << 30)))
    memcpy = make_memcpy(tensors_of(sd), tensors_of(warm_target(sd)))
    heap = [[i, None] for i in range(args.heap_objects)]  # lists: each one tracked by gc
    gc.collect()
    out: dict = {"heap": {"tracked_objects": len(gc.get_objects()), "thresholds": list(gc.get_threshold())}}
    root = make_workspace("mlckpt-bench-gc-", args.shm_dir)
    log = GcLog()
    try:
        with CheckpointManager(job_id="bench-gc", local_dir=root, keep=2, replication="none") as ckpt:
            step = 0
            for _ in range(4):  # new buffers, then the recycled steady state
                ckpt.save(sd, step)
                step += 1
            for kind in args.kinds:
                rows = {name: {"t": [], "commit": [], "memcpy": [], "save": new_bucket(),
                               "train": new_bucket()} for name, _ in SETTINGS}
                for _ in range(args.rounds):  # alternate blocks, so both see the same machine
                    for name, value in SETTINGS:
                        os.environ["MLCHECKPOINT_PAUSE_GC"] = value
                        r = rows[name]
                        for _ in range(args.saves):
                            log.bucket = r["train"]
                            training_step(args.garbage)
                            log.bucket = None
                            r["memcpy"].append(memcpy())
                            log.bucket = r["save"]
                            t0 = time.perf_counter()
                            if kind == "save":
                                ckpt.save(sd, step)
                                r["t"].append(time.perf_counter() - t0)
                            else:
                                fut = ckpt.async_save(sd, step)
                                r["t"].append(time.perf_counter() - t0)
                                fut.result()
                                r["commit"].append(time.perf_counter() - t0)
                            log.bucket = None
                            step += 1
                out[kind] = rows
    finally:
        log.close()
        os.environ.pop("MLCHECKPOINT_PAUSE_GC", None)
        shutil.rmtree(root, ignore_errors=True)
        del heap
    return out


def report(cfg: Config, figures: dict) -> None:
    heap = figures["heap"]
    print(f"python heap: {heap['tracked_objects']:,} tracked objects; gc thresholds {tuple(heap['thresholds'])}")
    for kind in cfg.kinds:
        report_kind(kind, figures[kind])


def report_kind(kind: str, rows: dict) -> None:
    label = "ckpt.save" if kind == "save" else "ckpt.async_save, time until it returns"
    print(f"\n{label} (seconds; x memcpy = mean memcpy time / mean time)")
    print(f"  {'setting':13s} {'saves':>5s} {'median':>7s} {'mean':>7s} {'p90':>7s} {'max':>7s} "
          f"{'x memcpy':>8s}   collections during saves (gen0/1/2, ms)   during training steps")
    for name, r in rows.items():
        t = r["t"]
        mean = statistics.fmean(t)
        ratio = statistics.fmean(r["memcpy"]) / mean
        s, tr = r["save"], r["train"]
        n = len(t)
        print(f"  {name:13s} {n:5d} {median(t):7.3f} {mean:7.3f} {p90(t):7.3f} {max(t):7.3f} "
              f"{ratio:7.2f}x   {'/'.join(map(str, s['n'])):>14s} {s['s'] * 1e3:8.0f} ms"
              f"   {'/'.join(map(str, tr['n'])):>14s} {tr['s'] * 1e3:8.0f} ms")
        if r["commit"]:
            c = r["commit"]
            print(f"  {'':13s} until committed: median {median(c):.3f} mean "
                  f"{statistics.fmean(c):.3f} p90 {p90(c):.3f} max {max(c):.3f}")
    print("  full collections per save (during saves, during training): " + ", ".join(
        f"{name} {r['save']['n'][2] / len(r['t']):.2f}, {r['train']['n'][2] / len(r['t']):.2f}"
        for name, r in rows.items()))
    print("  collector time per save, saves and training together: " + ", ".join(
        f"{name} {(r['save']['s'] + r['train']['s']) / len(r['t']) * 1e3:.1f} ms" for name, r in rows.items()))


def parse_args(argv: list[str] | None) -> Config:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=None, help="state dict (default 1; 0.0625 with --quick)")
    ap.add_argument("--heap-objects", type=int, default=1_000_000,
                    help="long-lived Python objects standing in for a trainer's heap (default 1M)")
    ap.add_argument("--garbage", type=int, default=20_000,
                    help="short-lived objects each simulated training step makes (default 20000)")
    ap.add_argument("--saves", type=int, default=None, help="saves per block (default 10; 4 with --quick)")
    ap.add_argument("--rounds", type=int, default=None, help="blocks per setting (default 3; 2 with --quick)")
    ap.add_argument("--kinds", nargs="+", default=["save", "async"], choices=["save", "async"])
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    return Config(size_gb=a.size_gb or (0.0625 if a.quick else 1.0), heap_objects=a.heap_objects,
                  garbage=a.garbage, saves=a.saves or (4 if a.quick else 10),
                  rounds=a.rounds or (2 if a.quick else 3), kinds=tuple(a.kinds), shm_dir=a.shm_dir)


def main(argv: list[str] | None = None) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: no process group, one process
        return run_and_report(parse_args(argv), run, report)


if __name__ == "__main__":
    main()
