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

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.harness.baselines import make_memcpy
from benchmarks.harness.processes import make_workspace
from benchmarks.harness.workloads import model_state_dict, tensors_of, warm_target
from mlcheckpoint import CheckpointManager


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--gap-s", type=float, default=8.0, help="simulated compute between saves")
    ap.add_argument("--keep", type=int, default=2)
    args = ap.parse_args(argv)
    sd, _ = model_state_dict(int(args.size_gb * (1 << 30)))
    memcpy = make_memcpy(tensors_of(sd), tensors_of(warm_target(sd)))
    root = make_workspace("mlckpt-bench-first-")
    blocking, copies = [], []
    try:
        with CheckpointManager(job_id="bench-first", local_dir=root, keep=args.keep,
                               replication="none") as ckpt:
            for step in range(args.saves):
                copies.append(memcpy())
                t0 = time.perf_counter()
                fut = ckpt.async_save(sd, step)
                blocking.append(time.perf_counter() - t0)
                fut.result()
                time.sleep(args.gap_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"async_save blocking time of saves 1..{args.saves} ({args.size_gb:g} GiB, keep={args.keep}, "
          f"{args.gap_s:g} s of compute between saves):")
    print("  save     " + " ".join(f"{i + 1:>7d}" for i in range(args.saves)))
    print("  seconds  " + " ".join(f"{b:7.3f}" for b in blocking))
    print("  memcpy   " + " ".join(f"{c:7.3f}" for c in copies))
    return {"blocking_s": blocking, "memcpy_s": copies}


if __name__ == "__main__":
    main()
