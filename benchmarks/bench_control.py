#!/usr/bin/env python
"""The replication control plane at scale: c10d store operations per round and per idle second,
rounds decided per node against per rank, and the store's latency to another client meanwhile.

Simulates ``--nodes`` x ``--ranks-per-node`` ranks (default 125 x 8 = 1,000) as threads of
this process, each with its own store client, speaking the real round protocol
(``mlcheckpoint/replication/schedule/rounds.py`` over ``Rendezvous``) to one real c10d TCPStore that a
helper process hosts (``mlcheckpoint.testing.control.SimulatedRanks``). Pushes take no time:
this is the control plane alone. Each rank's operations are counted by its store client
(``CountingStore``, under the library's ``Rendezvous``). The helper also probes the store from
a client of its own: a set and a get of its own key every ``--probe-ms``, each timed.

Two modes, one after the other in one run, the same ranks, keys, seals and counters:

- ``per-rank``: the protocol before rounds went per node (``PerRankRounds`` below): every rank
  looks for the next round in the store at each poll (0.1 s) and reports itself done there;
- ``per-node``: the library's ``Rounds``: each node's leader talks to the store, its other ranks
  follow a file in the node's job directory.

For each: ``--rounds`` rounds back to back (rank 0 names the next round once the last is all
done), then ``--idle-s`` seconds with no save.

    python benchmarks/bench_control.py                 # 125 x 8 ranks, about two minutes here
    python benchmarks/bench_control.py --quick         # 4 x 4 ranks, a few seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import torch.distributed as dist

from benchmarks.harness.processes import Helpers, make_workspace, start_parent_watchdog
from benchmarks.harness.report import loadavg, progress, run_and_report
from benchmarks.harness.stats import median, proc_cpu
from mlcheckpoint.replication.core.keys import Seal
from mlcheckpoint.replication.core.rendezvous import Rendezvous
from mlcheckpoint.replication.schedule.rounds import Round, Rounds
from mlcheckpoint.replication.tcp import protocol as p
from mlcheckpoint.store.layout import JobPaths
from mlcheckpoint.testing.control import SimulatedRanks
from mlcheckpoint.topology import Topology

MODES = ("per-rank", "per-node")
WAIT_S = 300.0  # bound on any one wait of the run (a hang, not a figure)


@dataclass(frozen=True)
class Config:
    nodes: int = 125
    ranks_per_node: int = 8
    rounds: int = 20
    idle_s: float = 10.0
    settle_s: float = 3.0  # after the last round, before the idle window (leaders' looks slow down)
    baseline_s: float = 3.0  # the store's latency with no rank connected
    poll: float = 0.1  # the replicator's poll (Timeouts.replicator_poll)
    probe_ms: float = 5.0
    modes: tuple[str, ...] = MODES
    json_path: str | None = None


class PerRankRounds:
    """Rounds as they were before the control plane went per node (git history of
    ``replication/schedule/rounds.py``): every rank looks for round g + 1 in the store at each poll,
    counts its own pushed shard, and reports itself done; the last rank marks the round all
    done, which rank 0 looks for before naming the next."""

    def __init__(self, rdzv: Rendezvous, topology: Topology, paths: JobPaths):
        self.rdzv, self.world_size = rdzv, topology.world_size
        self._seal = Seal(rdzv.secret(), rdzv.session, rdzv.prefix)
        self.finished = 0

    def next(self) -> Round | None:
        key = self.rdzv.counter("round", self.finished + 1)
        store = self.rdzv.store
        if not store.check([key]):
            return None
        msg = self._seal.open(key, store.get(key))
        if not isinstance(msg.get("step"), int) or not isinstance(msg.get("save_id"), str):
            raise p.ProtocolError(f"replication round {self.finished + 1} is malformed: {msg}")
        return Round(self.finished + 1, msg["step"], msg["save_id"])

    def finish(self, r: Round, counted: bool) -> None:
        if counted:
            self.rdzv.add(self.rdzv.counter("shards", r.step, r.save_id), 1)
        if self.rdzv.add(self.rdzv.counter("round-done", r.number), 1) >= self.world_size:
            self.rdzv.store.set(self.rdzv.counter("round-all-done", r.number), "1")
        self.finished = r.number

    def all_done(self, number: int) -> bool:
        return number == 0 or bool(self.rdzv.store.check([self.rdzv.counter("round-all-done", number)]))

    def propose(self, number: int, step: int, save_id: str) -> Round:
        key = self.rdzv.counter("round", number)
        self.rdzv.store.set(key, self._seal.seal(key, {"step": step, "save_id": save_id}))
        return Round(number, step, save_id)

    def wait_s(self, poll: float) -> float:
        return poll

    def hurry(self) -> None:
        pass


# ------------------------------------------------------------------ the store's host
def host_store(root: str, probe_ms: float) -> None:
    """The helper process: host the TCPStore, probe it until ``<root>/stop`` exists, then write
    every probe (monotonic start, set seconds, get seconds) to ``<root>/probe.json``."""
    start_parent_watchdog(root)
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    with open(os.path.join(root, "port.tmp"), "w") as f:
        f.write(str(server.port))
    os.replace(os.path.join(root, "port.tmp"), os.path.join(root, "port"))
    samples = []
    stop = os.path.join(root, "stop")
    while not os.path.exists(stop):
        t0 = time.monotonic()
        client.set("bench/probe", "x")
        t1 = time.monotonic()
        client.get("bench/probe")
        samples.append((t0, t1 - t0, time.monotonic() - t1))
        time.sleep(probe_ms / 1000)
    with open(os.path.join(root, "probe.tmp"), "w") as f:
        json.dump(samples, f)
    os.replace(os.path.join(root, "probe.tmp"), os.path.join(root, "probe.json"))


def _wait_file(path: str, helpers: Helpers) -> None:
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        helpers.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT_S:.0f} s")
        time.sleep(0.02)


# ------------------------------------------------------------------ one mode
def _by_role(sim: SimulatedRanks) -> dict[str, int]:
    return {"all": sim.ops(), "leaders": sim.ops(sim.leaders()),
            "others": sim.ops(sim.followers()), "rank 0": sim.ops([0])}


def _delta(a: dict[str, int], b: dict[str, int], per: float) -> dict[str, float]:
    return {k: (b[k] - a[k]) / per for k in a}


def run_mode(cfg: Config, mode: str, store: dist.Store, root: str,
             windows: dict[str, tuple[float, float]]) -> dict:
    """Rounds back to back, then an idle window; the store operations of each, by role."""
    sim = SimulatedRanks(store, os.path.join(root, mode), cfg.nodes, cfg.ranks_per_node,
                         secret=os.urandom(32), job_id=f"bench-{mode}", poll=cfg.poll,
                         make_rounds=PerRankRounds if mode == "per-rank" else Rounds)
    t_start = time.monotonic()
    sim.start()
    try:
        def named(k: int) -> None:
            sim.save(k)
            if not sim.proposed[k].wait(WAIT_S) or sim.errors:
                raise RuntimeError(f"{mode}: round {k} was not named: {sim.errors[:1]}")

        named(1)  # warm-up: every client connected, the first round done
        named(2)
        warm_up_s = time.monotonic() - t_start
        progress(f"{mode}: warm-up (store connections, one round) {warm_up_s:.1f} s")
        ops0, t0, cpu0 = _by_role(sim), time.monotonic(), proc_cpu()
        round_s = []
        for k in range(3, cfg.rounds + 3):  # round k named = round k - 1 done everywhere
            t = time.monotonic()
            named(k)
            round_s.append(time.monotonic() - t)
        t1, ops1, cpu1 = time.monotonic(), _by_role(sim), proc_cpu()
        windows[f"{mode}: rounds"] = (t0, t1)
        progress(f"{mode}: {cfg.rounds} rounds in {t1 - t0:.1f} s")
        time.sleep(cfg.settle_s)
        ops2, t2, cpu2 = _by_role(sim), time.monotonic(), proc_cpu()
        time.sleep(cfg.idle_s)
        t3, ops3, cpu3 = time.monotonic(), _by_role(sim), proc_cpu()
        windows[f"{mode}: idle"] = (t2, t3)
        if sim.errors:
            raise RuntimeError(f"{mode}: a simulated rank failed: {sim.errors[0]!r}")
        return {"ranks": sim.world, "nodes": cfg.nodes,
                "ops_per_round": _delta(ops0, ops1, cfg.rounds),
                "ops_per_idle_s": _delta(ops2, ops3, t3 - t2),
                "round_s_median": median(round_s), "rounds_s": t1 - t0, "warm_up_s": warm_up_s,
                # cores the simulating process kept busy (all its ranks together)
                "cpu_rounds": (cpu1 - cpu0) / (t1 - t0), "cpu_idle": (cpu3 - cpu2) / (t3 - t2)}
    finally:
        sim.close()


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def latency(samples: list, windows: dict[str, tuple[float, float]]) -> dict[str, dict]:
    """p50 and p99 of the probe's set and get in each window, in milliseconds."""
    out = {}
    for name, (a, b) in windows.items():
        sets = [s * 1e3 for t, s, _ in samples if a <= t < b]
        gets = [g * 1e3 for t, _, g in samples if a <= t < b]
        out[name] = {"n": len(sets), "set_p50_ms": _percentile(sets, 0.5),
                     "set_p99_ms": _percentile(sets, 0.99), "get_p50_ms": _percentile(gets, 0.5),
                     "get_p99_ms": _percentile(gets, 0.99)}
    return out


