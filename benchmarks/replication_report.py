"""bench_replication.py's figures: the summary (medians, ratios, targets) and the printed report."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

import mlcheckpoint
from benchmarks.harness.report import QUICK_NOTE, verdict
from benchmarks.harness.stats import GB, GiB, gbps, median
from benchmarks.harness.workloads import SHARD_LARGE_COUNT

TARGET_TCP_VS_RAW = 0.9  # steady-state push >= 0.9x the raw single-stream socket
TARGET_TRAIN_THREAD_SHARE = 0.01  # training-thread replication time <= 1% of the save
TARGET_TRAIN_THREAD_ABS_S = 0.002  # ... or <= 2 ms, whichever is larger (tiny --quick saves)

PHASES = ("rx_buffer_s", "rx_recv_s", "rx_checksum_s", "rx_commit_s", "tx_payload_s", "retention_s",
          "tx_before_payload_s", "tx_after_payload_s")


def _phase_medians(pushes: list[dict]) -> dict[str, float | None]:
    """Median of each phase over the pushes; None where the phase was never measured."""
    out: dict[str, float | None] = {}
    for k in PHASES:
        values = [p[k] for p in pushes if p.get(k) is not None]
        out[k] = median(values) if values else None
    return out


def _steady(pushes: list[dict], cold: int = 3, or_after_first: bool = False) -> list[dict]:
    """Pushes into recycled receiver buffers; when recycling cannot be observed, all but the
    first ``cold`` (keep=2 retention recycles from about the third push on). With
    ``or_after_first``, a run too short to recycle counts every push after the first."""
    if any(p["recycled"] is None for p in pushes):
        return pushes[cold:] or pushes[-1:]
    recycled = [p for p in pushes if p["recycled"]]
    return recycled or (pushes[1:] if or_after_first else [])


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    n = res["shard_bytes"]
    raw = {k: median([r["s"] for r in v["reps"]]) for k, v in res["raw"].items()}
    s["raw_s"] = raw
    s["raw_gbps"] = {k: gbps(n, v) for k, v in raw.items()}
    s["raw_cpu_s"] = {k: median([r["cpu_s"] for r in v["reps"]]) for k, v in res["raw"].items()}
    s["raw_best"] = max(("sendall", "sendfile"), key=lambda k: s["raw_gbps"][k])
    ref = s["raw_gbps"][s["raw_best"]]
    pushes = res["tcp"]["pushes"]
    steady = _steady(pushes)
    fresh = [p for p in pushes[1:] if p["recycled"] is False]
    s["tcp_first_s"] = pushes[0]["s"]
    s["tcp_first_gbps"] = pushes[0]["gbps"]
    s["tcp_fresh_gbps"] = median([p["gbps"] for p in fresh]) if fresh else None
    s["tcp_steady_pushes"] = len(steady)
    s["tcp_steady_s"] = median([p["s"] for p in steady])
    s["tcp_steady_gbps"] = gbps(n, s["tcp_steady_s"])
    s["tcp_vs_raw"] = s["tcp_steady_gbps"] / ref
    s["tcp_vs_raw_sendfile"] = s["tcp_steady_gbps"] / s["raw_gbps"]["sendfile"]
    s["tcp_vs_raw_sendall"] = s["tcp_steady_gbps"] / s["raw_gbps"]["sendall"]
    s["tcp_first_vs_raw"] = s["tcp_first_gbps"] / ref
    s["tcp_vs_like_ours"] = s["tcp_steady_gbps"] / s["raw_gbps"]["like_ours"]
    # CPU seconds (sender + receiver process) per transfer: immune to waiting for a core
    s["tcp_steady_cpu_s"] = median([p["cpu_s"] for p in steady])
    s["tcp_steady_tx_cpu_s"] = median([p["tx_cpu_s"] for p in steady])
    s["tcp_steady_rx_cpu_s"] = median([p["rx_cpu_s"] for p in steady])
    s["tcp_cpu_vs_raw_sendfile"] = s["tcp_steady_cpu_s"] / s["raw_cpu_s"]["sendfile"]
    s["tcp_cpu_vs_like_ours"] = s["tcp_steady_cpu_s"] / s["raw_cpu_s"]["like_ours"]
    # per-round pairing (same moment on a noisy machine): push vs that round's raw sendfile
    sendfile_reps = res["raw"]["sendfile"]["reps"]
    s["tcp_vs_raw_sendfile_paired"] = median(
        [sendfile_reps[i]["s"] / p["s"] for i, p in enumerate(pushes) if p in steady and i < len(sendfile_reps)])
    s["tcp_steady_breakdown"] = _phase_medians(steady)
    s["tcp_first_breakdown"] = _phase_medians(pushes[:1])
    pg = res["pg"]
    if "pushes" in pg:
        pp = pg["pushes"]
        pst = _steady(pp, cold=1, or_after_first=True)
        s["pg_first_gbps"] = pp[0]["gbps"]
        s["pg_steady_gbps"] = gbps(n, median([p["s"] for p in pst]))
        s["pg_raw_gbps"] = {k: gbps(n, median([r["s"] for r in v])) for k, v in pg["raw"].items()}
        pg_ref_k = max(s["pg_raw_gbps"], key=lambda k: s["pg_raw_gbps"][k])
        s["pg_vs_raw"] = s["pg_steady_gbps"] / s["pg_raw_gbps"][pg_ref_k]
        s["pg_steady_breakdown"] = _phase_medians(pst)
    tr = res["training"]
    if "ranks" in tr:
        s.update(_summarize_training(tr))
    s["targets"] = _targets(s)
    return s


def _summarize_training(tr: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    w = tr["warmup_saves"]
    modes: dict[str, Any] = {}
    for mode in ("none", "tcp"):
        rows = [row for rk in tr["ranks"] for row in rk["modes"][mode][w:]]
        m = {k: median([row[k] for row in rows]) for k in
             ("blocking_s", "blocking_cpu_s", "save_s", "compute_s")}
        if mode == "tcp":
            reps = [row for row in rows if row.get("replication_s")]
            m["replication_s"] = median([row["replication_s"] for row in reps])
            m["replication_gbps"] = median([gbps(row["replication_bytes"], row["replication_s"])
                                            for row in reps])
            m["replicated_after_s"] = median([row["replicated_after_s"] for row in rows])
            m["all_replicated"] = all(row.get("replication_state") == "replicated"
                                      for rk in tr["ranks"] for row in rk["modes"][mode])
            m["all_protected"] = all(row.get("protected") for rk in tr["ranks"] for row in rk["modes"][mode])
        m["rows"] = len(rows)
        modes[mode] = m
    s["training"] = modes
    tcp, none = modes["tcp"], modes["none"]
    # What replication costs the training thread per checkpoint: how much longer async_save
    # holds it with replication on than off (the rest of replication runs on its own threads).
    none["train_thread_replication_s"] = 0.0
    tcp["train_thread_replication_s"] = max(0.0, tcp["blocking_s"] - none["blocking_s"])
    s["train_thread_s"] = tcp["train_thread_replication_s"]
    s["train_thread_vs_save"] = tcp["train_thread_replication_s"] / tcp["save_s"]
    s["blocking_delta_s"] = tcp["blocking_s"] - none["blocking_s"]
    s["blocking_cpu_delta_s"] = tcp["blocking_cpu_s"] - none["blocking_cpu_s"]
    s["compute_alone_s"] = median([rk["compute_alone_s"] for rk in tr["ranks"]])
    return s


def _targets(s: dict[str, Any]) -> list[dict[str, Any]]:
    targets = [{"name": f"TCP steady-state push >= {TARGET_TCP_VS_RAW}x raw socket ({s['raw_best']})",
                "value": s["tcp_vs_raw"], "shown": f"{s['tcp_vs_raw']:.2f}x",
                "pass": s["tcp_vs_raw"] >= TARGET_TCP_VS_RAW}]
    if "train_thread_s" in s:
        limit = max(TARGET_TRAIN_THREAD_SHARE * s["training"]["tcp"]["save_s"], TARGET_TRAIN_THREAD_ABS_S)
        targets.append({"name": f"training-thread time per replicated checkpoint <= "
                                f"{TARGET_TRAIN_THREAD_SHARE:.0%} of the save (or <= "
                                f"{TARGET_TRAIN_THREAD_ABS_S * 1e3:.0f} ms)",
                        "value": s["train_thread_s"], "limit": limit,
                        "shown": f"{s['train_thread_s'] * 1e3:.3f} ms = {s['train_thread_vs_save']:.3%} of "
                                 f"the save (limit {limit * 1e3:.2f} ms)",
                        "pass": s["train_thread_s"] <= limit and s["training"]["tcp"]["all_replicated"]})
    return targets


def _f(value: float | None, width: int, digits: int = 3) -> str:
    """A phase's seconds, or "n/a" where the library did not report it."""
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.1f} ms"


