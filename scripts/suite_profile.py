#!/usr/bin/env python
"""Where the test suite's time and CPU go, per module, from a run with
``MLCHECKPOINT_TEST_CPU_LOG=FILE`` (tests/conftest.py writes one line per test):

    MLCHECKPOINT_TEST_CPU_LOG=/tmp/cpu.jsonl scripts/test.sh -q
    python scripts/suite_profile.py /tmp/cpu.jsonl [--top 25]

Prints per module: tests, wall seconds, CPU seconds (this process + reaped children), Python
processes started and CPU per process started; then the totals and the share of the wall
time the slow tier takes. Where ``FILE.procs`` is there too (every process the suite started
writes a line at its exit: tests/startup/sitecustomize.py), per kind of process: how many, their
CPU, and how much of it went before their imports of torch, DCP and ours had ended.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("--top", type=int, default=25, help="modules to list (default 25)")
    a = p.parse_args()
    with open(a.log) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    per: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in rows:
        m = per[r["test"].split("::")[0]]
        m["tests"] += 1
        m["wall"] += r["wall_s"]
        m["cpu"] += r["self_cpu_s"] + r["children_cpu_s"]
        m["starts"] += r["python_starts"]
        m["slow_wall"] += r["wall_s"] if r["slow"] else 0.0
    print(f"{'module':<58}{'tests':>6}{'wall s':>9}{'cpu s':>9}{'starts':>8}{'cpu/start':>10}")
    for name, m in sorted(per.items(), key=lambda kv: -kv[1]["wall"])[:a.top]:
        per_start = f"{m['cpu'] / m['starts']:.1f}" if m["starts"] else "-"
        print(f"{name:<58}{int(m['tests']):>6}{m['wall']:>9.0f}{m['cpu']:>9.0f}{int(m['starts']):>8}{per_start:>10}")
    wall = sum(m["wall"] for m in per.values())
    cpu = sum(m["cpu"] for m in per.values())
    starts = sum(m["starts"] for m in per.values())
    slow = sum(m["slow_wall"] for m in per.values())
    procs(a.log + ".procs")
    print(f"\n{len(rows)} tests: {wall:.0f} s wall ({slow:.0f} s of it slow tests), {cpu:.0f} CPU s "
          f"({cpu / max(wall, 1e-9):.2f} cores busy on average), {int(starts)} Python processes started")


def kind(argv: list[str]) -> str:
    """What a process was, from its ``sys.argv``."""
    first = argv[0] if argv else ""
    if first.endswith(os.path.join("torch", "distributed", "run.py")):
        return "torchrun agent"
    for folder in ("workers", "examples", "benchmarks", "scripts"):
        if f"{os.sep}{folder}{os.sep}" in first:
            return f"script in {folder}/"
    return "other (-c, -m, ...)"


def procs(path: str) -> None:
    """Per kind of process: count, CPU, and CPU until its imports had ended."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        k = per[kind(r["argv"])]
        k[0] += 1
        k[1] += r["cpu_s"]
        k[2] += max(r["ready_cpu_s"].values(), default=0.0)
    print(f"\n{'process (those that exited, not those killed)':<48}{'count':>7}{'cpu s':>9}"
          f"{'until imported':>16}")
    for name, (n, cpu, ready) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:<48}{int(n):>7}{cpu:>9.0f}{ready:>16.0f}")
    n, cpu, ready = (sum(v[i] for v in per.values()) for i in range(3))
    print(f"{'all':<48}{int(n):>7}{cpu:>9.0f}{ready:>16.0f}  "
          f"({100 * ready / max(cpu, 1e-9):.0f}% of their CPU before their imports ended)")


if __name__ == "__main__":
    main()
