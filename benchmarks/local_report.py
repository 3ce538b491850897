"""bench_local.py's printed report and its targets (PASS/FAIL)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from benchmarks.harness.report import QUICK_NOTE, verdict
from benchmarks.harness.stats import GB, size_str

if TYPE_CHECKING:
    from benchmarks.bench_local import Config

# Targets (see the "targets" section of the output).
TARGET_SAVE_VS_MEMCPY = 0.7
TARGET_SAVE_VS_FS = 10.0
TARGET_LOAD_VS_MEMCPY = 0.6
TARGET_LOAD_VS_FS = 10.0
TARGET_ASYNC_BLOCKING_MEMCPYS = 1.5
TARGET_FRESH_RESUME_VS_MEMCPY = 0.7
TARGET_ANON_GROWTH = 0.25

def _signed(n: int) -> str:
    return ("+" if n >= 0 else "-") + size_str(abs(n))


def _fmt(xs: list[float]) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


def print_header(machine: dict[str, Any], comp: dict[str, Any], cfg: Config) -> None:
    print("mlcheckpoint local benchmark (single process, no process group)")
    print(f"machine: {machine['cores']} cores ({machine['usable_cores']} usable), {machine['cpu']}, "
          f"Linux {machine['kernel']}, load average {machine['load_average'][0]:.2f} at start")
    print(f"         torch {machine['torch']} ({machine['torch_threads']} intra-op threads), "
          f"Python {machine['python']}, mlcheckpoint {machine['mlcheckpoint']}")
    print(f"tmpfs:   {machine['shm_dir']} {size_str(machine['shm_total_bytes'])} "
          f"({size_str(machine['shm_free_bytes'])} free)")
    small = comp["small"]
    print(f"state dict: {size_str(comp['total_bytes'])} in {comp['tensors']} tensors + "
          f"{len(comp['non_tensors'])} non-tensor values "
          f"({', '.join(f'{k}: {v}' for k, v in comp['non_tensors'].items())})")
    for t in comp["large"]:
        print(f"  large  {t['name']:<24} {t['shape']!s:<14} {t['dtype']:<9} {size_str(t['bytes'])}")
    dtypes = ", ".join(f"{d} x{n}" for d, n in small["dtypes"].items())
    print(f"  small  {small['count']} tensors, {size_str(small['bytes'])} in all, "
          f"{size_str(small['min_bytes'])}-{size_str(small['max_bytes'])} "
          f"(median {size_str(small['median_bytes'])}); {dtypes}")
    print(f"runs: {cfg.saves} saves per series (steady state = last {cfg.steady}), {cfg.loads} loads, "
          f"{cfg.fs_reps} DCP FS saves/loads, {cfg.torch_save_reps} torch.save; a memcpy before each "
          f"of those\n      and {cfg.memcpy_reps} more at the start and at the end"
          + (" [--quick]" if cfg.quick else ""))
    print()


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    """The table of ``rows``: bench_local's figures["results"]."""
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
            ref = fs_load if "load" in key or "resume" in key else fs_save
            vs_fs = f"{m['best_gbps'] / ref['best_gbps']:.2f}x"
        print(f"{m['label']:<34}{len(m['samples']):>5}{m['seconds']:>9.4f}{m['gbps']:>8.2f}"
              f"{m['best_gbps']:>11.2f}{m['x_memcpy']:>9.2f}x{vs_fs:>10}")
    print()


def print_series(nbytes: int, memcpy_alone: dict[str, list[float]], ours: dict[str, Any]) -> None:
    """Every rep, in order: shows warm-up, buffer recycling and noise (``memcpy_alone`` and
    ``ours``: bench_local's figures["memcpy_alone"] and figures["ours_series"])."""
    print(f"memcpy alone: {nbytes / statistics.median(memcpy_alone['before']) / GB:.2f} GB/s at the start, "
          f"{nbytes / statistics.median(memcpy_alone['after']) / GB:.2f} GB/s at the end (medians)")
    print("ours, seconds per rep, in order:")
    series = (("saves", ours["saves"]), ("loads", ours["loads"]), ("async_save blocking", ours["async_blocking"]))
    for name, s in series:
        print(f"  {name:<24}{_fmt(s['seconds'])}")
        print(f"  {'  paired memcpy':<24}{_fmt(s['memcpy_s'])}")
    print(f"  {'async_save to commit':<24}{_fmt(ours['async_total_s'])}")
    fresh = ours["fresh_resumes"]
    if fresh["seconds"]:
        print(f"  {'resume, fresh process':<24}{_fmt(fresh['seconds'])}")
        print(f"  {'  paired memcpy':<24}{_fmt(fresh['memcpy_s'])}")
        phases = [p for p in ours["fresh_phases"] if p]
        if phases:
            names = list(phases[0])
            print("  fresh-process resume, Recovery's phases (median of the reps): " + ", ".join(
                f"{k} {statistics.median(p.get(k, 0.0) for p in phases):.3f} s" for k in names))
        else:
            print("  fresh-process resume: Recovery reported no phases")
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
    print(f"RssShmem at the end: {size_str(mapped_shmem)} (the shard buffers this process keeps mapped: "
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
    if "fresh_resume_vs_memcpy" in estimates["paired"]:
        checks.append(("fresh-process resume >= 0.7x memcpy", "fresh_resume_vs_memcpy", "paired", ">=",
                       TARGET_FRESH_RESUME_VS_MEMCPY))
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


def print_targets(targets: list[dict[str, Any]], quick: bool = False) -> None:
    print("targets: memcpy ratios judged on the paired estimate, DCP FS ratios on the best reps (see the\n"
          "README); the other estimates are shown for reference")
    if quick:
        print(QUICK_NOTE)
    for t in targets:
        value = f"{t['value']:.1%}" if not t["estimates"] else f"{t['value']:.2f}x"
        others = ", ".join(f"{b} {v:.2f}x" for b, v in t["estimates"].items() if b != t["basis"])
        line = f"  {verdict(t['pass'], quick)}  {t['name']:<42}{value:>8} {t['basis']:<7}"
        print((line + (f"  ({others})" if others else "")).rstrip())
    if not quick:
        passed = sum(t["pass"] for t in targets)
        print(f"  {passed}/{len(targets)} passed")