def run(cfg: Config) -> dict:
    # c10d looks up the host name of a client socket it logs about; where the resolver does not
    # answer (a sandbox), each such lookup waits the resolver's timeout (5 s by default) and
    # starting a thousand clients would take minutes. One second, one attempt, here.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    root = make_workspace("mlckpt-bench-control-")
    helpers = Helpers(root)
    threading.stack_size(512 << 10)  # a thousand simulated ranks: small stacks
    try:
        helpers.spawn([sys.executable, os.path.abspath(__file__), "--host-store", root,
                       "--probe-ms", str(cfg.probe_ms)], "store")
        _wait_file(os.path.join(root, "port"), helpers)
        with open(os.path.join(root, "port")) as f:
            store = dist.TCPStore("127.0.0.1", int(f.read()), is_master=False)
        windows: dict[str, tuple[float, float]] = {}
        t = time.monotonic()
        time.sleep(cfg.baseline_s)
        windows["no ranks"] = (t, time.monotonic())
        modes = {mode: run_mode(cfg, mode, store, root, windows) for mode in cfg.modes}
        with open(os.path.join(root, "stop"), "w"):
            pass
        _wait_file(os.path.join(root, "probe.json"), helpers)
        with open(os.path.join(root, "probe.json")) as f:
            samples = json.load(f)
        return {"config": {"nodes": cfg.nodes, "ranks_per_node": cfg.ranks_per_node,
                           "rounds": cfg.rounds, "idle_s": cfg.idle_s, "poll_s": cfg.poll},
                "modes": modes, "latency": latency(samples, windows), "load": loadavg()}
    finally:
        threading.stack_size(0)
        helpers.close()
        shutil.rmtree(root, ignore_errors=True)


