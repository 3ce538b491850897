#!/usr/bin/env python
"""The first saves of a job: how long each ``async_save`` holds training while buffers are new.

Until retention recycles buffers, a save would copy into fresh tmpfs pages (first touch runs
at a fraction of memcpy speed). After the first save the manager prepares the next saves'
buffers in the background. This runs ``--saves`` async saves of the ~1 GiB benchmark state
dict (see bench_local.py) with ``--gap-s`` seconds of simulated compute between them, and
prints each save's blocking time next to a memcpy of the state dict.

    python benchmarks/bench_first_saves.py                # 1 GiB, 6 saves, 8 s apart
    python benchmarks/bench_first_saves.py --gap-s 0      # back to back
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import dataclass

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.harness.baselines import make_memcpy
from benchmarks.harness.processes import make_workspace
from benchmarks.harness.report import run_and_report
from benchmarks.harness.workloads import model_state_dict, tensors_of, warm_target
from mlcheckpoint import CheckpointManager


@dataclass(frozen=True)
class Config:
    size_gb: float = 1.0
    saves: int = 6
    gap_s: float = 8.0  # simulated compute between saves
    keep: int = 2


def parse_args(argv: list[str] | None) -> Config:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--gap-s", type=float, default=8.0, help="simulated compute between saves")
    ap.add_argument("--keep", type=int, default=2)
    a = ap.parse_args(argv)
    return Config(size_gb=a.size_gb, saves=a.saves, gap_s=a.gap_s, keep=a.keep)


def run(cfg: Config) -> dict:
    """Each async_save's blocking time, and a memcpy of the state dict timed right before it."""
    sd, _ = model_state_dict(int(cfg.size_gb * (1 << 30)))
    memcpy = make_memcpy(tensors_of(sd), tensors_of(warm_target(sd)))
    root = make_workspace("mlckpt-bench-first-")
    blocking, copies = [], []
    try:
        with CheckpointManager(job_id="bench-first", local_dir=root, keep=cfg.keep,
                               replication="none") as ckpt:
            for step in range(cfg.saves):
                copies.append(memcpy())
                t0 = time.perf_counter()
                fut = ckpt.async_save(sd, step)
                blocking.append(time.perf_counter() - t0)
                fut.result()
                time.sleep(cfg.gap_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"blocking_s": blocking, "memcpy_s": copies}


def report(cfg: Config, figures: dict) -> None:
    print(f"async_save blocking time of saves 1..{cfg.saves} ({cfg.size_gb:g} GiB, keep={cfg.keep}, "
          f"{cfg.gap_s:g} s of compute between saves):")
    print("  save     " + " ".join(f"{i + 1:>7d}" for i in range(cfg.saves)))
    print("  seconds  " + " ".join(f"{b:7.3f}" for b in figures["blocking_s"]))
    print("  memcpy   " + " ".join(f"{c:7.3f}" for c in figures["memcpy_s"]))


def main(argv: list[str] | None = None) -> dict:
    return run_and_report(parse_args(argv), run, report)


if __name__ == "__main__":
    main()
