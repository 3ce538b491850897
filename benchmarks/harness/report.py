"""What a benchmark's report shares: progress lines, the machine it ran on, and the one way a
benchmark runs (a config, ``run(config) -> dict``, a report of that dict, optionally the dict
as JSON)."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

Config = TypeVar("Config")


QUICK_NOTE = ("--quick: small sizes and few repetitions, beside whatever else this machine runs:\n"
              "the ratios are information, not a verdict on the install; the targets are judged\n"
              "in a full run (no --quick) on an otherwise idle machine")


def verdict(ok: bool, quick: bool) -> str:
    """The word that opens a target's line: PASS or FAIL in a full run, "info" with --quick
    (a smoke run's ratios on a shared machine say nothing about the targets)."""
    return "info" if quick else ("PASS" if ok else "FAIL")


def progress(msg: str) -> None:
    """A progress line on stderr (the report itself goes to stdout)."""
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def cpu_ticks() -> tuple[int, int]:
    """The machine's CPU time so far, (busy, all) in clock ticks (/proc/stat: network
    namespaces share it): every simulated node and the kernel's network work on this host."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def machine_info(shm_dir: str) -> dict[str, Any]:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                   platform.processor())
    vfs = os.statvfs(shm_dir)
    import mlcheckpoint
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "kernel": platform.release(),
            "load_average": os.getloadavg(), "mlcheckpoint": mlcheckpoint.__version__,
            "shm_dir": shm_dir, "shm_total_bytes": vfs.f_blocks * vfs.f_frsize,
            "shm_free_bytes": vfs.f_bavail * vfs.f_frsize}


def run_and_report(config: Config, run: Callable[[Config], dict[str, Any]],
                   report: Callable[[Config, dict[str, Any]], None],
                   json_path: str | None = None) -> dict[str, Any]:
    """Run one benchmark: ``run(config)``, then ``report(config, figures)`` to stdout, then
    the figures as JSON to ``json_path`` (if given); return the figures."""
    figures = run(config)
    report(config, figures)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(figures, f, indent=2, default=str)
        print(f"\nfigures written to {json_path}")
    return figures
