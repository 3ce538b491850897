#!/usr/bin/env python
"""Replication's pacing against a training job's collectives, on an emulated link, without
the model (issue 28, item 3): how much of the link training leaves idle replication takes,
and what it costs the collectives.

Two emulated nodes (``mlcheckpoint.testing.netcluster``, tbf links at each of ``--rates``). A
stand-in for the collectives (benchmarks/pacing_peer.py ``exchange``): every ``--gap-ms`` both
nodes send each other the bytes of ``--exchange-ms`` of the link at once, as a two-rank ring
all-reduce does. Beside it, node 0 replicates to node 1 without end (``paced``: the library's
Budget.sendfile with the default budget, as a push does). Interleaved rounds of three modes:

* none      the exchanges alone
* fixed     with replication paced as by default (as before issue 28; 5% of
            the assumed 10 Gbit/s, a tenth of it while a queue lasts)
* adaptive  with replication paced by the delay-based controller (MLCHECKPOINT_ADAPTIVE_PACING=1)

Per rate and mode: the exchanges' median and p90 seconds (and against none), replication's
bytes per second, node 0's bytes on its link per second, and the share of the link capacity
the exchanges leave idle (link rate - their bytes per second in "none") that replication took.
Little CPU is involved, so the figures hold on a busy machine better than bench_network's.

    python benchmarks/bench_pacing.py                      # 1gbit and 5gbit, 2 rounds of 8 s
    python benchmarks/bench_pacing.py --rates 1gbit --gap-ms 50 --json out.json

Needs root and iproute2. Everything is removed at the end, on error and on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.harness.processes import exit_on_sigterm
from benchmarks.harness.report import loadavg, progress
from benchmarks.harness.stats import median, p90
from mlcheckpoint.testing import netcluster
from mlcheckpoint.testing.netcluster import NetCluster, parse_rate

PEER = os.path.join(REPO_ROOT, "benchmarks", "pacing_peer.py")
MODES = ("none", "fixed", "adaptive")
TARGET_IDLE_SHARE = 0.6
TARGET_EXCHANGE_VS_NONE = 1.02


def one(c: NetCluster, mode: str, a: argparse.Namespace, link_Bps: float) -> dict[str, Any]:
    """The exchanges for ``a.seconds``, with replication paced as ``mode`` says beside them."""
    py, env = sys.executable, {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)}
    pipe: dict[str, Any] = {"stdout": subprocess.PIPE, "text": True, "env": env}
    server = c.run_in(1, [py, PEER, "serve", c.address(1)], **pipe)
    assert server.stdout is not None
    port = server.stdout.readline().split()[1]
    sender = None
    if mode != "none":
        sink = c.run_in(1, [py, "-I", netcluster._PEER, "recv", c.address(1)], **pipe)
        assert sink.stdout is not None
        sink_port = sink.stdout.readline().split()[1]
        sender = c.run_in(0, [py, PEER, "paced", c.address(1), sink_port, str(a.seconds + 1), mode], **pipe)
        assert sender.stdout is not None
        if sender.stdout.readline().strip() != "ready":
            raise RuntimeError(f"paced sender did not start; logs:\n{c.logs()}")
    nbytes = int(link_Bps * a.exchange_ms / 1000)
    before = c.link_bytes()[0]["sent"]
    client = c.run_in(0, [py, PEER, "exchange", c.address(1), port, str(nbytes), str(a.gap_ms / 1000),
                          str(a.seconds)], **pipe)
    took = json.loads(client.communicate(timeout=a.seconds + 120)[0])[1:]  # the first: slow start
    sent = c.link_bytes()[0]["sent"] - before
    paced = json.loads(sender.communicate(timeout=120)[0]) if sender is not None else {}
    server.kill()
    server.wait()
    return {"mode": mode, "exchange_bytes": nbytes, "exchange_s": took, "link_Bps": sent / a.seconds,
            "replication_Bps": paced.get("bytes_per_s", 0.0), "yields": paced.get("yields")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", nargs="+", default=["1gbit", "5gbit"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=8.0, help="per launch (default 8)")
    p.add_argument("--exchange-ms", type=float, default=65.0,
                   help="each exchange: this many ms of the link's bytes, each way (default 65)")
    p.add_argument("--gap-ms", type=float, default=100.0, help="between exchanges (default 100)")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    reason = netcluster.available()
    if reason:
        raise SystemExit(f"bench_pacing needs an emulated network: {reason}")
    runs: list[dict[str, Any]] = []
    load_start = loadavg()
    with NetCluster(nodes=2, rate=a.rates[0]) as c:
        for rnd in range(a.rounds):
            for rate in a.rates:
                c.set_rate(rate)
                link_Bps = (parse_rate(rate) or 0) / 8
                for mode in MODES[rnd % 3:] + MODES[:rnd % 3]:
                    r = {"rate": rate, "round": rnd, **one(c, mode, a, link_Bps)}
                    runs.append(r)
                    progress(f"round {rnd + 1}, {rate}, {mode}: exchange {median(r['exchange_s']) * 1e3:.1f} ms, "
                             f"replication {r['replication_Bps'] / 1e6:.1f} MB/s")
    summary = summarize(a, runs)
    print(f"\nbench_pacing: exchanges of {a.exchange_ms:g} ms of the link each way every {a.gap_ms:g} ms, "
          f"{a.rounds} round(s) of {a.seconds:g} s per mode; load average {load_start} at start, {loadavg()} at the end")
    print(f"{'link':<7}{'mode':<10}{'exchange ms med/p90':>20}{'vs none':>9}{'repl MB/s':>10}"
          f"{'link MB/s':>10}{'idle MB/s':>10}{'idle used':>10}")
    for row in summary["rows"]:
        print(f"{row['rate']:<7}{row['mode']:<10}{row['median_ms']:>11.1f}/{row['p90_ms']:<8.1f}"
              f"{row['vs_none']:>8.3f}x{row['replication_Bps'] / 1e6:>10.1f}{row['link_Bps'] / 1e6:>10.1f}"
              f"{row['idle_Bps'] / 1e6:>10.1f}{row['idle_used']:>10.0%}")
    print("targets")
    for t in summary["targets"]:
        print(f"  {'PASS' if t['pass'] else 'FAIL'}  {t['name']}: {t['value']:.3f}")
    figures = {"args": vars(a), "load_start": load_start, "load_end": loadavg(), "runs": runs, "summary": summary}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
    return figures


def summarize(a: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    rows, targets = [], []
    for rate in a.rates:
        link_Bps = (parse_rate(rate) or 0) / 8
        of = {m: [r for r in runs if r["rate"] == rate and r["mode"] == m] for m in MODES}
        took = {m: [x for r in of[m] for x in r["exchange_s"]] for m in MODES}
        none_link = median([r["link_Bps"] for r in of["none"]])
        idle = link_Bps - none_link
        for m in MODES:
            repl = median([r["replication_Bps"] for r in of[m]])
            row = {"rate": rate, "mode": m, "median_ms": median(took[m]) * 1e3, "p90_ms": p90(took[m]) * 1e3,
                   "vs_none": median(took[m]) / median(took["none"]), "replication_Bps": repl,
                   "link_Bps": median([r["link_Bps"] for r in of[m]]), "idle_Bps": idle, "idle_used": repl / idle}
            rows.append(row)
            if m != "none":
                targets.append({"name": f"{rate}, {m}: exchange median <= {TARGET_EXCHANGE_VS_NONE}x none",
                                "value": row["vs_none"], "pass": row["vs_none"] <= TARGET_EXCHANGE_VS_NONE})
                targets.append({"name": f"{rate}, {m}: share of the idle link used >= {TARGET_IDLE_SHARE:.0%}",
                                "value": row["idle_used"], "pass": row["idle_used"] >= TARGET_IDLE_SHARE})
    return {"rows": rows, "targets": targets}


if __name__ == "__main__":
    exit_on_sigterm()
    main()
