#!/usr/bin/env python
"""Single-process benchmark: mlcheckpoint against memcpy, DCP's file system storage and torch.save.

One run measures, on a state dict shaped like a real model (a few large matrices, a few hundred
small tensors, float32 and bfloat16, plus non-tensor values):

* memcpy into warm buffers (the limit), DCP FileSystemWriter save / FileSystemReader load into
  /dev/shm, and torch.save into a /dev/shm file (the baselines);
* mlcheckpoint: the first (cold) save, steady-state saves, load, and the time async_save holds
  the caller, with the anonymous memory it uses on the side;
* mlcheckpoint: ``resume`` in a fresh child process (a restarted job: new interpreter, new
  CheckpointManager, no warm mappings) of what this process saved, beside the same-process load.

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
import secrets
import shutil
import statistics
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from a checkout: import the package from it
    sys.path.insert(0, REPO_ROOT)

import torch
import torch.distributed.checkpoint as dcp
from typing_extensions import Self

from benchmarks.harness.baselines import dcp_fs_load, dcp_fs_save, make_memcpy
from benchmarks.harness.processes import Helpers, exit_on_sigterm, make_workspace
from benchmarks.harness.report import machine_info, run_and_report
from benchmarks.harness.stats import GB, GiB, timed
from benchmarks.harness.workloads import (
    StateDict,
    TensorSpec,
    check_equal,
    model_state_dict,
    quiet_dcp,
    scrub,
    tensors_of,
    warm_target,
)
from benchmarks.local_report import (
    evaluate_targets,
    print_header,
    print_memory,
    print_series,
    print_table,
    print_targets,
)
from mlcheckpoint import CheckpointManager

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
    fresh_resumes: int  # resumes in a fresh child process (0: skip)
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
    p.add_argument("--fresh-resumes", type=int, default=None,
                   help="resumes of the last save by a fresh child process (default 3; 1 with "
                        "--quick; 0 skips)")
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
                  fresh_resumes=(args.fresh_resumes if args.fresh_resumes is not None
                                 else 1 if args.quick else 3),
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


def composition(specs: list[TensorSpec]) -> Composition:
    """What the state dict holds (the large matrices are the 2-d tensors of ``model_layout``)."""
    rows = [(s.name, list(s.shape), str(s.dtype).removeprefix("torch."), s.nbytes) for s in specs]
    large = [r for r in rows if len(r[1]) == 2]
    small = [r for r in rows if len(r[1]) != 2]
    return Composition(sum(r[3] for r in rows), large, small, {"step": "int", "run_name": "str"})


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

    def __enter__(self) -> Self:
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
        saves.run(memcpy, lambda p=path: dcp_fs_save(sd, p))
    for _ in range(reps):
        # The paired memcpy writes into `target` too: scrub it afterwards.
        loads.run(memcpy, lambda: dcp_fs_load(target, path),
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
    fresh_resumes: Series = field(default_factory=Series)  # ckpt.resume in a fresh process
    fresh_phases: list[dict[str, float]] = field(default_factory=list)  # the child's Recovery phases


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


def run_fresh_resumes(job_id: str, local_dir: str, root: str, cfg: Config,
                      memcpy: Callable[[], float], out: OursResult) -> None:
    """A restarted job is a fresh process: a child (new interpreter, new CheckpointManager, no
    warm mappings) resumes what this process saved. Only its ``resume`` call is timed; the
    memcpy paired with it runs here, right before the child starts."""
    helpers = Helpers(root)
    try:
        for i in range(cfg.fresh_resumes):
            result_path = os.path.join(root, f"fresh-resume-{i}.json")
            args = {"job_id": job_id, "local_dir": local_dir, "size_bytes": cfg.size_bytes,
                    "threads": cfg.threads, "out": result_path}
            out.fresh_resumes.memcpy_s.append(memcpy())
            proc = helpers.spawn([sys.executable, os.path.abspath(__file__), "--_resume-child",
                                  json.dumps(args)], f"fresh-resume-{i}")
            helpers.wait([proc], timeout=600)
            with open(result_path) as f:
                child = json.load(f)
            out.fresh_resumes.seconds.append(child["seconds"])
            out.fresh_phases.append(child["phases"])
    finally:
        helpers.close()


def resume_child(args: dict[str, Any]) -> None:
    """The child of ``run_fresh_resumes``: resume into a touched state dict (as a model's
    parameters are), check every byte, report the time and Recovery's phases."""
    if args["threads"] is not None:
        torch.set_num_threads(args["threads"])
    expected, _ = model_state_dict(args["size_bytes"])  # same seed: the bytes the parent saved
    target = warm_target(expected)
    with quiet_dcp(), CheckpointManager(job_id=args["job_id"], local_dir=args["local_dir"], keep=2,
                                        replication="none") as ckpt:
        seconds, info = timed(lambda: ckpt.resume(target))
    if info.step is None or info.source != "local":
        raise RuntimeError(f"fresh-process resume found nothing to load: {info}")
    check_equal(expected, target, "fresh-process resume")
    with open(args["out"], "w") as f:
        json.dump({"seconds": seconds, "resume_info_seconds": info.seconds, "step": info.step,
                   "phases": info.phases}, f)