def push_table(pushes: list[dict], raw_sendfile: list[dict]) -> None:
    print("   seconds per push; 'before' = connect, handshake, offer, receiver's buffer, 'ready'; "
          "'after' = tail of the\n   receive, xxh3 of every item, commit, ack (rx: measured in the receiver; "
          "n/a: not measured)")
    print(f"   {'push':>4}{'buffer':>10}{'s':>8}{'GB/s':>7}{'before':>8}{'rx buffer':>10}{'tx send':>9}"
          f"{'rx recv':>9}{'after':>8}{'rx xxh3':>9}{'rx commit':>10}{'CPU tx+rx':>11}{'raw sendfile':>14}")
    for i, r in enumerate(pushes):
        raw_s = f"{raw_sendfile[i]['s']:.3f}" if i < len(raw_sendfile) else "-"
        kind = {True: "recycled", False: "fresh", None: "?"}[r["recycled"]]
        print(f"   {i:>4}{kind:>10}{r['s']:>8.3f}{r['gbps']:>7.2f}"
              f"{_f(r.get('tx_before_payload_s'), 8)}{_f(r.get('rx_buffer_s'), 10)}"
              f"{_f(r.get('tx_payload_s'), 9)}{_f(r.get('rx_recv_s'), 9)}{_f(r.get('tx_after_payload_s'), 8)}"
              f"{_f(r.get('rx_checksum_s'), 9)}{_f(r.get('rx_commit_s'), 10, 4)}{_f(r.get('cpu_s'), 11)}"
              f"{raw_s:>14}")


