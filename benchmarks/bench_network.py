#!/usr/bin/env python
"""Replication on an emulated network: what it costs a training job that checkpoints every
step, how far protection lags, and how fast a replaced node resumes over the link (issue 21).

An emulated cluster (``mlcheckpoint.testing.netcluster``): ``--nodes`` nodes x ``--nproc``
ranks, each node in a network namespace of its own behind a link shaped with tc tbf, at each
of ``--rates``. A DDP model (gloo: its all-reduce crosses the shaped link every step) of
bench_training's transformer shape, ``--params-mb`` of parameters plus AdamW's two moments
(about 400 MB per rank by default), trains with ``ckpt.guard(optimizer)`` and
``ckpt.async_save`` after EVERY step (benchmarks/net_train_worker.py, under torchrun in the
namespaces). Interleaved rounds of four modes, each a fresh launch of the job on the same
cluster:

* none        no checkpointing
* off         ``CheckpointManager(replication="none")``
* unbudgeted  replication over TCP, ``MLCHECKPOINT_REPLICATION_BANDWIDTH=unlimited``
* budgeted    replication over TCP at the library's default budget (the variable unset)

Per rate and mode: step time (median, p90, against "off" and "none"; against "off" also with
a 95% bootstrap interval, over all measured steps and over each launch's second half, once the
default budget has settled), forward+backward (which holds DDP's all-reduce), the bytes node 0
sends per step (its eth0 counters), protection lag
(``ckpt.protection()`` after every step: lag in steps and age in seconds, the series in the
JSON), the peak tmpfs use per node (its local_dir, sampled every 0.5 s) and each rank's peak
RssAnon growth from before its CheckpointManager was made.

After each unbudgeted launch (its replication keeps up, so its newest steps are protected; the
default budget yields to training and may not have protected a step in a short launch): node 1
is lost (killed, memory wiped) and the survivors' processes stopped (their memory kept); a resume-only job restarts and node 1 fetches its shards from its
partner. Its ``ResumeInfo.seconds`` is set against a raw TCP transfer of the same bytes over
the same link (``NetCluster.raw_tcp_throughput``), measured right before and right after.
``--nodes 4 --replace 2`` also replaces two nodes of different pairs at once (nodes 1 and 3)
and reports that resume next to the one-replaced one.

    python benchmarks/bench_network.py                       # 2 nodes, 1gbit and 5gbit, 2 rounds
    python benchmarks/bench_network.py --quick               # tiny model, a smoke run
    python benchmarks/bench_network.py --rates 1gbit --steps 20 --json out.json
    python benchmarks/bench_network.py --nodes 4 --replace 2 --params-mb 40

Needs root and iproute2 (network namespaces, veth, tc). Everything (namespaces, processes,
/dev/shm directories) is removed at the end, on error and on SIGTERM.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import math
import os
import shlex
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from a checkout: import the package from it
    sys.path.insert(0, REPO_ROOT)

from benchmarks.harness.processes import exit_on_sigterm
from benchmarks.harness.report import (
    cpu_ticks,
    loadavg,
    machine_info,
    progress,
    run_and_report,
)
from benchmarks.harness.stats import median, p90, ratio_interval, size_str
from mlcheckpoint import CheckpointManager
from mlcheckpoint.store.layout import Kind, classify
from mlcheckpoint.testing.netcluster import (
    NetCluster,
    RawTransfer,
    available,
    parse_rate,
)

WORKER = os.path.join(REPO_ROOT, "benchmarks", "net_train_worker.py")
BANDWIDTH_ENV = "MLCHECKPOINT_REPLICATION_BANDWIDTH"
ADAPTIVE_ENV = "MLCHECKPOINT_ADAPTIVE_PACING"
MODES = ("none", "off", "unbudgeted", "budgeted", "adaptive")
DEFAULT_MODES = ("none", "off", "unbudgeted", "budgeted")
RESUME_AFTER = "unbudgeted"  # the launch whose memory the resume starts from
LABELS = {"none": "no checkpointing", "off": "replication off",
          "unbudgeted": "replication, unbudgeted", "budgeted": "replication, default budget",
          "adaptive": "replication, adaptive pacing"}
# What each mode adds to the job's environment. "budgeted" leaves the variables unset (the
# worker also drops them, should the caller's shell have set them).
MODE_ENV = {"none": {}, "off": {}, "unbudgeted": {BANDWIDTH_ENV: "unlimited"}, "budgeted": {},
            "adaptive": {ADAPTIVE_ENV: "1"}}
REPLICATING = ("unbudgeted", "budgeted", "adaptive")

TARGET_BUDGETED_VS_OFF = 1.02  # median step time <= 2% above replication off
TARGET_IDLE_SHARE = 0.6  # the default takes >= 60% of the link capacity training leaves idle
TARGET_LAG_FAST = 2  # steps, at 5 Gbit/s and faster
TARGET_RESUME_VS_RAW = 0.8  # resume >= 0.8x the raw transfer of the same bytes
TARGET_PARALLEL_RESUME = 1.25  # "about as long": k nodes replaced at once vs one
SAMPLE_EVERY_S = 0.5  # tmpfs sampling period
# A bare transfer per rate and round (Bench.link_cost): about an FSDP shard of the default model.
LINK_COST_BYTES = 200 * 10**6
LINK_COST_BYTES_QUICK = 16 * 10**6


# ---------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Config:
    rates: tuple[str, ...]
    modes: tuple[str, ...]
    parallel: str  # ddp, fsdp or hsdp
    nodes: int
    nproc: int  # ranks per node
    replace: int  # nodes replaced at once in the largest resume case
    rounds: int
    steps: int  # per launch, warm-up included
    warmup: int  # discarded steps at the start of each launch
    params_mb: float
    batch: int
    seq_len: int
    keep: int
    quick: bool
    json_path: str | None
    rank_state: int = 0  # bytes of per-rank state (an RNG state, a loader's position) per rank
    host: str = "busy"  # busy: real compute; idle: collectives + a wait (a GPU node's host)
    compute_s: float | None = None  # idle: the waits (None: the first launch calibrates them)
    optim_s: float | None = None

    def worker_args(self) -> list[str]:
        return ["--params-mb", str(self.params_mb), "--seq-len", str(self.seq_len),
                "--parallel", self.parallel, "--rank-state", str(self.rank_state)]

    def train_args(self) -> list[str]:
        return [*self.worker_args(), "--steps", str(self.steps), "--warmup", str(self.warmup),
                "--batch", str(self.batch), "--keep", str(self.keep), "--host", self.host]

    @property
    def replaced_sets(self) -> list[list[int]]:
        """Which nodes each resume case replaces: node 1 alone, then (with --replace k > 1) k
        odd nodes, each in a different pair (pairs are 2i, 2i+1)."""
        cases = [[1]]
        if self.replace > 1:
            cases.append([2 * i + 1 for i in range(self.replace)])
        return cases


def _budget_supported() -> bool:
    """Whether this build's manager takes a replication bandwidth budget (flat before issue 30,
    a ReplicationOptions field since)."""
    import mlcheckpoint
    options = getattr(mlcheckpoint, "ReplicationOptions", None)
    if options is not None:
        return "bandwidth" in inspect.signature(options).parameters
    return "replication_bandwidth" in inspect.signature(CheckpointManager).parameters


def parse_args(argv: list[str]) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", default=None,
                   help="link rates in tc notation (default 1gbit 5gbit; 1gbit with --quick)")
    p.add_argument("--parallel", choices=("ddp", "fsdp", "hsdp"), default="ddp",
                   help="how the model is spread: ddp (every rank the whole model, gradients "
                        "all-reduced), fsdp (sharded over all ranks: all-gathers and "
                        "reduce-scatters cross the link), hsdp (sharded within a node, "
                        "replicated across nodes) (default ddp)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=None,
                   help=f"modes to interleave (default {' '.join(DEFAULT_MODES)}; "
                        "adaptive: the default budget with MLCHECKPOINT_ADAPTIVE_PACING=1, "
                        "issue 28's delay-based pacing)")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    p.add_argument("--nproc", type=int, default=1, help="ranks per node (default 1)")
    p.add_argument("--replace", type=int, default=1,
                   help="also resume with this many nodes of different pairs replaced at once "
                        "(default 1: node 1 only; 2 needs --nodes 4)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every mode (default 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per launch, warm-up included (default 12; 4 with --quick)")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps discarded at the start of each launch (default keep+1 = 3: the "
                        "first keep+1 saves make their tmpfs buffers; 1 with --quick)")
    p.add_argument("--params-mb", type=float, default=None,
                   help="model parameters in MB; the checkpoint is about 3x (AdamW) "
                        "(default 134; 2 with --quick)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 64; 32 with --quick)")
    p.add_argument("--keep", type=int, default=2, help="CheckpointManager keep= (default 2)")
    p.add_argument("--rank-state", type=int, default=0, metavar="BYTES",
                   help="per-rank state beside the model, as real jobs keep: each rank saves an "
                        "RNG state of BYTES under its own key and a data loader's position "
                        "(default 0: none; 5056 is torch.get_rng_state()'s size)")
    p.add_argument("--host", choices=("busy", "idle"), default="busy",
                   help="busy: each step computes on the host (CPU contention with replication "
                        "shows); idle: the same collectives over the link, the compute replaced "
                        "by a wait of its calibrated length, as on a GPU node whose host CPUs "
                        "idle during a step (default busy)")
    p.add_argument("--compute-s", type=float, default=None,
                   help="--host idle: seconds of forward+backward compute each step waits "
                        "(default: calibrated by the first launch, then the same in every launch)")
    p.add_argument("--optim-s", type=float, default=None,
                   help="--host idle: seconds of optimizer arithmetic each step waits (default: "
                        "calibrated with --compute-s)")
    p.add_argument("--json", metavar="PATH", help="also write every figure to PATH as JSON")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps: a smoke run")
    a = p.parse_args(argv)
    rates = tuple(a.rates or (["1gbit"] if a.quick else ["1gbit", "5gbit"]))
    for r in rates:
        try:
            parse_rate(r)
        except ValueError as e:
            p.error(str(e))
    steps = a.steps if a.steps is not None else (4 if a.quick else 12)
    warmup = a.warmup if a.warmup is not None else (1 if a.quick else a.keep + 1)
    if a.nodes < 2 or a.nproc < 1 or a.rounds < 1 or warmup < 1 or steps < warmup + 2:
        p.error("need --nodes >= 2, --nproc >= 1, --rounds >= 1, --warmup >= 1, --steps >= warmup + 2")
    if a.replace < 1 or 2 * a.replace > a.nodes:
        p.error(f"--replace {a.replace}: 1 to nodes/2 (one node of each pair)")
    modes = tuple(m for m in MODES if m in (a.modes or DEFAULT_MODES))
    if "off" not in modes:
        p.error("--modes must include off: every figure is set against it")
    return Config(rates=rates, modes=modes, parallel=a.parallel, nodes=a.nodes, nproc=a.nproc, replace=a.replace, rounds=a.rounds,
                  steps=steps, warmup=warmup,
                  params_mb=a.params_mb if a.params_mb is not None else (2.0 if a.quick else 134.0),
                  batch=a.batch, seq_len=a.seq_len or (32 if a.quick else 64), keep=a.keep,
                  quick=a.quick, json_path=a.json, rank_state=a.rank_state, host=a.host,
                  compute_s=a.compute_s, optim_s=a.optim_s)


# ---------------------------------------------------------------------------------- measuring
def counters_delta(before: dict[int, dict[str, int]], after: dict[int, dict[str, int]]) -> dict[int, dict[str, int]]:
    return {k: {d: after[k][d] - before[k][d] for d in before[k]} for k in before}


def tree_bytes(path: str) -> int:
    """Bytes allocated under ``path`` (du: blocks, not apparent sizes)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:  # retired meanwhile
                pass
    return total


