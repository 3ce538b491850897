#!/usr/bin/env python
"""Replication benchmark: how fast a committed shard reaches a partner, and what it costs training.

One run measures, for a shard of ~1 GiB (a state dict of a few large tensors, a few dozen small
ones and two non-tensor values), between two processes on this machine (loopback):

1. the limit: a raw single-stream socket transfer of the same number of bytes, the sender using
   ``socket.sendall`` of an in-memory buffer or ``socket.sendfile`` from a tmpfs file, the
   receiver ``recv_into`` a preallocated, touched buffer; plus diagnostic variants that add an
   xxh3 pass after the receive, an xxh3 fused into the receive loop, or receive into a warm
   tmpfs mapping (what our receiver writes into);
2. ours over TCP: ``TcpTransport.push_shard`` from "shard committed locally" to "replica
   verified, committed and acknowledged", first push (cold receiver buffers) and steady state
   (the receiver applies retention after each receipt, so its buffers are recycled);
3. ours over a gloo process group: ``PgTransport.push_shard``, same measure;
4. the training-thread time per replicated checkpoint: two simulated nodes (one process each,
   a gloo process group, ``CheckpointManager(replication="tcp")`` against ``"none"``), the time
   ``async_save`` holds the caller, the time the training thread spends in replication code,
   against the save itself.

Raw and ours run interleaved, round by round, so the noise of a shared machine hits both alike.

    python benchmarks/bench_replication.py               # ~1 GiB shard
    python benchmarks/bench_replication.py --quick       # 64 MiB smoke run
    python benchmarks/bench_replication.py --size-gb 2 --json out.json

``main(argv)`` runs the same thing and returns every figure as a dict. Everything the benchmark
writes lives in one directory under /dev/shm; it, the helper processes and their ports are
removed at the end, also on error or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from a checkout: import the package from it
    sys.path.insert(0, REPO_ROOT)

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from benchmarks.harness.baselines import (
    HASH_AFTER,
    HASH_FUSED,
    TIMEOUTS,
    TO_SHM,
    RawReceiver,
    RawSender,
)
from benchmarks.harness.processes import Helpers, start_parent_watchdog
from benchmarks.harness.report import loadavg, progress, run_and_report
from benchmarks.harness.stats import GiB, gbps, median, proc_cpu
from benchmarks.harness.workloads import (
    StateDict,
    build_tensors,
    shard_layout,
    state_dict_bytes,
)
from benchmarks.replication_report import report, summarize
from mlcheckpoint import MemoryStorageWriter
from mlcheckpoint.manager.retention import apply_retention
from mlcheckpoint.replication import ReceiveSink, Rendezvous, ReplicaReceived, Transport
from mlcheckpoint.replication.factory import make_transport
from mlcheckpoint.settings import ReplicationOptions
from mlcheckpoint.store import LocalStore
from mlcheckpoint.waiting import deadline_in, wait_until

THIS_FILE = os.path.abspath(__file__)
SECRET_ENV = "MLCHECKPOINT_REPLICATION_SECRET"  # how the helpers get this run's secret

RAW_VARIANTS = [  # key, label, sender, receiver flags
    ("sendall", "sendall(memoryview) -> recv_into anon", "sendall", 0),
    ("sendfile", "sendfile(tmpfs file) -> recv_into anon", "sendfile", 0),
    ("shm_dest", "diag: sendfile -> recv_into warm tmpfs mmap", "sendfile", TO_SHM),
    ("hash_after", "diag: sendfile -> recv_into, then xxh3 pass", "sendfile", HASH_AFTER),
    ("hash_fused", "diag: sendfile -> recv_into + xxh3 per recv", "sendfile", HASH_FUSED),
    # ours minus the protocol: sockets with timeouts (non-blocking fds + poll), tmpfs
    # destination, one xxh3 pass after the receive
    ("like_ours", "diag: as ours (timeouts, tmpfs mmap, xxh3 after)", "sendfile",
     TIMEOUTS | TO_SHM | HASH_AFTER),
]


# ---------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Config:
    size_bytes: int
    rounds: int  # interleaved rounds of raw transfers + one TCP push
    pg_rounds: int  # rounds of raw sendfile + one pg push (0: skip)
    saves: int  # saves per mode in the training-thread measurement (0: skip)
    keep: int  # CheckpointManager(keep=) in the training-thread measurement
    receiver_keep: int  # retention the TCP/pg receiver applies after each receipt
    compute_s: float  # simulated training compute between saves
    timeout_s: float
    streams: int | None  # TCP streams per push (None: the transport's default)
    shm_dir: str
    quick: bool
    json_path: str | None


def parse_args(argv: list[str] | None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=None,
                   help="shard size in GiB (default 1.0; 0.0625 with --quick)")
    p.add_argument("--rounds", type=int, default=None,
                   help="TCP pushes, each with one raw transfer of every variant around it "
                        "(default 10; 5 with --quick); the first 3 are cold")
    p.add_argument("--pg-rounds", type=int, default=None,
                   help="pg/gloo pushes (default 6; 4 with --quick; 0 skips)")
    p.add_argument("--saves", type=int, default=None,
                   help="async saves per mode for the training-thread measurement "
                        "(default 7; 5 with --quick; 0 skips)")
    p.add_argument("--keep", type=int, default=1,
                   help="CheckpointManager keep= in the 2-node run (default 1: two nodes on one "
                        "machine hold 2x everything; the newest protected step is kept anyway)")
    p.add_argument("--compute-s", type=float, default=None,
                   help="simulated training compute after each async_save (default 0.5 s; 0.1 with "
                        "--quick)")
    p.add_argument("--streams", type=int, default=None,
                   help="TCP streams per push (default: the transport's, $MLCHECKPOINT_TCP_STREAMS or 4)")
    p.add_argument("--no-pg", action="store_true", help="skip the process-group transport")
    p.add_argument("--no-train", action="store_true", help="skip the 2-node training-thread run")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds any helper process may take (default 600)")
    p.add_argument("--json", metavar="PATH", help="also write every figure to PATH as JSON")
    p.add_argument("--quick", action="store_true", help="small shard, few repetitions")
    p.add_argument("--shm-dir", default="/dev/shm", help="tmpfs to work in (default /dev/shm)")
    a = p.parse_args(argv)
    size_gb = a.size_gb if a.size_gb is not None else (0.0625 if a.quick else 1.0)
    if size_gb < 0.005:
        p.error("--size-gb must be at least 0.005")
    rounds = a.rounds if a.rounds is not None else (5 if a.quick else 10)
    if rounds < 4:
        p.error("--rounds must be at least 4 (the first 3 pushes fill the receiver's buffers)")
    pg_rounds = 0 if a.no_pg else (a.pg_rounds if a.pg_rounds is not None else (4 if a.quick else 6))
    saves = 0 if a.no_train else (a.saves if a.saves is not None else (5 if a.quick else 7))
    if saves and saves < a.keep + 3:
        p.error(f"--saves must be at least keep+3 = {a.keep + 3} (the first keep+1 are cold)")
    if a.keep < 1:
        p.error("--keep must be >= 1")
    compute_s = a.compute_s if a.compute_s is not None else (0.1 if a.quick else 0.5)
    return Config(size_bytes=int(size_gb * GiB), rounds=rounds, pg_rounds=pg_rounds, saves=saves,
                  keep=a.keep, receiver_keep=2, compute_s=compute_s, timeout_s=a.timeout,
                  streams=a.streams,
                  shm_dir=a.shm_dir, quick=a.quick, json_path=a.json)




# ---------------------------------------------------------------------------------- state dict
def build_state_dict(size_bytes: int, prefix: str = "", seed: int = 0) -> StateDict:
    """{"model": {a few large matrices, ~48 small tensors}, "step": int, "name": str}.

    ``prefix`` names the tensors per rank so that, saved from several ranks, every rank's
    shard holds its own bytes (DCP writes a replicated tensor from one rank only).
    """
    model = build_tensors(shard_layout(size_bytes, prefix, seed), seed, pool_elems=1 << 22)
    return {"model": model, "step": 0, "name": f"bench-replication{prefix}"}


# ---------------------------------------------------------------------------------- helpers
def connect_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def store_wait_json(store: dist.Store, key: str, timeout: float) -> Any:
    store.wait([key], timedelta(seconds=timeout))
    return json.loads(store.get(key))


def run_secret() -> bytes:
    """The replication secret of this run: made by the benchmark, handed to its helpers in the
    environment (never through the c10d store)."""
    return bytes.fromhex(os.environ[SECRET_ENV])


# ---------------------------------------------------------------------------------- peer process
def peer_main(cfg: dict) -> None:
    """Rank 1 of the transfer benchmarks: raw receiver, then TCP receiver, then pg receiver."""
    start_parent_watchdog(cfg["root"])
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", cfg["store_port"], cfg["timeout"])
    my_dir = os.path.join(cfg["root"], "peer")
    os.makedirs(my_dir, exist_ok=True)
    raw = RawReceiver(os.path.join(my_dir, "raw-dest.bin"))
    store.set("peer/raw_port", str(raw.port))
    keep = cfg["receiver_keep"]
    # A c10d client must not be shared between threads (this one blocks in wait() below): the
    # transports' receiving threads report through a client of their own.
    report_store, report_lock = connect_store("127.0.0.1", cfg["store_port"], cfg["timeout"]), threading.Lock()
    try:
        for kind in ("tcp", "pg"):
            if store_wait_json(store, f"peer/{kind}/go", cfg["timeout"]) is False:
                continue
            job = cfg[f"{kind}_job"]
            lstore = LocalStore(os.path.join(my_dir, kind), job)
            rdzv = Rendezvous(store, job, 1, 2, secret=run_secret())
            if kind == "pg":
                dist.init_process_group("gloo", store=dist.PrefixStore("bench-pg/", store), rank=1,
                                        world_size=2, timeout=timedelta(seconds=cfg["timeout"]))

            sink = ReceiveSink(lstore)

            def on_received(event: ReplicaReceived, lstore: LocalStore = lstore, kind: str = kind,
                            sink: ReceiveSink = sink) -> None:
                step, owner = event.step, event.owner
                times = sink.receipt_times.get((step, owner))  # how the library received it
                stats = asdict(times) if times is not None else {}
                t0 = time.perf_counter()
                retired = apply_retention(lstore, [event.owner], keep)
                stats.update(retention_s=time.perf_counter() - t0, retired=retired)
                with report_lock:
                    report_store.set(f"peer/{kind}/rx/{event.step}", json.dumps(stats))

            sink.subscribers.append(on_received)
            transport = make_transport(lstore, rdzv, sink, ReplicationOptions(
                mode=kind, host="127.0.0.1", timeout=cfg["timeout"], bandwidth=0))
            store.set(f"peer/{kind}/ready", "1")
            try:
                store.wait([f"peer/{kind}/done"], timedelta(seconds=cfg["timeout"]))
            finally:
                transport.close()
                if kind == "pg":
                    dist.destroy_process_group()
                lstore.destroy()
                store.set(f"peer/{kind}/closed", "1")
    finally:
        raw.close()
        shutil.rmtree(my_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------- training worker
def train_main(cfg: dict) -> None:
    """One simulated node (one rank): async_save with replication off, then on; report timings."""
    start_parent_watchdog(cfg["root"])
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from mlcheckpoint import CheckpointManager, ReplicationOptions

    rank = cfg["rank"]
    # What torchrun sets for 2 nodes x 1 rank: Topology.detect() sees 2 nodes.
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["store_port"]))
    node_dir = os.path.join(cfg["root"], f"node{rank}")
    os.makedirs(node_dir, exist_ok=True)
    base = connect_store("127.0.0.1", cfg["store_port"], cfg["timeout"])
    dist.init_process_group("gloo", store=dist.PrefixStore("bench-train/", base), rank=rank,
                            world_size=2, timeout=timedelta(seconds=cfg["timeout"]))
    sd = build_state_dict(cfg["size_bytes"], prefix=f"rank{rank}.", seed=rank)

    # Simulated training compute: many small matmuls, so GIL and CPU stalls show up.
    a, b, c = torch.randn(128, 128), torch.randn(128, 128), torch.empty(128, 128)

    def compute(iters: int) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b, out=c)
        return time.perf_counter() - t0

    per = min(compute(200) / 200 for _ in range(5))
    iters = max(1, int(cfg["compute_s"] / per))
    results: dict[str, Any] = {"rank": rank, "compute_iters": iters,
                               "compute_alone_s": median([compute(iters) for _ in range(3)]), "modes": {}}
    for mode in ("none", "tcp"):
        job = f"{cfg['job']}-{mode}"
        # No bandwidth budget: this measures replication at loopback speed, as the transfers above.
        ckpt = CheckpointManager(job_id=job, local_dir=node_dir, keep=cfg["keep"],
                                 replication=ReplicationOptions(mode=mode, host="127.0.0.1",
                                                                timeout=cfg["timeout"], bandwidth=0))
        if ckpt.replication_mode != mode:
            raise RuntimeError(f"replication={mode!r} but the manager runs {ckpt.replication_mode!r}")
        rows = []
        try:
            for step in range(cfg["saves"]):
                rows.append(_timed_save(ckpt, sd, step, compute, iters, cfg["timeout"]))
            ckpt.wait()
        finally:
            ckpt.close()
            LocalStore(node_dir, job).destroy()
        results["modes"][mode] = rows
    with open(os.path.join(cfg["root"], f"train.rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    shutil.rmtree(node_dir, ignore_errors=True)


def _timed_save(ckpt: Any, sd: StateDict, step: int, compute: Any, iters: int,
                timeout: float) -> dict[str, Any]:
    """One async_save, training going on beside it, and what it cost the training thread."""
    sd["step"] = step
    sd["model"][next(iter(sd["model"]))][0, 0] = float(step)  # the bytes change a little
    dist.barrier()
    c0, t0 = time.thread_time(), time.perf_counter()
    fut = ckpt.async_save(sd, step)
    t1, c1 = time.perf_counter(), time.thread_time()
    compute_s = compute(iters)  # training goes on while the save/replication runs
    res = fut.result()
    row = {"step": step, "blocking_s": t1 - t0, "blocking_cpu_s": c1 - c0, "save_s": res.seconds,
           "bytes": res.bytes, "compute_s": compute_s,
           "phases": dict(getattr(res, "phases", {}))}  # SaveResult.phases: stage, commit, publish
    if ckpt.replication_mode != "none":

        def settled() -> Any:
            st = ckpt.replication_state(step)
            return st if st is not None and st.state in ("replicated", "failed", "superseded") else None

        st = wait_until(settled, deadline_in(timeout), 0.002) or ckpt.replication_state(step)
        row["replicated_after_s"] = time.perf_counter() - t0
        row.update(replication_state=None if st is None else st.state,
                   replication_s=None if st is None else st.seconds,
                   replication_bytes=None if st is None else st.bytes,
                   protected=ckpt.wait_replicated(step, timeout=timeout))
    return row


def push_phases(rx: dict[str, Any], t0: float, t_end: float) -> dict[str, Any]:
    """One push's phases from the receiver's ``ReceiptTimes`` (``rx``, with the receiver's
    ``retention_s``) and the sender's ``time.monotonic()`` at the push's start and end.

    The payload is what the receiver saw: from its buffer being ready to the last byte in
    (``commit_at``). A phase the library did not report is None, never 0.
    """
    out: dict[str, Any] = {"recycled": None,  # the receiver's store does not say
                           "retention_s": rx.get("retention_s"), "retired": rx.get("retired"),
                           "rx_buffer_s": rx.get("buffer_s"), "rx_checksum_s": rx.get("checksum_s"),
                           "rx_commit_s": rx.get("commit_s"), "rx_cpu_s": rx.get("cpu_s")}
    ready, landed = rx.get("buffer_ready_at"), rx.get("commit_at")
    if ready is None or landed is None:
        return out
    hashing_on_arrival = rx["checksum_s"] - rx["checksum_at_commit_s"]
    out.update(rx_recv_s=landed - ready - hashing_on_arrival, tx_before_payload_s=ready - t0,
               tx_payload_s=landed - ready, tx_after_payload_s=t_end - landed)
    return out


# ---------------------------------------------------------------------------------- orchestrator
class Bench:
    """The benchmark's main process: sender of the transfers, owner of every helper process,
    of the c10d store they share and of the one directory everything is written under."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.uid = uuid.uuid4().hex[:8]
        self.root = tempfile.mkdtemp(prefix="mlckpt-bench-repl-", dir=cfg.shm_dir)
        os.chmod(self.root, 0o700)
        self.secret = secrets.token_bytes(32)
        self.helpers = Helpers(self.root)
        self.store: dist.TCPStore | None = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=cfg.timeout_s))
        self.port = self.store.port

    # ------------------------------------------------------------ processes
    def spawn(self, role: str, args: dict, name: str) -> Any:
        return self.helpers.spawn([sys.executable, THIS_FILE, "--_worker", role, json.dumps(args)], name,
                                  env={SECRET_ENV: self.secret.hex()})

    def wait_key(self, key: str, timeout: float | None = None) -> bytes:
        store = self.store
        assert store is not None
        self.helpers.wait([p for p, _, _ in self.helpers.procs], timeout or self.cfg.timeout_s,
                          idle=lambda: store.check([key]))
        if not store.check([key]):
            raise RuntimeError(f"the helper processes ended without setting {key!r}")
        return store.get(key)

    def close(self) -> None:
        self.helpers.close()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.store = None  # closes the listening port
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------ sender side
    def save_step(self, sd: StateDict, store: LocalStore, step: int) -> float:
        sd["step"] = step
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, storage_writer=MemoryStorageWriter(step, store), no_dist=True)
        return time.perf_counter() - t0

    def push(self, transport: Transport, kind: str, step: int) -> dict[str, Any]:
        transport.push_metadata(1, step)  # small; first, so the receiver's retention counts the step
        c0, t0 = proc_cpu(), time.monotonic()  # monotonic: the receiver's stamps are on its clock
        sent = transport.push_shard(1, step, 0)
        t1 = time.monotonic()
        dt, tx_cpu = t1 - t0, proc_cpu() - c0
        if sent == 0:
            raise RuntimeError(f"peer already held step {step}: nothing was transferred")
        rx = json.loads(self.wait_key(f"peer/{kind}/rx/{step}"))
        row = {"step": step, "s": dt, "bytes": sent, "gbps": gbps(sent, dt), "tx_cpu_s": tx_cpu,
               **push_phases(rx, t0, t1)}
        row["cpu_s"] = tx_cpu + (row["rx_cpu_s"] if row.get("rx_cpu_s") is not None else float("nan"))
        return row

    def run_transfers(self, res: dict[str, Any]) -> None:
        cfg = self.cfg
        tcp_job, pg_job = f"bench-tcp-{self.uid}", f"bench-pg-{self.uid}"
        self.spawn("peer", {"root": self.root, "store_port": self.port, "timeout": cfg.timeout_s,
                            "receiver_keep": cfg.receiver_keep, "tcp_job": tcp_job,
                            "pg_job": pg_job}, "peer")
        assert self.store is not None
        raw_port = int(self.wait_key("peer/raw_port"))
        sd = build_state_dict(cfg.size_bytes)
        res["state_dict"] = {"tensor_bytes": state_dict_bytes(sd), "tensors": len(sd["model"]),
                             "large": 4, "non_tensors": 2}
        raw: RawSender | None = None
        try:
            raw = self._run_tcp(res, sd, raw_port, tcp_job)
            self._run_pg(res, sd, raw, pg_job)
        finally:
            if raw is not None:
                raw.close()
        del sd
        self.helpers.wait([p for p, n, _ in self.helpers.procs if n == "peer"], timeout=60)

    def _run_tcp(self, res: dict[str, Any], sd: StateDict, raw_port: int, job: str) -> RawSender:
        """Sections 1 and 2: raw transfers and TCP pushes, interleaved round by round."""
        cfg = self.cfg
        assert self.store is not None
        raw: RawSender | None = None
        raw_rows: dict[str, list[dict]] = {k: [] for k, *_ in RAW_VARIANTS}

        def raw_round() -> None:
            assert raw is not None
            for key, _label, how, flags in RAW_VARIANTS:
                raw_rows[key].append(raw.transfer(how, flags))

        store_s = LocalStore(os.path.join(self.root, "sender-tcp"), job)
        rdzv = Rendezvous(self.store, job, 0, 2, secret=self.secret)
        self.store.set("peer/tcp/go", "true")
        transport = make_transport(store_s, rdzv, ReceiveSink(store_s), ReplicationOptions(
            mode="tcp", host="127.0.0.1", timeout=cfg.timeout_s, streams=cfg.streams, bandwidth=0))
        tcp_rows: list[dict] = []
        try:
            self.wait_key("peer/tcp/ready")
            for r in range(cfg.rounds):
                save_s = self.save_step(sd, store_s, r)
                if raw is None:
                    nbytes = store_s.shards.read_manifest(r, 0).data_bytes
                    raw = RawSender(raw_port, nbytes, os.path.join(self.root, "raw-src.bin"))
                    res["shard_bytes"] = nbytes
                    raw_round()  # warm-up: touches every buffer on both sides
                    raw_rows = {k: [] for k, *_ in RAW_VARIANTS}
                if r % 2:
                    raw_round()
                row = self.push(transport, "tcp", r)
                row["save_s"] = save_s
                tcp_rows.append(row)
                apply_retention(store_s, [0], keep=1)  # the sender recycles its buffers too
                if not r % 2:
                    raw_round()
                progress(f"tcp push {r}: {row['gbps']:.2f} GB/s; raw sendfile "
                          f"{raw_rows['sendfile'][-1]['gbps']:.2f} GB/s")
        finally:
            transport.close()
            store_s.destroy()
            self.store.set("peer/tcp/done", "1")
        self.wait_key("peer/tcp/closed")
        res["raw"] = {key: {"label": label, "reps": raw_rows[key]} for key, label, *_ in RAW_VARIANTS}
        res["tcp"] = {"pushes": tcp_rows}
        assert raw is not None
        return raw

    def _run_pg(self, res: dict[str, Any], sd: StateDict, raw: RawSender, job: str) -> None:
        """Section 3: pg/gloo pushes, interleaved with raw sendfile and sendall."""
        cfg = self.cfg
        assert self.store is not None
        if not cfg.pg_rounds:
            self.store.set("peer/pg/go", "false")
            res["pg"] = {"skipped": "--no-pg / --pg-rounds 0"}
            return
        pg_rows: list[dict] = []
        pg_raw: dict[str, list[dict]] = {"sendall": [], "sendfile": []}
        self.store.set("peer/pg/go", "true")
        try:
            dist.init_process_group("gloo", store=dist.PrefixStore("bench-pg/", self.store), rank=0,
                                    world_size=2, timeout=timedelta(seconds=cfg.timeout_s))
            store_s = LocalStore(os.path.join(self.root, "sender-pg"), job)
            rdzv = Rendezvous(self.store, job, 0, 2, secret=self.secret)
            transport = make_transport(store_s, rdzv, ReceiveSink(store_s),
                                       ReplicationOptions(mode="pg", timeout=cfg.timeout_s,
                                                          bandwidth=0))
            try:
                self.wait_key("peer/pg/ready")
                for r in range(cfg.pg_rounds):
                    save_s = self.save_step(sd, store_s, r)
                    for key, reps in pg_raw.items():
                        reps.append(raw.transfer(key, 0))
                    row = self.push(transport, "pg", r)
                    row["save_s"] = save_s
                    pg_rows.append(row)
                    apply_retention(store_s, [0], keep=1)
                    progress(f"pg push {r}: {row['gbps']:.2f} GB/s; raw sendfile "
                              f"{pg_raw['sendfile'][-1]['gbps']:.2f} GB/s")
            finally:
                transport.close()
                store_s.destroy()
        finally:
            self.store.set("peer/pg/done", "1")
            if dist.is_initialized():
                dist.destroy_process_group()
        self.wait_key("peer/pg/closed")
        res["pg"] = {"pushes": pg_rows, "raw": pg_raw}

    def run_training(self, res: dict[str, Any]) -> None:
        cfg = self.cfg
        if not cfg.saves:
            res["training"] = {"skipped": "--no-train / --saves 0"}
            return
        job = f"bench-train-{self.uid}"
        procs = [self.spawn("train", {"root": self.root, "store_port": self.port, "rank": rank,
                                      "timeout": cfg.timeout_s, "size_bytes": cfg.size_bytes,
                                      "saves": cfg.saves, "keep": cfg.keep, "job": job,
                                      "compute_s": cfg.compute_s}, f"train{rank}")
                 for rank in range(2)]
        self.helpers.wait(procs, timeout=cfg.timeout_s)
        ranks = []
        for rank in range(2):
            with open(os.path.join(self.root, f"train.rank{rank}.json")) as f:
                ranks.append(json.load(f))
        res["training"] = {"ranks": ranks, "keep": cfg.keep, "warmup_saves": cfg.keep + 1}


# ---------------------------------------------------------------------------------- main
def run(cfg: Config) -> dict[str, Any]:
    """Every figure: the transfers, the training-thread run, and their summary."""
    res: dict[str, Any] = {"config": asdict(cfg), "loadavg_start": loadavg()}
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    bench = Bench(cfg)
    try:
        bench.run_transfers(res)
        bench.run_training(res)
    finally:
        bench.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    res["loadavg_end"] = loadavg()
    res["summary"] = summarize(res)
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the report and return every figure (see --json)."""
    cfg = parse_args(argv)
    return run_and_report(cfg, run, lambda cfg, res: report(res, res["summary"], cfg), cfg.json_path)


def _worker(role: str, args: str) -> None:
    cfg = json.loads(args)
    parent = os.getppid()
    try:
        {"peer": peer_main, "train": train_main}[role](cfg)
    finally:
        if os.getppid() != parent:  # the benchmark was killed: nobody else will clean up
            shutil.rmtree(cfg["root"], ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_worker":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        _worker(sys.argv[2], sys.argv[3])
    else:
        main()