def report(res: dict[str, Any], s: dict[str, Any], cfg: Any) -> None:
    n = res["shard_bytes"]
    p = print
    p()
    p(f"mlcheckpoint {mlcheckpoint.__version__} replication benchmark: shard {n / GiB:.3f} GiB "
      f"({n / GB:.3f} GB: {res['state_dict']['tensors']} tensors, {SHARD_LARGE_COUNT} large, + 2 non-tensor "
      f"values), loopback, 2 processes")
    p(f"  {platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, torch "
      f"{torch.__version__}, {platform.platform()}")
    p(f"  load average at start {res['loadavg_start']}, at end {res['loadavg_end']}")

    p(f"\n1. raw single-stream loopback socket, {n / GB:.3f} GB per transfer, median of "
      f"{len(res['raw']['sendfile']['reps'])} (connect -> receiver's 16-byte ack)")
    p(f"   {'variant':<50}{'GB/s':>7}{'s':>8}{'best GB/s':>11}{'rx recv s':>11}{'rx hash s':>11}"
      f"{'CPU s tx+rx':>13}")
    for key, v in res["raw"].items():
        reps = v["reps"]
        p(f"   {v['label']:<50}{s['raw_gbps'][key]:>7.2f}{s['raw_s'][key]:>8.3f}"
          f"{max(r['gbps'] for r in reps):>11.2f}{median([r['rx_recv_s'] for r in reps]):>11.3f}"
          f"{median([r['rx_hash_s'] for r in reps]):>11.3f}{s['raw_cpu_s'][key]:>13.3f}")

    p("\n2. ours, TCP: TcpTransport.push_shard, shard committed locally -> replica verified, committed, acked")
    push_table(res["tcp"]["pushes"], res["raw"]["sendfile"]["reps"])
    p(f"   first push (cold receiver buffer): {s['tcp_first_gbps']:.2f} GB/s, {s['tcp_first_s']:.3f} s "
      f"= {s['tcp_first_vs_raw']:.2f}x raw")
    if s["tcp_fresh_gbps"] is not None:
        p(f"   pushes into fresh (new, unrecycled) buffers: median {s['tcp_fresh_gbps']:.2f} GB/s")
    p(f"   steady state (recycled receiver buffers, median of {s['tcp_steady_pushes']}): "
      f"{s['tcp_steady_gbps']:.2f} GB/s, {s['tcp_steady_s']:.3f} s")
    p(f"     = {s['tcp_vs_raw']:.2f}x the best raw ({s['raw_best']}); {s['tcp_vs_raw_sendfile']:.2f}x raw "
      f"sendfile, {s['tcp_vs_raw_sendall']:.2f}x raw sendall; paired with the same round's raw "
      f"sendfile: {s['tcp_vs_raw_sendfile_paired']:.2f}x; {s['tcp_vs_like_ours']:.2f}x the raw "
      f"transfer that does what ours does minus the protocol (\"as ours\" above)")
    b = s["tcp_steady_breakdown"]
    p(f"     medians: before the payload {_ms(b['tx_before_payload_s'])} (rx buffer "
      f"{_ms(b['rx_buffer_s'])}), send {_f(b['tx_payload_s'], 0)} s, rx recv {_f(b['rx_recv_s'], 0)} s, "
      f"after the payload {_ms(b['tx_after_payload_s'])} (rx xxh3 {_ms(b['rx_checksum_s'])} in all, "
      f"commit {_ms(b['rx_commit_s'])}); receiver's retention after the ack {_ms(b['retention_s'])}")
    p(f"     CPU (sender + receiver process) per steady push: {s['tcp_steady_cpu_s']:.3f} s (tx "
      f"{s['tcp_steady_tx_cpu_s']:.3f}, rx {s['tcp_steady_rx_cpu_s']:.3f}) = {s['tcp_cpu_vs_raw_sendfile']:.2f}x raw "
      f"sendfile's {s['raw_cpu_s']['sendfile']:.3f} s, {s['tcp_cpu_vs_like_ours']:.2f}x \"as ours\" "
      f"({s['raw_cpu_s']['like_ours']:.3f} s)")

    p("\n3. ours, process group (gloo): PgTransport.push_shard, same measure")
    if "pg_steady_gbps" in s:
        push_table(res["pg"]["pushes"], res["pg"]["raw"]["sendfile"])
        p(f"   first push {s['pg_first_gbps']:.2f} GB/s; steady state {s['pg_steady_gbps']:.2f} GB/s "
          f"= {s['pg_vs_raw']:.2f}x raw (raw in the same window: sendall "
          f"{s['pg_raw_gbps']['sendall']:.2f}, sendfile {s['pg_raw_gbps']['sendfile']:.2f} GB/s)")
    else:
        p(f"   skipped: {res['pg'].get('skipped')}")

    p("\n4. training-thread time per replicated checkpoint: 2 simulated nodes (1 rank each, gloo),")
    p(f"   CheckpointManager(keep={cfg.keep}).async_save of a {n / GiB:.3f} GiB shard per rank, then "
      f"{cfg.compute_s:.2f} s of simulated compute;")
    if "training" in s:
        _report_training(res, s)
    else:
        p(f"   skipped: {res['training'].get('skipped')}")

    p("\ntargets")
    if cfg.quick:
        p(QUICK_NOTE)
    for tg in s["targets"]:
        p(f"  {verdict(tg['pass'], cfg.quick)}  {tg['name']}: {tg['shown']}")
    p(f"  info  TCP first push (cold receiver buffer) vs raw socket: {s['tcp_first_vs_raw']:.2f}x; "
      f"CPU per steady push vs raw sendfile: {s['tcp_cpu_vs_raw_sendfile']:.2f}x (no target)")
    if "pg_vs_raw" in s:
        p(f"  info  pg/gloo steady-state push vs raw socket: {s['pg_vs_raw']:.2f}x (no target)")
    p(f"  (wall-clock ratios on a shared machine: load average {res['loadavg_start']} -> "
      f"{res['loadavg_end']} on {os.cpu_count()} cores; the CPU columns do not count waiting for a core)")