TMPFS_PARTS = ("own", "replicas", "staging", "pool", "other")


def tree_parts(path: str, own: range) -> dict[str, int]:
    """``tree_bytes`` split by what each file is (docs/performance.md, "tmpfs per node"):
    committed shards of the node's own ranks (``own``) and of other nodes' ranks (replicas),
    shard buffers being written (staging), the buffer pool, and the rest (metadata,
    manifests, locks)."""
    parts = dict.fromkeys(TMPFS_PARTS, 0)
    for root, _, files in os.walk(path):
        for name in files:
            try:
                nbytes = os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:  # retired meanwhile
                continue
            e = classify(name)
            part = ("own" if e.rank in own else "replicas") if e.kind is Kind.DATA else \
                {Kind.INFLIGHT: "staging", Kind.POOL_BUFFER: "pool",
                 Kind.POOL_INFLIGHT: "pool"}.get(e.kind, "other")
            parts[part] += nbytes
    return parts


class TmpfsSampler:
    """Every node's local_dir usage, sampled on a thread while a launch runs; with its parts
    (``tree_parts``) at each node's peak."""

    def __init__(self, cluster: NetCluster, nproc: int = 1):
        self.dirs = [n.local_dir for n in cluster.nodes]
        self.own = [range(k * nproc, (k + 1) * nproc) for k in range(len(self.dirs))]
        self.peak_parts: list[dict[str, int]] = [dict.fromkeys(TMPFS_PARTS, 0) for _ in self.dirs]
        self.series: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tmpfs-sampler")
        self._thread.start()

    def _sample(self) -> None:
        parts = [tree_parts(d, own) for d, own in zip(self.dirs, self.own, strict=True)]
        totals = [sum(p.values()) for p in parts]
        for k, p in enumerate(parts):
            if totals[k] > sum(self.peak_parts[k].values()):
                self.peak_parts[k] = p
        self.series.append((time.perf_counter() - self._t0, totals))

    def _loop(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(SAMPLE_EVERY_S):
                return

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        self._sample()  # the end state
        return {"peak_bytes": [max(s[k] for _, s in self.series) for k in range(len(self.dirs))],
                "peak_parts": self.peak_parts,
                "series": [[round(t, 2), s] for t, s in self.series]}


def wait_for_results(cluster: NetCluster, name: str, world: int, timeout: float) -> dict[int, dict]:
    """Every rank's result of ``name`` (from jobs that keep running after reporting); fails
    early, with the logs, if an agent exits first."""
    deadline = time.monotonic() + timeout
    while True:
        results = cluster.results(name)
        if len(results) == world:
            return results
        for node in cluster.nodes:
            if node.proc is not None and node.proc.poll() not in (None, 0):
                raise RuntimeError(f"node {node.index} exited with {node.proc.returncode} before "
                                   f"reporting {name}; logs:\n{cluster.logs()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: no result from every rank within {timeout:.0f} s; logs:\n{cluster.logs()}")
        time.sleep(0.2)


# ---------------------------------------------------------------------------------- the runs
class Bench:
    """One run: a cluster, its launches and resumes."""

    def __init__(self, cfg: Config, cluster: NetCluster):
        self.cfg, self.cluster = cfg, cluster
        self.world = cfg.nodes * cfg.nproc
        self.launches: list[dict[str, Any]] = []
        self.resumes: list[dict[str, Any]] = []
        self.link_costs: list[dict[str, Any]] = []
        self.compute: tuple[float, float] | None = (
            None if cfg.compute_s is None else (cfg.compute_s, cfg.optim_s or 0.0))
        self.base_env = {"PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)}

    def fresh(self) -> None:
        """Nothing running, every node's memory empty: the next launch starts from nothing."""
        self.cluster.kill_all()
        for node in self.cluster.nodes:
            node.wipe()

    def train(self, mode: str, rate: str, rnd: int, hold: bool) -> dict[str, Any]:
        """One launch of the training job in ``mode``; with ``hold`` it keeps running (and
        replicating) after reporting, until a resume case stops it."""
        cfg, cluster = self.cfg, self.cluster
        n = len(self.launches)
        name, job_id = f"train{n}", f"bench-net-{n}-{mode}"
        # Idle host: every launch waits alike, what the first one calibrated (or --compute-s).
        idle = ([] if cfg.host != "idle" or self.compute is None else
                ["--compute-s", str(self.compute[0]), "--optim-compute-s", str(self.compute[1])])
        self.fresh()
        before = cluster.link_bytes()
        tmpfs = TmpfsSampler(cluster, cfg.nproc)
        t0 = time.perf_counter()
        cluster.start(WORKER, mode, name, *cfg.train_args(), *idle, *(["--hold"] if hold else []),
                      env={**self.base_env, "MLCHECKPOINT_JOB_ID": job_id, **MODE_ENV[mode]})
        timeout = 180 + 60 * cfg.steps
        try:
            if hold:
                ranks = wait_for_results(cluster, name, self.world, timeout)
            else:
                codes = cluster.wait(timeout)
                if any(codes):
                    raise RuntimeError(f"{mode} launch: exit codes {codes}; logs:\n{cluster.logs()}")
                ranks = cluster.results(name)
        finally:
            usage = tmpfs.stop()
        launch = {"index": n, "mode": mode, "rate": rate, "round": rnd, "job_id": job_id,
                  "wall_s": time.perf_counter() - t0, "link_bytes": counters_delta(before, cluster.link_bytes()),
                  "tmpfs": usage, "ranks": {str(r): v for r, v in sorted(ranks.items())}}
        self.launches.append(launch)
        cal = launch["ranks"]["0"].get("calibration")
        if self.compute is None and cal:
            self.compute = (cal["compute_s"], cal["optim_compute_s"])
        return launch

    def node_checkpoint_bytes(self, launch: dict[str, Any], node: int) -> int:
        """Bytes of one step's checkpoint of ``node``'s ranks (their last save)."""
        return sum(r["save_bytes"][-1] for r in launch["ranks"].values() if r["node"] == node)

    def resume(self, launch: dict[str, Any], replaced: list[int]) -> dict[str, Any]:
        """Lose ``replaced`` (killed, memory wiped), stop the survivors (memory kept), and time
        the restarted job's resume against raw transfers of the same bytes over the same link,
        right before and right after."""
        cluster = self.cluster
        for k in replaced:
            cluster.node(k).kill()
            cluster.node(k).wipe()
        cluster.kill_all()  # the scheduler stops the survivors; their memory stays
        first = replaced[0]
        partner = first ^ 1  # its replicas' holder
        nbytes = self.node_checkpoint_bytes(launch, first)
        raw_before = cluster.raw_tcp_transfer(partner, first, nbytes).bytes_per_s
        name = f"resume{len(self.resumes)}"
        before = cluster.link_bytes()
        t0 = time.perf_counter()
        cluster.start(WORKER, "resume", name, *self.cfg.worker_args(),
                      env={**self.base_env, "MLCHECKPOINT_JOB_ID": launch["job_id"]})
        try:
            ranks = wait_for_results(cluster, name, self.world, 300)
        finally:
            cluster.kill_all()  # before the second raw transfer: healing must not share the link
        launch_s = time.perf_counter() - t0
        received = counters_delta(before, cluster.link_bytes())
        raw_after = cluster.raw_tcp_transfer(partner, first, nbytes).bytes_per_s
        result = {"rate": launch["rate"], "round": launch["round"], "after_launch": launch["index"],
                  "replaced": replaced, "raw_nbytes": nbytes, "raw_before_Bps": raw_before,
                  "raw_after_Bps": raw_after, "launch_s": launch_s,
                  "link_bytes": received, "ranks": {str(r): v for r, v in sorted(ranks.items())}}
        self.resumes.append(result)
        return result

    def link_cost(self, rate: str, rnd: int) -> dict[str, Any]:
        """What the bare transfer of a shard's worth of bytes costs on this link, with nothing
        else running: node 1 sends to node 0 by sendfile, node 0 lands them in a fresh tmpfs
        file (replication's path without our code). The two processes' CPU, and the host's
        (/proc/stat: the kernel's network work that ran outside them too)."""
        self.fresh()
        nbytes = LINK_COST_BYTES_QUICK if self.cfg.quick else LINK_COST_BYTES

        def host_cpu_s(n: int) -> tuple[RawTransfer, float]:
            cpu0 = cpu_ticks()
            raw = self.cluster.raw_tcp_transfer(1, 0, n, into_tmpfs=True)
            return raw, (cpu_ticks()[0] - cpu0[0]) / os.sysconf("SC_CLK_TCK")

        _, starting = host_cpu_s(1)  # the two processes' start and end, without bytes to move
        raw, host = host_cpu_s(nbytes)
        cost = {"rate": rate, "round": rnd, "nbytes": nbytes, "seconds": raw.seconds,
                "sender_cpu_s": raw.sender_cpu_s, "receiver_cpu_s": raw.receiver_cpu_s,
                "host_cpu_s": max(0.0, host - starting)}
        self.link_costs.append(cost)
        return cost

    def run(self) -> None:
        cfg = self.cfg
        for rnd in range(cfg.rounds):
            modes = cfg.modes
            order = list(modes[rnd % len(modes):] + modes[:rnd % len(modes)])  # no mode always first
            for rate in cfg.rates:
                self.cluster.set_rate(rate)
                cost = self.link_cost(rate, rnd)
                progress(f"round {rnd + 1}/{cfg.rounds}, {rate}: a bare transfer of {size_str(cost['nbytes'])} "
                         f"took {cost['seconds']:.2f} s, CPU {cost['sender_cpu_s']:.2f} s sending, "
                         f"{cost['receiver_cpu_s']:.2f} s receiving, {cost['host_cpu_s']:.2f} s on the host")
                for mode in order:
                    launch = self.train(mode, rate, rnd, hold=mode == RESUME_AFTER)
                    progress(f"round {rnd + 1}/{cfg.rounds}, {rate}, {mode}: median step "
                             f"{median(measured(launch, 'step_s')):.3f} s, launch {launch['wall_s']:.0f} s")
                    if mode == RESUME_AFTER:
                        for replaced in cfg.replaced_sets:
                            r = self.resume(launch, replaced)
                            progress(f"  resume, node(s) {replaced} replaced: {resume_seconds(r):.2f} s "
                                     f"for {size_str(fetched_bytes(r, replaced[0]))}, raw "
                                     f"{r['raw_before_Bps'] * 8 / 1e9:.2f}/{r['raw_after_Bps'] * 8 / 1e9:.2f} Gbit/s")
        self.fresh()


def run(cfg: Config) -> dict[str, Any]:
    """Build the cluster, run every launch and resume, tear it down; the raw figures."""
    with NetCluster(nodes=cfg.nodes, nproc=cfg.nproc, rate=cfg.rates[0]) as cluster:
        bench = Bench(cfg, cluster)
        bench.run()
    return {"launches": bench.launches, "resumes": bench.resumes, "link_costs": bench.link_costs}


# ---------------------------------------------------------------------------------- figures
def measured(launch: dict[str, Any], key: str, rank: str = "0") -> list[float]:
    """``key`` of the steps after the warm-up, as rank ``rank`` saw them (None left out)."""
    r = launch["ranks"][rank]
    return [s[key] for s in r["steps"][r["warmup"]:] if s[key] is not None]


def node0_bytes_per_step(launch: dict[str, Any]) -> float:
    """What node 0 sent on its link per measured step (its eth0 counter, read by rank 0)."""
    r = launch["ranks"]["0"]
    steps, w = r["steps"], r["warmup"]
    return (steps[-1]["tx_bytes"] - steps[w - 1]["tx_bytes"]) / (len(steps) - w)


def replaced_ranks(res: dict[str, Any], node: int) -> list[dict[str, Any]]:
    return [r for r in res["ranks"].values() if r["node"] == node]


def resume_seconds(res: dict[str, Any]) -> float:
    """The resume of the replaced nodes: their ranks' ResumeInfo.seconds (the slowest)."""
    return max(r["seconds"] for k in res["replaced"] for r in replaced_ranks(res, k))


def resume_phases(res: dict[str, Any]) -> dict[str, float]:
    """``ResumeInfo.phases`` of the slowest replaced rank (the one ``resume_seconds`` names)."""
    slowest = max((r for k in res["replaced"] for r in replaced_ranks(res, k)), key=lambda r: r["seconds"])
    return slowest.get("phases") or {}


def fetched_bytes(res: dict[str, Any], node: int) -> int:
    """What ``node``'s ranks fetched from peers (each rank's own count, from its history)."""
    return sum(r["own_bytes_fetched"] or 0 for r in replaced_ranks(res, node))


def halves_median(xs: list[float]) -> tuple[float, float]:
    h = len(xs) // 2
    return median(xs[:h] or xs), median(xs[h:])


def dedup_figures(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """What each rank stages and pushes against its state, and tmpfs per node by part at its
    peak (the node with the highest peak)."""
    ranks = [r for launch in launches for r in launch["ranks"].values()]
    staged = [x for r in ranks for x in r.get("staged_bytes", [])[1:] if x is not None]
    pushed = [r["pushed"] for r in ranks if r.get("pushed", {}).get("steps")]
    peaks = [(sum(p.values()), p) for launch in launches for p in launch["tmpfs"].get("peak_parts", [])]
    return {"state_bytes": max(r["state_bytes"] for r in ranks),
            "staged_bytes_median": median(staged) if staged else None,
            "pushed_bytes_per_step": median([p["bytes"] / p["steps"] for p in pushed]) if pushed else None,
            "tmpfs_peak_parts": max(peaks, key=lambda x: x[0])[1] if peaks else None}


def summarize_mode(cfg: Config, launches: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [x for launch in launches for x in measured(launch, "step_s")]
    lag = [x for launch in launches for x in measured(launch, "lag_steps")]
    age = [x for launch in launches for x in measured(launch, "age_s")]
    shard = max(r["save_bytes"][-1] if r["save_bytes"] else r["state_bytes"]
                for launch in launches for r in launch["ranks"].values())
    node_ckpt = shard * cfg.nproc
    tmpfs_peak = max(max(launch["tmpfs"]["peak_bytes"]) for launch in launches)
    rss = max(r["rss_anon_peak"] - r["rss_anon_baseline"] for launch in launches for r in launch["ranks"].values())
    halves = [halves_median(xs) for launch in launches if (xs := measured(launch, "lag_steps"))]
    last0 = [launch["ranks"]["0"]["steps"][-1] for launch in launches]
    return {
        "steps": len(steps), "median_s": median(steps), "p90_s": p90(steps), "step_s": steps,
        "settled_step_s": [x for launch in launches for x in settled(measured(launch, "step_s"))],
        "round_medians_s": [median(measured(launch, "step_s")) for launch in launches],
        "fwd_bwd_median_s": median([x for launch in launches for x in measured(launch, "fwd_bwd_s")]),
        "optim_median_s": median([x for launch in launches for x in measured(launch, "optim_s")]),
        "save_call_median_s": median([x for launch in launches for x in measured(launch, "save_call_s")]),
        "cpu_busy_median": median([x for launch in launches for x in measured(launch, "cpu_busy")] or [math.nan]),
        "node0_bytes_per_step": median([node0_bytes_per_step(launch) for launch in launches]),
        "lag_steps_median": median(lag) if lag else None, "lag_steps_max": max(lag) if lag else None,
        "lag_first_half_median": median([h[0] for h in halves]) if halves else None,
        "lag_second_half_median": median([h[1] for h in halves]) if halves else None,
        "age_s_median": median(age) if age else None, "age_s_max": max(age) if age else None,
        "superseded": [s["superseded"] for s in last0],
        "replication_rate_Bps": median([s["rate_bytes_per_s"] for s in last0 if s["rate_bytes_per_s"]] or [math.nan]),
        "shard_bytes": shard, "node_checkpoint_bytes": node_ckpt,
        "tmpfs_peak_bytes": tmpfs_peak, "tmpfs_peak_checkpoints": tmpfs_peak / node_ckpt,
        "rss_anon_growth_bytes": rss, "rss_anon_growth_shards": rss / shard,
        **dedup_figures(launches),
        "guard_longest_wait_s": max((r["guard_longest_wait_s"] or 0.0) for launch in launches
                                    for r in launch["ranks"].values()),
        "budget": launches[0]["ranks"]["0"]["budget"],
        "protected_every": protected_every(launches),
        "profile": replication_profile(launches),
        "thread_cpu_per_step": thread_cpu_per_step(launches),
        "calibration": launches[0]["ranks"]["0"].get("calibration"),
    }


def thread_cpu_per_step(launches: list[dict[str, Any]]) -> dict[str, float]:
    """CPU seconds per step of a rank's process, by thread name (the worker's ``thread_cpu``:
    the training loop, replication's own threads, ``(process)`` for the whole), averaged over
    the launches' ranks: what replication costs the training process itself."""
    sums: dict[str, float] = {}
    ranks = 0
    for launch in launches:
        for r in launch["ranks"].values():
            if not r.get("thread_cpu_s"):
                continue
            ranks += 1
            for name, seconds in r["thread_cpu_s"].items():
                sums[name] = sums.get(name, 0.0) + seconds / len(r["steps"])
    return {name: total / ranks for name, total in sorted(sums.items(), key=lambda kv: -kv[1])} if ranks else {}


def settled(xs: list[float]) -> list[float]:
    """The second half of a launch's measured steps: once the default budget's pacing has
    settled (it starts at the derived rate and backs off over the first steps)."""
    return xs[len(xs) // 2:]


def protected_every(launches: list[dict[str, Any]]) -> float | None:
    """k: replication protects every k-th step once the pacing has settled: the second half of
    each launch's measured steps, per time the newest protected step rank 0 saw moved on in it
    (None: it never moved on there). Not the median gap: a run whose pushes fall behind step by
    step has gaps of 1 early on and one long one at the end."""
    steps = advances = 0
    for launch in launches:
        half = settled(measured(launch, "newest_protected"))
        steps += len(half)
        advances += sum(1 for a, b in itertools.pairwise(half) if a is not None and b is not None and b > a)
    return steps / advances if advances else None


PROFILE_SENDER = ("send_seconds", "budget_wait_seconds")
PROFILE_RECEIVER = ("receive_buffer_seconds", "receive_seconds", "verify_seconds", "commit_seconds")


def replication_profile(launches: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where one replication round's time goes, per rank and push (medians over the launches'
    ranks): the sender's push seconds; the seconds in the kernel's sendfile (which reads the
    tmpfs file) and held back by the budget, summed over a striped push's streams; the receiver's seconds per replica getting the buffer,
    receiving, verifying and committing (``CheckpointManager.stats()``'s ``replication_*``)."""
    pushes = [p for launch in launches for r in launch["ranks"].values() for p in r.get("pushes") or []]
    profiles = [r["replication_profile"] for launch in launches for r in launch["ranks"].values()
                if r.get("replication_profile") and r["replication_profile"].get("received_replicas")]
    if not pushes:
        return None
    out: dict[str, Any] = {"pushes": len(pushes), "push_bytes": median([p["bytes"] for p in pushes]),
                           "push_seconds": median([p["seconds"] for p in pushes])}
    out.update({k: median([p[k] for p in pushes]) if all(p[k] is not None for p in pushes) else None
                for k in PROFILE_SENDER})
    if profiles:
        out["received_bytes"] = median([x["received_bytes"] / x["received_replicas"] for x in profiles])
        out.update({k: median([x[k] / x["received_replicas"] for x in profiles]) for k in PROFILE_RECEIVER})
    return out


def summarize_resume(res: dict[str, Any]) -> dict[str, Any]:
    seconds = resume_seconds(res)
    nbytes = max(fetched_bytes(res, k) for k in res["replaced"])
    raws = [res["raw_before_Bps"], res["raw_after_Bps"]]
    raw_s = [nbytes / b for b in raws]  # the raw transfer of the same bytes, before and after
    ranks = list(res["ranks"].values())
    return {"rate": res["rate"], "round": res["round"], "replaced": res["replaced"],
            "seconds": seconds, "bytes": nbytes, "step": ranks[0]["step"],
            "sources": ranks[0]["sources"], "loaded_ok": all(r["loaded_step"] == r["step"] for r in ranks),
            "raw_gbit_s": [b * 8 / 1e9 for b in raws], "raw_s": raw_s,
            "ratio_before": raw_s[0] / seconds, "ratio_after": raw_s[1] / seconds,
            "ratio": (nbytes / (sum(raws) / 2)) / seconds,
            "link_received_bytes": max(res["link_bytes"][k]["received"] for k in res["replaced"]),
            "launch_s": res["launch_s"], "phases": resume_phases(res)}


def link_figures(m: dict[str, Any], off: dict[str, Any], link_Bps: float) -> None:
    """What a mode did with the link, against replication off (into ``m``): utilisation (node
    0's bytes on its link per second of step), the replication bytes on the link per step (its
    bytes beyond off's), and the share of the capacity off leaves idle that replication used."""
    m["link_utilisation"] = m["node0_bytes_per_step"] / m["median_s"] / link_Bps
    m["replication_bytes_per_step"] = m["node0_bytes_per_step"] - off["node0_bytes_per_step"]
    m["replication_link_Bps"] = m["replication_bytes_per_step"] / m["median_s"]
    m["idle_Bps"] = link_Bps - off["node0_bytes_per_step"] / off["median_s"]
    m["idle_share_used"] = m["replication_link_Bps"] / m["idle_Bps"]


def link_cost_figures(costs: list[dict[str, Any]]) -> dict[str, float] | None:
    """The bare transfers' CPU milliseconds per MB moved (medians over the rounds): the
    sender's and the receiver's processes, and the host's (all CPUs, the kernel's softirq work
    wherever it ran); and the rate the one stream got."""
    if not costs:
        return None
    per_mb = {k: median([c[f"{k}_cpu_s"] * 1e3 / (c["nbytes"] / 1e6) for c in costs])
              for k in ("sender", "receiver", "host")}
    return {**per_mb, "MBps": median([c["nbytes"] / c["seconds"] / 1e6 for c in costs])}


def cpu_per_replicated_mb(cfg: Config, m: dict[str, Any], off: dict[str, Any]) -> dict[str, float]:
    """CPU milliseconds per MB replication moves, against replication off: in a rank's process
    (its process's CPU per step beyond off's, per MB of the rank's share of its node's
    replication bytes: it sends those and receives as many from its partner) and on the host
    (the busy CPUs per step beyond off's, per MB that crossed any node's link). Set against
    ``link_cost_figures``: sender + receiver, and host."""
    mb_per_rank = m["replication_bytes_per_step"] / cfg.nproc / 1e6
    rank = m["thread_cpu_per_step"].get("(process)", math.nan) - off["thread_cpu_per_step"].get("(process)", math.nan)
    cores = os.cpu_count() or 1
    host = (m["cpu_busy_median"] * m["median_s"] - off["cpu_busy_median"] * off["median_s"]) * cores
    mb_moved = m["replication_bytes_per_step"] * cfg.nodes / 1e6
    return {"rank": rank * 1e3 / mb_per_rank if mb_per_rank > 0 else math.nan,
            "host": host * 1e3 / mb_moved if mb_moved > 0 else math.nan}


def summarize(cfg: Config, res: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {"rates": {}, "resumes": [summarize_resume(r) for r in res["resumes"]], "targets": []}
    targets = s["targets"]
    for rate in cfg.rates:
        modes = {m: summarize_mode(cfg, [x for x in res["launches"] if x["rate"] == rate and x["mode"] == m])
                 for m in cfg.modes}
        off = modes["off"]
        link_Bps = (parse_rate(rate) or 0) / 8
        for m in modes.values():
            m["vs_off"] = m["median_s"] / off["median_s"]
            m["vs_off_interval"] = ratio_interval(m["step_s"], off["step_s"])
            m["settled_vs_off"] = median(m["settled_step_s"]) / median(off["settled_step_s"])
            m["settled_vs_off_interval"] = ratio_interval(m["settled_step_s"], off["settled_step_s"])
            m["vs_none"] = m["median_s"] / modes["none"]["median_s"] if "none" in modes else None
            link_figures(m, off, link_Bps)
        if "budgeted" in modes and "unbudgeted" in modes:
            modes["budgeted"]["vs_unbudgeted"] = modes["budgeted"]["median_s"] / modes["unbudgeted"]["median_s"]
        s["rates"][rate] = {"modes": modes,
                            "link_cost": link_cost_figures([c for c in res.get("link_costs", []) if c["rate"] == rate])}
        for mode in REPLICATING:
            if mode in modes:
                modes[mode]["cpu_per_replicated_mb"] = cpu_per_replicated_mb(cfg, modes[mode], off)
        fast = (parse_rate(rate) or 0) >= 5 * 10**9
        for name in ("budgeted", "adaptive"):
            if name not in modes:
                continue
            b, label = modes[name], LABELS[name]
            targets.append({"name": f"{rate}: {label}, median step <= {TARGET_BUDGETED_VS_OFF:.2f}x replication off",
                            "value": b["vs_off"], "pass": b["vs_off"] <= TARGET_BUDGETED_VS_OFF})
            targets.append({"name": f"{rate}: {label}, share of the idle link used >= {TARGET_IDLE_SHARE:.0%}",
                            "value": b["idle_share_used"], "pass": b["idle_share_used"] >= TARGET_IDLE_SHARE})
            bound = TARGET_LAG_FAST if fast else b["node_checkpoint_bytes"] / b["idle_Bps"] / b["median_s"] + 1
            what = (f"{TARGET_LAG_FAST}" if fast else
                    f"bytes per node / idle link rate / step time + 1 = {bound:.1f}")
            targets.append({"name": f"{rate}: {label}, lag <= {what} steps", "value": b["lag_steps_max"],
                            "pass": b["lag_steps_max"] is not None and b["lag_steps_max"] <= math.ceil(bound)})
            if b["lag_steps_max"] is not None:
                grew = b["lag_second_half_median"] - b["lag_first_half_median"]
                targets.append({"name": f"{rate}: {label}, lag not growing (2nd half median - 1st half)",
                                "value": grew, "pass": grew <= 1})
        for mode in modes:
            if mode != "none":
                targets.append({"name": f"{rate}: {LABELS[mode]}, peak RssAnon growth <= one shard",
                                "value": modes[mode]["rss_anon_growth_shards"],
                                "pass": modes[mode]["rss_anon_growth_shards"] <= 1})
        limit = 2 * cfg.keep + 1
        for mode in REPLICATING:
            if mode in modes:
                targets.append({"name": f"{rate}: {LABELS[mode]}, tmpfs per node <= {limit} checkpoints "
                                        f"(keep own + keep replicas + one in flight)",
                                "value": modes[mode]["tmpfs_peak_checkpoints"],
                                "pass": modes[mode]["tmpfs_peak_checkpoints"] <= limit})
    one = {(r["rate"], r["round"]): r for r in s["resumes"] if len(r["replaced"]) == 1}
    for r in s["resumes"]:
        targets.append({"name": f"{r['rate']}, round {r['round'] + 1}, node(s) {r['replaced']} replaced: "
                                f"resume >= {TARGET_RESUME_VS_RAW}x raw transfer",
                        "value": r["ratio"], "pass": r["ratio"] >= TARGET_RESUME_VS_RAW})
        if len(r["replaced"]) > 1:
            single = one[(r["rate"], r["round"])]
            r["vs_one_replaced"] = r["seconds"] / single["seconds"]
            targets.append({"name": f"{r['rate']}, round {r['round'] + 1}: {len(r['replaced'])} replaced at once "
                                    f"<= {TARGET_PARALLEL_RESUME}x one replaced",
                            "value": r["vs_one_replaced"], "pass": r["vs_one_replaced"] <= TARGET_PARALLEL_RESUME})
    return s


# ---------------------------------------------------------------------------------- report
def cpu_line(m: dict[str, Any], off: dict[str, Any]) -> str:
    """The rank process's CPU per step by thread, against replication off's whole process."""
    cpu = m["thread_cpu_per_step"]
    if not cpu:
        return "-"
    whole, off_whole = cpu.get("(process)", math.nan), off["thread_cpu_per_step"].get("(process)", math.nan)
    named = {name: seconds for name, seconds in cpu.items() if name != "(process)"}
    named["threads gone by the end"] = whole - sum(named.values())  # e.g. a finished connection's
    threads = ", ".join(f"{name} {seconds:.3f}" for name, seconds in named.items() if seconds >= 0.005)
    return f"{whole:.3f} (off {off_whole:.3f}): {threads}"


def cost_line(replicated: dict[str, float], bare: dict[str, float] | None) -> str:
    """CPU ms per replicated MB against a bare transfer's on the same link."""
    line = (f"CPU ms per replicated MB: {_opt(replicated['rank'], '.2f')} in a rank's process (its pushes "
            f"and its partner's), {_opt(replicated['host'], '.2f')} on the host")
    if bare is None:
        return line
    return line + (f"; a bare transfer ({bare['MBps']:.0f} MB/s): {bare['sender']:.2f} sending + "
                   f"{bare['receiver']:.2f} receiving = {bare['sender'] + bare['receiver']:.2f}, "
                   f"{bare['host']:.2f} on the host")


def _opt(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def print_dedup(modes: dict[str, dict[str, Any]]) -> None:
    """Per mode: bytes staged per rank and pushed per replicated step against the rank's
    state, and tmpfs per node by part at its peak."""
    for mode, m in modes.items():
        if mode == "none":
            continue
        state, parts = m["state_bytes"], m["tmpfs_peak_parts"] or {}
        staged, pushed = m["staged_bytes_median"], m["pushed_bytes_per_step"]
        print(f"  {LABELS[mode]}: state {size_str(state)}/rank; staged "
              f"{'-' if staged is None else size_str(staged)}/rank/step; pushed "
              f"{'-' if pushed is None else size_str(pushed)}/replicated step; tmpfs/node at peak "
              f"{size_str(sum(parts.values()))} = {sum(parts.values()) / state:.2f}x the state: "
              + ", ".join(f"{k} {size_str(v)}" for k, v in parts.items()))


def lag_series(launch: dict[str, Any]) -> str:
    """Rank 0's protection lag after each step of one launch, warm-up included (``.``: none)."""
    return " ".join("." if x["lag_steps"] is None else str(x["lag_steps"]) for x in launch["ranks"]["0"]["steps"])


def report(cfg: Config, res: dict[str, Any], s: dict[str, Any], meta: dict[str, Any]) -> None:
    first = res["launches"][0]["ranks"]["0"]
    sh, machine = first["shape"], meta["machine"]
    print(f"\nmlcheckpoint {machine['mlcheckpoint']} network benchmark: {cfg.nodes} emulated nodes x "
          f"{cfg.nproc} rank(s), {cfg.parallel.upper()} (gloo) transformer LM ({sh['layers']} blocks, "
          f"d_model {sh['d_model']}, {first['params'] / 1e6:.1f}M parameters) + AdamW,\n  state per rank "
          f"{size_str(first['state_bytes'])}, ckpt.guard + ckpt.async_save every step, batch {cfg.batch} x "
          f"{cfg.seq_len} tokens, 1 compute thread per rank")
    print(f"  {machine['cores']} cores, {machine['cpu']}, torch {machine['torch']}; load average "
          f"{meta['load_start']} at start, {meta['load_end']} at the end; took {meta['duration_s'] / 60:.1f} min")
    print(f"  {cfg.rounds} round(s) x {len(cfg.modes)} modes per rate, interleaved, each a fresh launch of "
          f"{cfg.steps} steps, the first {cfg.warmup} discarded" + (" [--quick]" if cfg.quick else ""))
    cal = first.get("calibration")
    print("  host: " + ("busy (the compute runs on the host's cores, beside replication)" if cfg.host == "busy"
                        else "idle (the collectives run; the compute is a wait, the same in every launch: "
                             + ("?" if not cal else
                                f"{cal['compute_s']:.3f} s forward+backward, {cal['optim_compute_s']:.3f} s optimizer, "
                                "as given" if cal.get("given") else
                                f"forward+backward {cal['fwd_bwd_s']:.3f} s less collectives "
                                f"{cal['collectives_s']:.3f} s = {cal['compute_s']:.3f} s, optimizer "
                                f"{cal['optim_compute_s']:.3f} s, calibrated by the first launch before its manager")
                             + ")"))
    for mode in REPLICATING:
        if mode in cfg.modes:
            launch = next(x for x in res["launches"] if x["mode"] == mode)
            print(f"  {LABELS[mode]}: {launch['ranks']['0'].get('pacing') or launch['ranks']['0']['budget']}")
    print(f"  command: {meta['command']}")
    head = (f"{'mode':<33}{'median s':>9}{'p90 s':>8}{'vs off':>8}{'vs none':>8}{'fwd+bwd':>8}{'CPU':>6}"
            f"{'node0 MB/step':>14}{'repl MB/step':>13}{'link busy':>10}{'idle used':>10}"
            f"{'lag med/max':>12}{'age s med/max':>14}{'skipped':>8}{'tmpfs/node':>11}{'RssAnon+':>10}")
    for rate, r in s["rates"].items():
        raws = [g for x in s["resumes"] if x["rate"] == rate for g in x["raw_gbit_s"]]
        print(f"\nlink {rate}" + (f" (raw TCP between the nodes: {', '.join(f'{g:.2f}' for g in raws)} Gbit/s)"
                                   if raws else ""))
        print(head)
        for mode, m in r["modes"].items():
            lag = "-" if m["lag_steps_max"] is None else f"{m['lag_steps_median']:g}/{m['lag_steps_max']}"
            age = "-" if m["age_s_max"] is None else f"{m['age_s_median']:.1f}/{m['age_s_max']:.1f}"
            skipped = "-" if mode in ("none", "off") else "/".join(str(x) for x in m["superseded"])
            tmpfs = "-" if mode == "none" else size_str(m["tmpfs_peak_bytes"])
            repl = "-" if mode not in REPLICATING else f"{m['replication_bytes_per_step'] / 1e6:.0f}"
            used = "-" if mode not in REPLICATING else f"{m['idle_share_used']:.0%}"
            vs_none = "-" if m["vs_none"] is None else f"{m['vs_none']:.2f}x"
            print(f"{LABELS[mode]:<33}{m['median_s']:>9.3f}{m['p90_s']:>8.3f}{m['vs_off']:>7.2f}x"
                  f"{vs_none:>8}{m['fwd_bwd_median_s']:>8.3f}{_opt(m.get('cpu_busy_median'), '.0%'):>6}"
                  f"{m['node0_bytes_per_step'] / 1e6:>14.0f}"
                  f"{repl:>13}{m['link_utilisation']:>10.0%}{used:>10}"
                  f"{lag:>12}{age:>14}{skipped:>8}{tmpfs:>11}{size_str(m['rss_anon_growth_bytes']):>10}")
        print_dedup(r["modes"])
        print("  per-launch medians (s): " + "; ".join(
            f"{mode} " + ", ".join(f"{x:.3f}" for x in m["round_medians_s"]) for mode, m in r["modes"].items()))
        off = r["modes"]["off"]
        print(f"  idle link with replication off: {off['idle_Bps'] / 1e6:.0f} MB/s of "
              f"{(parse_rate(rate) or 0) / 8e6:.0f} MB/s")
        for mode in REPLICATING:
            if mode not in r["modes"]:
                continue
            m = r["modes"][mode]
            extra = f"{m['vs_unbudgeted']:.2f}x unbudgeted's step time; " if "vs_unbudgeted" in m else ""
            rate_end = m.get("replication_rate_Bps")
            lo, hi = m["vs_off_interval"]
            slo, shi = m["settled_vs_off_interval"]
            print(f"  {LABELS[mode]}: step time vs off {m['vs_off']:.2f}x (95% interval {lo:.2f}-{hi:.2f}x); "
                  f"settled (second half of each launch) {m['settled_vs_off']:.2f}x ({slo:.2f}-{shi:.2f}x)")
            print(f"  {LABELS[mode]}: CPU s per step in a rank's process: " + cpu_line(m, r["modes"]["off"]))
            print(f"  {LABELS[mode]}: " + cost_line(m["cpu_per_replicated_mb"], r["link_cost"]))
            print(f"  {LABELS[mode]}: {extra}replication on the link {m['replication_link_Bps'] / 1e6:.0f} MB/s"
                  + ("" if rate_end is None or math.isnan(rate_end) else
                     f" (the budget's rate at the end {rate_end / 1e6:.0f} MB/s)") + "; "
                  f"lag first/second half median {_opt(m['lag_first_half_median'], 'g')}/"
                  f"{_opt(m['lag_second_half_median'], 'g')} steps; tmpfs peak "
                  f"{m['tmpfs_peak_checkpoints']:.1f} node checkpoints")
            for launch in res["launches"]:
                if launch["rate"] == rate and launch["mode"] == mode:
                    print(f"    lag per step, round {launch['round'] + 1}: {lag_series(launch)}")
            k = m["protected_every"]
            print("    " + ("no step newly protected in the second half of the measured steps" if k is None else
                             f"protects every {k:.3g}{'st' if k == 1 else 'th'} step") +
                  " (k: the second half of the measured steps, per time the newest protected step moved on)")
            prof = m["profile"]
            if prof:
                recv = (f"; receiver per replica: buffer {prof['receive_buffer_seconds']:.3f} s, receiving "
                        f"{prof['receive_seconds']:.3f} s, verifying {prof['verify_seconds']:.3f} s, committing "
                        f"{prof['commit_seconds']:.3f} s" if "receive_seconds" in prof else "")
                print(f"    profile of a push ({prof['pushes']} pushes, medians): {size_str(prof['push_bytes'])} in "
                      f"{prof['push_seconds']:.3f} s ({prof['push_bytes'] / max(prof['push_seconds'], 1e-9) / 1e6:.0f} MB/s): "
                      f"sendfile from tmpfs {_opt(prof['send_seconds'], '.3f')} s, held back by the budget "
                      f"{_opt(prof['budget_wait_seconds'], '.3f')} s" + recv)
    print("  median/p90: step time (forward, backward with the collectives, optimizer.step with the guard, "
          "async_save) of rank 0's measured steps, all rounds; node0 MB/step: node 0's eth0 tx per step; "
          "CPU: the host's CPUs busy during the steps (every node, and the kernel's network work); "
          "repl MB/step: node0 MB/step beyond replication off's; link busy: node0 MB/step / step time / link "
          "rate; idle used: replication's bytes per second on the link / the link capacity replication off "
          "leaves idle; lag: ckpt.protection().lag_steps after each step, age: its age_seconds; skipped: saves "
          "superseded per launch (rank 0); tmpfs/node: peak du of a node's local_dir; RssAnon+: peak "
          "growth of any rank from before its CheckpointManager")
    print("\nresume of replaced nodes over the link (ResumeInfo.seconds of the replaced ranks; raw: one TCP "
          "stream of the same bytes from the partner, right before and after)")
    print(f"{'link':<8}{'round':>6}{'replaced':>10}{'step':>6}{'fetched':>11}{'resume s':>10}{'raw s before/after':>20}"
          f"{'x raw':>7}{'(before/after)':>16}{'vs one':>8}{'launch s':>10}")
    for r in s["resumes"]:
        vs_one = f"{r['vs_one_replaced']:.2f}x" if "vs_one_replaced" in r else "-"
        print(f"{r['rate']:<8}{r['round'] + 1:>6}{','.join(map(str, r['replaced'])):>10}{_opt(r['step'], 'd'):>6}"
              f"{size_str(r['bytes']):>11}{r['seconds']:>10.2f}{r['raw_s'][0]:>11.2f}/{r['raw_s'][1]:<8.2f}"
              f"{r['ratio']:>6.2f}x{r['ratio_before']:>9.2f}/{r['ratio_after']:<6.2f}{vs_one:>8}{r['launch_s']:>10.1f}")
    print("  x raw: the raw transfer's time (at the mean of the two rates) / resume seconds; launch s: "
          "from starting the job to every rank's report (process start included)")
    print("\ntargets" + (" (--quick: a smoke run; at these sizes fixed costs dominate and the targets "
                          "say nothing)" if cfg.quick else ""))
    for t in s["targets"]:
        v = t["value"]
        shown = "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)
        print(f"  {'PASS' if t['pass'] else 'FAIL'}  {t['name']}: {shown}")


def command_line(argv: list[str]) -> str:
    py = os.environ.get("PYTHONPATH")
    env = f"PYTHONPATH={shlex.quote(py)} " if py else ""
    return f"cd {shlex.quote(REPO_ROOT)} && {env}{shlex.join([sys.executable, 'benchmarks/bench_network.py', *argv])}"


def run_all(cfg: Config, argv: list[str]) -> dict[str, Any]:
    """Every figure: the machine and run's circumstances, every launch and resume, the summary."""
    reason = available()
    if reason:
        raise SystemExit(f"bench_network needs an emulated network: {reason}")
    need = cfg.nodes * (2 * cfg.keep + 2) * 3 * cfg.params_mb * 1e6 * cfg.nproc
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    if free < need:
        raise SystemExit(f"/dev/shm has {size_str(free)} free; this run needs about {size_str(need)}")
    meta: dict[str, Any] = {"command": command_line(argv), "load_start": loadavg(),
                            "machine": machine_info("/dev/shm"),
                            "budget_supported": _budget_supported()}
    t0 = time.perf_counter()
    res = run(cfg)
    meta["duration_s"], meta["load_end"] = time.perf_counter() - t0, loadavg()
    return {"config": asdict(cfg), **meta, **res, "summary": summarize(cfg, res)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the report and return every figure (see --json)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_args(argv)
    return run_and_report(cfg, lambda cfg: run_all(cfg, argv),
                          lambda cfg, f: report(cfg, f, f["summary"], f), cfg.json_path)


if __name__ == "__main__":
    exit_on_sigterm()
    main()