def report(cfg: Config, figures: dict) -> None:
    modes = figures["modes"]
    ranks = cfg.nodes * cfg.ranks_per_node
    print(f"control plane: {ranks:,} simulated ranks ({cfg.nodes} nodes x {cfg.ranks_per_node}), "
          f"one TCPStore, poll {cfg.poll} s, load {figures['load']}")
    names = [m for m in MODES if m in modes]
    head = "".join(f"{m:>12s}" for m in names)
    ratio = len(names) == 2
    print(f"\nc10d store operations{'':19s}{head}{'  per-node / per-rank' if ratio else ''}")
    rows = [("per round, all ranks", "ops_per_round", "all"),
            ("per round, node leaders", "ops_per_round", "leaders"),
            ("per round, other ranks", "ops_per_round", "others"),
            ("per idle second, all ranks", "ops_per_idle_s", "all"),
            ("per idle second, node leaders", "ops_per_idle_s", "leaders"),
            ("per idle second, other ranks", "ops_per_idle_s", "others")]
    for label, key, role in rows:
        vals = [modes[m][key][role] for m in names]
        line = f"  {label:38s}" + "".join(f"{v:12,.1f}" for v in vals)
        if ratio and vals[0]:
            line += f"  {vals[1] / vals[0]:8.3f}x"
        print(line)
    print("  per round, per node" + " " * 20 + "".join(
        f"{modes[m]['ops_per_round']['all'] / cfg.nodes:12,.1f}" for m in names))
    print("  round, median seconds" + " " * 18 + "".join(f"{modes[m]['round_s_median']:12.2f}" for m in names))
    print("  cores busy simulating, rounds" + " " * 10 + "".join(f"{modes[m]['cpu_rounds']:12.2f}" for m in names))
    print("  cores busy simulating, idle" + " " * 12 + "".join(f"{modes[m]['cpu_idle']:12.2f}" for m in names))
    print(f"\nthe store's latency to another client (ms; a set and a get every {cfg.probe_ms:g} ms)")
    print(f"  {'while':22s} {'probes':>7s} {'set p50':>8s} {'set p99':>8s} {'get p50':>8s} {'get p99':>8s}")
    for name, lat in figures["latency"].items():
        print(f"  {name:22s} {lat['n']:7d} {lat['set_p50_ms']:8.3f} {lat['set_p99_ms']:8.3f} "
              f"{lat['get_p50_ms']:8.3f} {lat['get_p99_ms']:8.3f}")


def parse_args(argv: list[str] | None) -> Config:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=None, help="simulated nodes (default 125; 4 with --quick)")
    ap.add_argument("--ranks-per-node", type=int, default=None, help="default 8; 4 with --quick")
    ap.add_argument("--rounds", type=int, default=None, help="rounds timed per mode (default 20; 3 with --quick)")
    ap.add_argument("--idle-s", type=float, default=None, help="idle window (default 10; 2 with --quick)")
    ap.add_argument("--poll", type=float, default=0.1, help="the replicator's poll, seconds")
    ap.add_argument("--probe-ms", type=float, default=5.0)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    q = a.quick
    return Config(nodes=a.nodes or (4 if q else 125), ranks_per_node=a.ranks_per_node or (4 if q else 8),
                  rounds=a.rounds or (3 if q else 20), idle_s=a.idle_s or (2.0 if q else 10.0),
                  settle_s=2.0 if q else 3.0, baseline_s=1.0 if q else 3.0, poll=a.poll,
                  probe_ms=a.probe_ms, modes=tuple(a.modes), json_path=a.json_path)


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv)
    return run_and_report(cfg, run, report, cfg.json_path)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--host-store":
        host_store(sys.argv[2], float(sys.argv[4]) if len(sys.argv) > 4 else 5.0)
    else:
        main()
