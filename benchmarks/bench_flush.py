#!/usr/bin/env python
"""The preemption flush's speed: seconds per GiB per rank, against DCP's FileSystemWriter
writing the same state dict to the same folder, and the grace period that makes.

One process (one rank) saves the ~1 GiB benchmark state dict of bench_local.py to memory,
then, in each round, writes it to the target folder both ways, in turn (each going first in
every other round), so both see the same machine: the flush
(``CheckpointManager.flush_to_persistent``: every byte from tmpfs, ``torch.save`` per tensor
as FileSystemWriter writes it, checked against the checksums after the write, fsync) and
``dcp.save`` with ``FileSystemWriter`` (``sync_files=True``, its default). The folder is
emptied between writes. Both are timed from the call to the return; the flush's figure
includes listing the steps and checking the bytes. A first round is not counted: after the
first save the manager prepares the next saves' buffers in the background, which would share
the machine with that round.

    python benchmarks/bench_flush.py                          # 1 GiB, to /dev/shm and /tmp
    python benchmarks/bench_flush.py --size-gb 0.25 --targets /mnt/nfs/scratch
    python benchmarks/bench_flush.py --quick

The grace period a node needs: the notice reaches the ranks (torchrun forwards SIGTERM at
once), each rank writes its bytes at the measured rate while the node's ranks share the
storage's bandwidth; the report gives the seconds for 1 GiB and 20 GiB per rank from this
rank's rate, which holds while one rank's stream is what limits the node.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import warnings
from dataclasses import dataclass

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.harness.baselines import dcp_fs_save
from benchmarks.harness.processes import make_workspace
from benchmarks.harness.report import loadavg, progress, run_and_report
from benchmarks.harness.stats import median, timed
from benchmarks.harness.workloads import model_state_dict
from mlcheckpoint import CheckpointManager

GIB = 1 << 30
NOTICE_S = 0.1  # torchrun's agent forwarding SIGTERM, the flush thread starting: measured ~0.01-0.1 s


@dataclass(frozen=True)
class Config:
    size_gb: float = 1.0
    rounds: int = 3
    targets: tuple[str, ...] = ("/dev/shm", tempfile.gettempdir())
    shm_dir: str = "/dev/shm"
    json: str | None = None


def run(cfg: Config) -> dict:
    """Per target folder: the flush's and FileSystemWriter's seconds per round."""
    sd, specs = model_state_dict(int(cfg.size_gb * GIB))
    nbytes = sum(s.nbytes for s in specs)
    root = make_workspace("mlckpt-bench-flush-", cfg.shm_dir, need_bytes=3 * nbytes)
    out: dict = {"bytes": nbytes, "load_average": loadavg(), "targets": {}}
    try:
        for k, target in enumerate(cfg.targets):
            folder = tempfile.mkdtemp(prefix="mlckpt-bench-flush-", dir=target)
            try:
                out["targets"][target] = one_target(cfg, sd, os.path.join(root, f"mem{k}"), folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def one_target(cfg: Config, sd: dict, root: str, folder: str) -> dict:
    """The rounds into ``folder``, from a memory checkpoint under ``root``."""
    persistent = os.path.join(folder, "persistent")
    plain = os.path.join(folder, "plain")
    rows: dict = {"flush": [], "fs_writer": [], "flush_bytes": [], "fs_bytes": []}
    with CheckpointManager(persistent, job_id="bench-flush", local_dir=root,
                           keep=1, replication="none") as ckpt:
        for step in range(-1, cfg.rounds):
            ckpt.save(sd, step + 1)
            progress(f"{folder}: " + (f"round {step + 1}/{cfg.rounds}" if step >= 0 else
                                      "a round not counted (the first save's buffers warm up)"))
            # Each way goes first in every other round: the first write into a folder pays
            # for pages the second one may find ready.
            for way in ("flush", "fs_writer") if step % 2 == 0 else ("fs_writer", "flush"):
                if way == "flush":
                    seconds, result = timed(ckpt.flush_to_persistent)
                    if not result.complete:
                        raise RuntimeError(f"the flush did not complete: {result}")
                    written = result.bytes
                    shutil.rmtree(persistent)  # the next round's step is the newest again
                else:
                    seconds, _ = timed(lambda: dcp_fs_save(sd, plain))
                    written = folder_bytes(plain)
                    shutil.rmtree(plain)
                if step >= 0:
                    rows[way].append(seconds)
                    rows["flush_bytes" if way == "flush" else "fs_bytes"].append(written)
    return rows


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def report(cfg: Config, figures: dict) -> None:
    nbytes = figures["bytes"]
    gib = nbytes / GIB
    print(f"state dict {gib:.3f} GiB, one rank, {cfg.rounds} rounds; load average "
          f"{figures['load_average']}")
    print(f"  {'target':24s} {'way':22s} {'median s':>9s} {'s/GiB':>7s} {'GB/s':>6s} "
          f"{'written':>9s}")
    for target, rows in figures["targets"].items():
        for way, key, written in (("flush", "flush", "flush_bytes"),
                                  ("FileSystemWriter", "fs_writer", "fs_bytes")):
            t = median(rows[key])
            print(f"  {target:24s} {way:22s} {t:9.3f} {t / gib:7.2f} {nbytes / t / 1e9:6.2f} "
                  f"{rows[written][-1] / GIB:8.3f}G")
        ratios = [fs / fl for fs, fl in zip(rows["fs_writer"], rows["flush"], strict=True)]
        per_gib = median(rows["flush"]) / gib
        print(f"  {'':24s} FileSystemWriter time / flush time, per round: "
              + ", ".join(f"{r:.2f}" for r in ratios) + f" (median {statistics.median(ratios):.2f}x)")
        print(f"  {'':24s} grace period at this rate, one rank per node: 1 GiB/rank "
              f"{NOTICE_S + per_gib:.1f} s, 20 GiB/rank {NOTICE_S + 20 * per_gib:.1f} s "
              "(ranks sharing the storage's bandwidth: times their number)")


def parse_args(argv: list[str] | None) -> Config:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=None, help="state dict (default 1; 0.0625 with --quick)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per target (default 3; 1 with --quick)")
    ap.add_argument("--targets", nargs="+", default=None,
                    help="folders to write into (default /dev/shm and the temporary directory)")
    ap.add_argument("--shm-dir", default="/dev/shm", help="tmpfs of the in-memory checkpoint")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    return Config(size_gb=a.size_gb or (0.0625 if a.quick else 1.0),
                  rounds=a.rounds or (1 if a.quick else 3),
                  targets=tuple(a.targets) if a.targets else Config.targets, shm_dir=a.shm_dir,
                  json=a.json)


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv)
    # Measured, not cut off: a slow disk may take longer than a real grace period. (Only
    # while it runs: a caller's own flushes keep their deadline.)
    ours = "MLCHECKPOINT_FLUSH_DEADLINE" not in os.environ
    if ours:
        os.environ["MLCHECKPOINT_FLUSH_DEADLINE"] = "3600"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP: no process group, one process
            return run_and_report(cfg, run, report, cfg.json)
    finally:
        if ours:
            del os.environ["MLCHECKPOINT_FLUSH_DEADLINE"]


if __name__ == "__main__":
    main()