def bench_ours(sd: StateDict, target: StateDict, root: str, cfg: Config,
               memcpy: Callable[[], float]) -> OursResult:
    out = OursResult()
    job_id, local_dir = f"bench-{secrets.token_hex(4)}", os.path.join(root, "mlcheckpoint")
    ckpt = CheckpointManager(job_id=job_id, local_dir=local_dir, keep=2, replication="none")
    try:
        run_saves(ckpt, sd, range(cfg.saves), cfg, memcpy, out)
        run_loads(ckpt, sd, target, cfg.saves - 1, cfg.loads, memcpy, out)
        run_async_saves(ckpt, sd, range(cfg.saves, 2 * cfg.saves), cfg, memcpy, out)
        ckpt.wait()
    finally:
        ckpt.close()  # the caller removes the directory itself
    # A restart is a fresh process after this one has gone: the run's claim on the job
    # directory is released first, as a real job's exit releases it.
    run_fresh_resumes(job_id, local_dir, root, cfg, memcpy, out)
    return out


# ---------------------------------------------------------------------------------- driver
def build_rows(cfg: Config, nbytes: int, memcpy_all: list[float], torch_save: Series,
               fs_save: Series, fs_load: Series, ours: OursResult) -> dict[str, Measurement]:
    async_total = ours.async_total_s[-cfg.steady:]
    rows = {
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
    if ours.fresh_resumes.seconds:
        rows["ours_resume_fresh"] = Measurement("ours: resume, fresh process", ours.fresh_resumes,
                                                nbytes, info={"phases": ours.fresh_phases})
    return rows


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
    if "ours_resume_fresh" in rows:
        out["paired"]["fresh_resume_vs_memcpy"] = rows["ours_resume_fresh"].x_memcpy
        for basis, stat in (("medians", statistics.median), ("best", min)):
            out[basis]["fresh_resume_vs_memcpy"] = (stat(rows["memcpy"].series.seconds)
                                                   / stat(rows["ours_resume_fresh"].series.seconds))
    return out


def measure(cfg: Config, root: str) -> dict[str, Any]:
    machine = machine_info(cfg.shm_dir)
    sd, specs = model_state_dict(cfg.size_bytes)
    comp = composition(specs)
    composition_dict = comp.as_dict()
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
                  + ours.saves.memcpy_s + ours.loads.memcpy_s + ours.async_blocking.memcpy_s + ours.fresh_resumes.memcpy_s + memcpy_after)
    rows = build_rows(cfg, nbytes, memcpy_all, torch_save, fs_save, fs_load, ours)
    estimates = ratios(rows)
    targets = evaluate_targets(estimates, ours.memory)
    return {
        "config": asdict(cfg),
        "machine": {**machine, "load_average_end": os.getloadavg()},
        "state_dict": composition_dict,
        "results": {k: {"label": m.label, "seconds": m.seconds, "gbps": m.gbps,
                        "best_gbps": m.best_gbps, "x_memcpy": m.x_memcpy, "in_memcpys": m.in_memcpys,
                        "samples": m.series.seconds, "paired_memcpy": m.series.memcpy_s, **m.info}
                    for k, m in rows.items()},
        "ratios": estimates,
        "memcpy_alone": {"before": memcpy_before, "after": memcpy_after},
        "ours_series": {"saves": asdict(ours.saves), "loads": asdict(ours.loads),
                        "async_blocking": asdict(ours.async_blocking),
                        "async_total_s": ours.async_total_s,
                        "fresh_resumes": asdict(ours.fresh_resumes), "fresh_phases": ours.fresh_phases},
        "memory": {**ours.memory, "rss_shmem_end": ours.mapped_shmem_end},
        "targets": targets,
        "all_pass": all(t["pass"] for t in targets),
    }


def run(cfg: Config) -> dict[str, Any]:
    """Every figure of the run (see ``measure``), in a workspace removed afterwards."""
    # Peak tmpfs use: keep=2 steps + one in flight + up to two pooled buffers, or one DCP/torch
    # checkpoint at a time; ask for a margin on top.
    root = make_workspace("mlckpt-bench-local-", cfg.shm_dir, need_bytes=6 * cfg.size_bytes)
    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        with quiet_dcp():
            figures = measure(cfg, root)
    finally:
        torch.set_num_threads(threads_before)  # main() may be called from a longer-lived process
        shutil.rmtree(root, ignore_errors=True)
    return figures


def report(cfg: Config, figures: dict[str, Any]) -> None:
    memory = {k: v for k, v in figures["memory"].items() if k != "rss_shmem_end"}
    print_header(figures["machine"], figures["state_dict"], cfg)
    print_table(figures["results"])
    print_series(figures["state_dict"]["total_bytes"], figures["memcpy_alone"], figures["ours_series"])
    print_memory(memory, figures["memory"]["rss_shmem_end"], cfg.sample_interval_s)
    print_targets(figures["targets"], cfg.quick)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the report and return every figure (see --json)."""
    cfg = parse_args(argv)
    return run_and_report(cfg, run, report, cfg.json_path)


if __name__ == "__main__":
    exit_on_sigterm()
    if len(sys.argv) == 3 and sys.argv[1] == "--_resume-child":
        resume_child(json.loads(sys.argv[2]))
    else:
        main()