def _report_training(res: dict[str, Any], s: dict[str, Any]) -> None:
    p = print
    t = s["training"]
    p(f"   medians over both ranks, saves >= #{res['training']['warmup_saves']} ({t['tcp']['rows']} per mode)")
    p(f"   {'replication':<13}{'async_save blocks':>19}{'(thread CPU)':>14}{'save s':>9}"
      f"{'train-thread repl.':>20}{'push s':>9}{'push GB/s':>11}{'compute s':>11}")
    for mode in ("none", "tcp"):
        m = t[mode]
        push = f"{m['replication_s']:>9.3f}{m['replication_gbps']:>11.2f}" if mode == "tcp" else f"{'-':>9}{'-':>11}"
        p(f"   {mode:<13}{m['blocking_s']:>19.4f}{m['blocking_cpu_s']:>14.4f}{m['save_s']:>9.3f}"
          f"{m['train_thread_replication_s'] * 1e3:>17.3f} ms{push}{m['compute_s']:>11.3f}")
    p(f"   training-thread time per replicated checkpoint: {s['train_thread_s'] * 1e3:.3f} ms "
      f"= {s['train_thread_vs_save']:.4%} of the save ({t['tcp']['save_s']:.3f} s)")
    p(f"     (async_save's extra hold of the training thread with replication on; the difference: "
      f"async_save blocks {s['blocking_delta_s'] * 1e3:+.1f} ms wall, "
      f"{s['blocking_cpu_delta_s'] * 1e3:+.1f} ms thread CPU with replication on vs off)")
    p(f"   replication itself runs on background threads: push {t['tcp']['replication_s']:.3f} s per "
      f"shard (both nodes pushing at once), replicated {t['tcp']['replicated_after_s']:.3f} s after "
      f"async_save was called; every step replicated: {t['tcp']['all_replicated']}, protected: "
      f"{t['tcp']['all_protected']}")
    p(f"   simulated compute: {s['compute_alone_s']:.3f} s alone, {t['none']['compute_s']:.3f} s beside "
      f"a background save, {t['tcp']['compute_s']:.3f} s beside a save + replication "
      f"(CPU contention: 2 nodes share {os.cpu_count()} cores)")
