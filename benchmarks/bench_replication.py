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
import gc
import json
import mmap
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from a checkout: import the package from it
    sys.path.insert(0, REPO_ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import xxhash  # noqa: E402

import mlcheckpoint  # noqa: E402
from mlcheckpoint import LocalStore, MemoryStorageWriter  # noqa: E402
from mlcheckpoint.replication import Rendezvous  # noqa: E402
from mlcheckpoint.replication import pg as pg_mod  # noqa: E402
from mlcheckpoint.replication import protocol as proto_mod  # noqa: E402
from mlcheckpoint.replication import tcp as tcp_mod  # noqa: E402

GB = 1e9  # throughput in decimal GB/s
MiB = 1 << 20
GiB = 1 << 30
THIS_FILE = os.path.abspath(__file__)

TARGET_TCP_VS_RAW = 0.9  # steady-state push >= 0.9x the raw single-stream socket
TARGET_TRAIN_THREAD_SHARE = 0.01  # training-thread replication time <= 1% of the save
TARGET_TRAIN_THREAD_ABS_S = 0.002  # ... or <= 2 ms, whichever is larger (tiny --quick saves)

# Raw receiver modes (bit flags in the request header).
HASH_AFTER, HASH_FUSED, TO_SHM, TIMEOUTS = 1, 2, 4, 8
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
RAW_HEADER = struct.Struct("!QB")
RAW_REPLY = struct.Struct("!ddd")  # receiver's recv seconds, hash seconds, process CPU seconds

StateDict = dict[str, Any]


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
LARGE_COUNT, LARGE_SHARE, LARGE_COLS = 4, 0.9, 4096
SMALL_COUNT, SMALL_MIN, SMALL_MAX = 48, 4 << 10, 1 << 20


def build_state_dict(size_bytes: int, prefix: str = "", seed: int = 0) -> StateDict:
    """{"model": {a few large matrices, ~48 small tensors}, "step": int, "name": str}.

    ``prefix`` names the tensors per rank so that, saved from several ranks, every rank's
    shard holds its own bytes (DCP writes a replicated tensor from one rank only).
    """
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(1 << 22, generator=gen)
    sizes = [int(SMALL_MIN * (SMALL_MAX / SMALL_MIN) ** float(torch.rand(1, generator=gen)))
             for _ in range(SMALL_COUNT)]
    small_total = min(sum(sizes), int(size_bytes * (1 - LARGE_SHARE)))
    model: dict[str, torch.Tensor] = {}

    def fill(t: torch.Tensor) -> torch.Tensor:
        flat, src = t.view(-1), pool.to(t.dtype)
        start = int(torch.randint(0, src.numel(), (1,), generator=gen))
        pos = 0
        while pos < flat.numel():
            k = min(flat.numel() - pos, src.numel() - start)
            flat[pos:pos + k].copy_(src[start:start + k])
            pos, start = pos + k, 0
        return t

    per_large = (size_bytes - small_total) // LARGE_COUNT
    for i in range(LARGE_COUNT):
        dtype = torch.bfloat16 if i == LARGE_COUNT - 1 else torch.float32
        rows = max(1, per_large // (LARGE_COLS * dtype.itemsize))
        model[f"{prefix}layers.{i}.mlp.weight"] = fill(torch.empty(rows, LARGE_COLS, dtype=dtype))
    used = 0
    for j, n in enumerate(sizes):
        n = min(n, small_total - used) // 4
        if n <= 0:
            break
        model[f"{prefix}layers.{j % LARGE_COUNT}.norm{j}.weight"] = fill(torch.empty(n))
        used += 4 * n
    return {"model": model, "step": 0, "name": f"bench-replication{prefix}"}


def state_dict_bytes(sd: StateDict) -> int:
    return sum(t.nbytes for t in sd["model"].values())


# ---------------------------------------------------------------------------------- helpers
def proc_cpu() -> float:
    """CPU seconds (user + system) of this process, all threads (gloo's I/O threads too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else float("nan")


def connect_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def store_wait_json(store: dist.Store, key: str, timeout: float) -> Any:
    store.wait([key], timedelta(seconds=timeout))
    return json.loads(store.get(key))


def start_parent_watchdog(root: str) -> None:
    """A helper whose parent died (SIGKILL) removes the benchmark directory and exits."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                shutil.rmtree(root, ignore_errors=True)
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="bench-watchdog").start()


class Timers:
    """Accumulates seconds per name; wrappers installed on the package's functions feed it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.t: dict[str, float] = {}
        self.flags: dict[str, Any] = {}

    def add(self, name: str, dt: float) -> None:
        with self.lock:
            self.t[name] = self.t.get(name, 0.0) + dt

    def take(self) -> dict[str, Any]:
        with self.lock:
            out = {**self.t, **self.flags}
            self.t, self.flags = {}, {}
        return out

    def wrap(self, name: str, fn: Callable, when: Callable[..., bool] | None = None,
             mark: str | None = None) -> Callable:
        """``fn`` timed into ``name``; ``mark`` also records when the (last) call started."""
        def timed(*a, **kw):
            if when is not None and not when(*a, **kw):
                return fn(*a, **kw)
            t0 = time.perf_counter()
            if mark is not None:
                self.flags[mark] = t0
            try:
                return fn(*a, **kw)
            finally:
                self.add(name, time.perf_counter() - t0)
        return timed


def public_methods(obj: Any) -> tuple[str, ...]:
    """The public methods of ``obj``: every way code outside it (the manager) can call in."""
    return tuple(n for n in dir(type(obj)) if not n.startswith("_") and callable(getattr(obj, n, None))
                 and not isinstance(getattr(type(obj), n, None), (type, property)))


def count_calls(obj: Any, names: tuple[str, ...], timers: Timers, key: str,
                when: Callable[[], bool]) -> None:
    """Add the time spent in ``obj``'s methods ``names`` to ``timers[key]`` while ``when()``;
    a call made from inside another counted call is not counted twice."""
    local = threading.local()
    for name in names:
        def counted(*a, _fn=getattr(obj, name), **k):
            if getattr(local, "busy", False) or not when():
                return _fn(*a, **k)
            local.busy = True
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                timers.add(key, time.perf_counter() - t0)
                local.busy = False
        setattr(obj, name, counted)


def instrument_receiver(store: LocalStore, timers: Timers, transport_mod, payload_min: int) -> None:
    """Time the receiver's phases: buffer (cold or recycled), receive, checksum, commit.

    Only wraps (never replaces) the package's functions, on this process's objects."""
    take = store._take_from_pool

    def take_from_pool(*a, **kw):
        got = take(*a, **kw)
        timers.flags["recycled"] = got is not None
        return got

    begin = timers.wrap("rx_buffer_s", store.begin_shard)

    def begin_shard(*a, **kw):
        shard = begin(*a, **kw)
        if hasattr(shard, "verify"):  # on-arrival verification: ShardWriter.verify(manifest)
            shard.verify = timers.wrap("rx_checksum_s", shard.verify)
        return shard

    store._take_from_pool = take_from_pool  # type: ignore[method-assign]
    store.begin_shard = begin_shard  # type: ignore[method-assign]
    store._commit_shard = timers.wrap("rx_commit_s", store._commit_shard)  # type: ignore[method-assign]
    if hasattr(transport_mod, "checksum"):  # older layout: the transport hashes itself
        transport_mod.checksum = timers.wrap("rx_checksum_s", transport_mod.checksum)
    if transport_mod is tcp_mod:
        # Striped pushes receive on several threads at once: time the receive as the wall time
        # of the whole striped receive less its buffer, checksum and commit phases.
        striped = threading.local()
        proto_mod.recv_into_exact = timers.wrap(
            "rx_recv_s", proto_mod.recv_into_exact,
            when=lambda sock, view, *a: len(view) >= payload_min and not getattr(striped, "on", False))
        tcp_mod.verify_landed = timers.wrap("rx_checksum_s", tcp_mod.verify_landed)
        receive_striped = tcp_mod.TcpTransport._receive_striped
        on_put_part = tcp_mod.TcpTransport._on_put_part

        def timed_striped(self, *a, **kw):
            before = dict(timers.t)
            t0 = time.perf_counter()
            striped.on = True
            try:
                return receive_striped(self, *a, **kw)
            finally:
                striped.on = False
                phases = sum(timers.t.get(k, 0.0) - before.get(k, 0.0)
                             for k in ("rx_buffer_s", "rx_checksum_s", "rx_commit_s"))
                timers.add("rx_recv_s", time.perf_counter() - t0 - phases)

        def quiet_part(self, *a, **kw):  # its bytes are inside the striped receive's wall time
            striped.on = True
            try:
                return on_put_part(self, *a, **kw)
            finally:
                striped.on = False

        tcp_mod.TcpTransport._receive_striped = timed_striped  # type: ignore[method-assign]
        tcp_mod.TcpTransport._on_put_part = quiet_part  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------- raw receiver
class RawReceiver:
    """The raw baseline's receiving end: one connection per transfer, recv_into a touched buffer."""

    def __init__(self, shm_path: str):
        self.shm_path = shm_path
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=8)
        self.port = self.sock.getsockname()[1]
        self.anon: np.ndarray | None = None
        self.shm: mmap.mmap | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True, name="raw-recv")
        self.thread.start()

    def _buffer(self, n: int, to_shm: bool) -> memoryview:
        if to_shm:
            if self.shm is None or len(self.shm) != n:
                if self.shm is not None:
                    self.shm.close()
                fd = os.open(self.shm_path, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    os.ftruncate(fd, n)
                    self.shm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
                finally:
                    os.close(fd)
                np.frombuffer(self.shm, dtype=np.uint8).fill(1)  # touch: pages and page tables
            return memoryview(self.shm)
        if self.anon is None or self.anon.nbytes != n:
            self.anon = np.ones(n, dtype=np.uint8)  # touched
        return memoryview(self.anon)

    def _loop(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            with conn:
                n, flags = RAW_HEADER.unpack(proto_mod.recv_exact(conn, RAW_HEADER.size))
                if flags & TIMEOUTS:
                    conn.settimeout(60.0)
                if n == 0:
                    conn.sendall(RAW_REPLY.pack(0.0, 0.0, 0.0))
                    return
                view = self._buffer(n, bool(flags & TO_SHM))
                h = xxhash.xxh3_64() if flags & HASH_FUSED else None
                c0, t0 = proc_cpu(), time.perf_counter()
                got = 0
                while got < n:  # like protocol.recv_into_exact, chunks of at most 64 MiB
                    k = conn.recv_into(view[got:], min(n - got, 64 << 20))
                    if k == 0:
                        raise ConnectionError(f"raw transfer closed after {got} of {n} bytes")
                    if h is not None:
                        h.update(view[got:got + k])
                    got += k
                t1 = time.perf_counter()
                if flags & HASH_AFTER:
                    xxhash.xxh3_64_intdigest(view)
                elif h is not None:
                    h.intdigest()
                t2 = time.perf_counter()
                conn.sendall(RAW_REPLY.pack(t1 - t0, t2 - t1, proc_cpu() - c0))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
                s.sendall(RAW_HEADER.pack(0, 0))
                s.recv(RAW_REPLY.size)
        self.thread.join(timeout=10)
        self.sock.close()
        self.anon = None
        if self.shm is not None:
            self.shm.close()


class RawSender:
    def __init__(self, port: int, nbytes: int, src_file: str):
        self.port, self.n = port, nbytes
        self.buf = np.ones(nbytes, dtype=np.uint8)  # touched, same size as the shard
        self.buf[::4096] = np.arange(len(self.buf[::4096]), dtype=np.uint64).astype(np.uint8)
        self.src_file = src_file
        with open(src_file, "wb") as f:  # the same bytes in a tmpfs file, for sendfile
            f.write(memoryview(self.buf))

    def transfer(self, how: str, flags: int) -> dict[str, float]:
        c0, t0 = proc_cpu(), time.perf_counter()
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            if flags & TIMEOUTS:
                s.settimeout(60.0)
            s.sendall(RAW_HEADER.pack(self.n, flags))
            if how == "sendall":
                s.sendall(memoryview(self.buf))
            else:
                with open(self.src_file, "rb") as f:
                    sent = s.sendfile(f, 0, self.n)
                assert sent == self.n, (sent, self.n)
            recv_s, hash_s, rx_cpu = RAW_REPLY.unpack(proto_mod.recv_exact(s, RAW_REPLY.size))
        dt, tx_cpu = time.perf_counter() - t0, proc_cpu() - c0
        return {"s": dt, "gbps": gbps(self.n, dt), "rx_recv_s": recv_s, "rx_hash_s": hash_s,
                "tx_cpu_s": tx_cpu, "rx_cpu_s": rx_cpu, "cpu_s": tx_cpu + rx_cpu}

    def close(self) -> None:
        self.buf = None  # type: ignore[assignment]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.src_file)


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
            timers = Timers()
            lstore = LocalStore(os.path.join(my_dir, kind), job)
            rdzv = Rendezvous(store, job, 1, 2)
            if kind == "pg":
                dist.init_process_group("gloo", store=dist.PrefixStore("bench-pg/", store), rank=1,
                                        world_size=2, timeout=timedelta(seconds=cfg["timeout"]))

            def on_received(step: int, owner: int, lstore=lstore, timers=timers, kind=kind) -> None:
                rx_cpu = proc_cpu() - timers.flags.get("rx_cpu0", float("nan"))
                t0 = time.perf_counter()
                retired = lstore.apply_retention([owner], keep)
                stats = timers.take()
                stats.pop("rx_cpu0", None)
                stats.update(retention_s=time.perf_counter() - t0, retired=retired, rx_cpu_s=rx_cpu)
                with report_lock:
                    report_store.set(f"peer/{kind}/rx/{step}", json.dumps(stats))

            if kind == "tcp":
                transport = tcp_mod.TcpTransport(lstore, rdzv, host="127.0.0.1", on_received=on_received,
                                                 timeout=cfg["timeout"])
                instrument_receiver(lstore, timers, tcp_mod, payload_min=1 << 20)
                handler = transport._on_put_shard
            else:
                transport = pg_mod.PgTransport(lstore, rdzv, backend="gloo", on_received=on_received,
                                               timeout=cfg["timeout"])
                transport._recv_bytes = timers.wrap("rx_recv_s", transport._recv_bytes)
                instrument_receiver(lstore, timers, pg_mod, payload_min=1 << 20)
                handler = transport._handle

            def cpu_marked(*a, _fn=handler, _timers=timers, **k):
                _timers.flags["rx_cpu0"] = proc_cpu()  # the receipt's CPU: until on_received
                return _fn(*a, **k)

            if kind == "tcp":
                transport._on_put_shard = cpu_marked
            else:
                transport._handle = cpu_marked
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
    from mlcheckpoint import CheckpointManager

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
    main_ident = threading.get_ident()
    results: dict[str, Any] = {"rank": rank, "compute_iters": iters,
                               "compute_alone_s": median([compute(iters) for _ in range(3)]), "modes": {}}
    for mode in ("none", "tcp"):
        job = f"{cfg['job']}-{mode}"
        ckpt = CheckpointManager(job_id=job, local_dir=node_dir, keep=cfg["keep"], replication=mode,
                                 replication_host="127.0.0.1", replication_timeout=cfg["timeout"])
        if (ckpt.replicator is not None) != (mode == "tcp"):
            raise RuntimeError(f"replication={mode!r} but the manager runs {ckpt.replication_mode!r}")
        timers = Timers()
        measuring = threading.Event()
        if ckpt.replicator is not None:  # every way the manager reaches the replicator
            count_calls(ckpt.replicator, public_methods(ckpt.replicator), timers, "train_thread_replication_s",
                        when=lambda: measuring.is_set() and threading.get_ident() == main_ident)
        rows = []
        try:
            for i in range(cfg["saves"]):
                step = i
                sd["step"] = step
                sd["model"][next(iter(sd["model"]))][0, 0] = float(step)  # the bytes change a little
                dist.barrier()
                timers.take()
                measuring.set()
                c0, t0 = time.thread_time(), time.perf_counter()
                fut = ckpt.async_save(sd, step)
                t1, c1 = time.perf_counter(), time.thread_time()
                measuring.clear()
                train_repl = timers.take().get("train_thread_replication_s", 0.0)
                compute_s = compute(iters)  # training goes on while the save/replication runs
                res = fut.result()
                row = {"step": step, "blocking_s": t1 - t0, "blocking_cpu_s": c1 - c0,
                       "save_s": res.seconds, "bytes": res.bytes,
                       "train_thread_replication_s": train_repl, "compute_s": compute_s}
                if ckpt.replicator is not None:
                    deadline = time.monotonic() + cfg["timeout"]
                    st = None
                    while time.monotonic() < deadline:
                        st = ckpt.replicator.state(step)
                        if st is not None and st.state in ("replicated", "failed", "superseded"):
                            break
                        time.sleep(0.002)
                    row["replicated_after_s"] = time.perf_counter() - t0
                    row.update(replication_state=None if st is None else st.state,
                               replication_s=None if st is None else st.seconds,
                               replication_bytes=None if st is None else st.bytes,
                               protected=ckpt.wait_replicated(step, timeout=cfg["timeout"]))
                rows.append(row)
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



# ---------------------------------------------------------------------------------- orchestrator
class Bench:
    """The benchmark's main process: sender of the transfers, owner of every helper process,
    of the c10d store they share and of the one directory everything is written under."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.uid = uuid.uuid4().hex[:8]
        self.root = tempfile.mkdtemp(prefix="mlckpt-bench-repl-", dir=cfg.shm_dir)
        os.chmod(self.root, 0o700)
        self.procs: list[tuple[subprocess.Popen, str, str]] = []
        self.store: dist.TCPStore | None = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=cfg.timeout_s))
        self.port = self.store.port

    # ------------------------------------------------------------ processes
    def spawn(self, role: str, args: dict, name: str) -> subprocess.Popen:
        log_path = os.path.join(self.root, f"{name}.log")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, THIS_FILE, "--_worker", role, json.dumps(args)],
                                    env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=REPO_ROOT)
        self.procs.append((proc, name, log_path))
        return proc

    def _log_tail(self, path: str, n: int = 4000) -> str:
        try:
            with open(path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def check_helpers(self) -> None:
        for proc, name, log in self.procs:
            rc = proc.poll()
            if rc not in (None, 0):
                raise RuntimeError(f"helper {name} exited with {rc}; its log ends:\n{self._log_tail(log)}")

    def wait_key(self, key: str, timeout: float | None = None) -> bytes:
        assert self.store is not None
        deadline = time.monotonic() + (timeout or self.cfg.timeout_s)
        while not self.store.check([key]):
            self.check_helpers()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {key!r} from the helper processes")
            time.sleep(0.005)
        return self.store.get(key)

    def wait_procs(self, procs: list[subprocess.Popen], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            self.check_helpers()
            if time.monotonic() > deadline:
                raise TimeoutError("helper processes did not finish in time")
            time.sleep(0.05)
        self.check_helpers()

    def close(self) -> None:
        for proc, _name, _log in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc, _name, _log in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.procs.clear()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.store = None  # closes the listening port
        gc.collect()  # ... also when an exception's frames still hold rendezvous clients
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------ sender side
    def save_step(self, sd: StateDict, store: LocalStore, step: int) -> float:
        sd["step"] = step
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, storage_writer=MemoryStorageWriter(step, store), no_dist=True)
        return time.perf_counter() - t0

    def push(self, transport, kind: str, step: int, send_timers: Timers) -> dict[str, Any]:
        transport.push_metadata(1, step)  # small; first, so the receiver's retention counts the step
        send_timers.take()
        c0, t0 = proc_cpu(), time.perf_counter()
        sent = transport.push_shard(1, step, 0)
        dt, tx_cpu = time.perf_counter() - t0, proc_cpu() - c0
        rx = json.loads(self.wait_key(f"peer/{kind}/rx/{step}"))
        tx = send_timers.take()
        row = {"step": step, "s": dt, "bytes": sent, "gbps": gbps(sent, dt),
               "recycled": bool(rx.get("recycled", False)), "tx_cpu_s": tx_cpu}
        row.update({k: v for k, v in rx.items() if k.endswith("_s")})
        row["cpu_s"] = tx_cpu + row.get("rx_cpu_s", float("nan"))
        row.update({k: v for k, v in tx.items() if k.endswith("_s")})
        if "tx_start" in tx:  # before the payload: connect, handshake, offer, receiver's buffer, ready
            row["tx_before_payload_s"] = tx["tx_start"] - t0
            payload_s = tx.get("tx_sendfile_s", tx.get("tx_send_s", 0.0))
            row["tx_after_payload_s"] = dt - row["tx_before_payload_s"] - payload_s
        if sent == 0:
            raise RuntimeError(f"peer already held step {step}: nothing was transferred")
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
                             "large": LARGE_COUNT, "non_tensors": 2}
        raw: RawSender | None = None
        raw_rows: dict[str, list[dict]] = {k: [] for k, *_ in RAW_VARIANTS}
        send_timers = Timers()
        # a striped push sends over several connections at once: time it as a whole
        orig_send = {name: getattr(tcp_mod.TcpTransport, name) for name in ("_send_whole", "_send_striped")}
        for name, fn in orig_send.items():
            setattr(tcp_mod.TcpTransport, name, send_timers.wrap("tx_sendfile_s", fn, mark="tx_start"))

        def raw_round(variants) -> None:
            for key, _label, how, flags in variants:
                raw_rows[key].append(raw.transfer(how, flags))

        # ---- 1 + 2: raw and TCP, interleaved
        store_s = LocalStore(os.path.join(self.root, "sender-tcp"), tcp_job)
        rdzv = Rendezvous(self.store, tcp_job, 0, 2)
        self.store.set("peer/tcp/go", "true")
        transport = tcp_mod.TcpTransport(store_s, rdzv, host="127.0.0.1", timeout=cfg.timeout_s,
                                         streams=cfg.streams)
        tcp_rows: list[dict] = []
        try:
            self.wait_key("peer/tcp/ready")
            for r in range(cfg.rounds):
                save_s = self.save_step(sd, store_s, r)
                if raw is None:
                    nbytes = store_s.read_manifest(r, 0).data_bytes
                    raw = RawSender(raw_port, nbytes, os.path.join(self.root, "raw-src.bin"))
                    res["shard_bytes"] = nbytes
                    raw_round(RAW_VARIANTS)  # warm-up: touches every buffer on both sides
                    raw_rows = {k: [] for k, *_ in RAW_VARIANTS}
                if r % 2:
                    raw_round(RAW_VARIANTS)
                row = self.push(transport, "tcp", r, send_timers)
                row["save_s"] = save_s
                tcp_rows.append(row)
                store_s.apply_retention([0], keep=1)  # the sender recycles its buffers too
                if not r % 2:
                    raw_round(RAW_VARIANTS)
                _progress(f"tcp push {r}: {row['gbps']:.2f} GB/s; raw sendfile "
                          f"{raw_rows['sendfile'][-1]['gbps']:.2f} GB/s")
        finally:
            transport.close()
            store_s.destroy()
            for name, fn in orig_send.items():
                setattr(tcp_mod.TcpTransport, name, fn)
            self.store.set("peer/tcp/done", "1")
        self.wait_key("peer/tcp/closed")
        res["raw"] = {key: {"label": label, "reps": raw_rows[key]} for key, label, *_ in RAW_VARIANTS}
        res["tcp"] = {"pushes": tcp_rows}

        # ---- 3: pg/gloo, interleaved with raw sendfile and sendall
        pg_rows: list[dict] = []
        pg_raw: dict[str, list[dict]] = {"sendall": [], "sendfile": []}
        if cfg.pg_rounds:
            self.store.set("peer/pg/go", "true")
            try:
                dist.init_process_group("gloo", store=dist.PrefixStore("bench-pg/", self.store), rank=0,
                                        world_size=2, timeout=timedelta(seconds=cfg.timeout_s))
                store_s = LocalStore(os.path.join(self.root, "sender-pg"), pg_job)
                rdzv = Rendezvous(self.store, pg_job, 0, 2)
                transport = pg_mod.PgTransport(store_s, rdzv, backend="gloo", timeout=cfg.timeout_s)
                send_timers_pg = Timers()
                transport._send_bytes = send_timers_pg.wrap("tx_send_s", transport._send_bytes, mark="tx_start")
                try:
                    self.wait_key("peer/pg/ready")
                    for r in range(cfg.pg_rounds):
                        save_s = self.save_step(sd, store_s, r)
                        for key in pg_raw:
                            pg_raw[key].append(raw.transfer(key, 0))
                        row = self.push(transport, "pg", r, send_timers_pg)
                        row["save_s"] = save_s
                        pg_rows.append(row)
                        store_s.apply_retention([0], keep=1)
                        _progress(f"pg push {r}: {row['gbps']:.2f} GB/s; raw sendfile "
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
        else:
            self.store.set("peer/pg/go", "false")
            res["pg"] = {"skipped": "--no-pg / --pg-rounds 0"}
        if raw is not None:
            raw.close()
        del sd
        self.wait_procs([p for p, n, _ in self.procs if n == "peer"], timeout=60)

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
        self.wait_procs(procs, timeout=cfg.timeout_s)
        ranks = []
        for rank in range(2):
            with open(os.path.join(self.root, f"train.rank{rank}.json")) as f:
                ranks.append(json.load(f))
        res["training"] = {"ranks": ranks, "keep": cfg.keep, "warmup_saves": cfg.keep + 1}


def _progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- summary
def summarize(res: dict[str, Any], cfg: Config) -> dict[str, Any]:
    s: dict[str, Any] = {}
    n = res["shard_bytes"]
    raw = {k: median([r["s"] for r in v["reps"]]) for k, v in res["raw"].items()}
    s["raw_s"] = raw
    s["raw_gbps"] = {k: gbps(n, v) for k, v in raw.items()}
    s["raw_cpu_s"] = {k: median([r["cpu_s"] for r in v["reps"]]) for k, v in res["raw"].items()}
    s["raw_best"] = max(("sendall", "sendfile"), key=lambda k: s["raw_gbps"][k])
    ref = s["raw_gbps"][s["raw_best"]]
    pushes = res["tcp"]["pushes"]
    steady = [p for p in pushes if p["recycled"]]
    fresh = [p for p in pushes[1:] if not p["recycled"]]
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
        [sendfile_reps[i]["s"] / p["s"] for i, p in enumerate(pushes) if p["recycled"] and i < len(sendfile_reps)])
    if steady:
        s["tcp_steady_breakdown"] = {k: median([p.get(k, 0.0) for p in steady]) for k in
                                     ("rx_buffer_s", "rx_recv_s", "rx_checksum_s", "rx_commit_s",
                                      "tx_sendfile_s", "retention_s", "tx_before_payload_s",
                                      "tx_after_payload_s")}
    s["tcp_first_breakdown"] = {k: pushes[0].get(k, 0.0) for k in
                                ("rx_buffer_s", "rx_recv_s", "rx_checksum_s", "rx_commit_s", "tx_sendfile_s")}
    pg = res["pg"]
    if "pushes" in pg:
        pp = pg["pushes"]
        pst = [p for p in pp if p["recycled"]] or pp[1:]
        s["pg_first_gbps"] = pp[0]["gbps"]
        s["pg_steady_gbps"] = gbps(n, median([p["s"] for p in pst]))
        s["pg_raw_gbps"] = {k: gbps(n, median([r["s"] for r in v])) for k, v in pg["raw"].items()}
        pg_ref_k = max(s["pg_raw_gbps"], key=lambda k: s["pg_raw_gbps"][k])
        s["pg_vs_raw"] = s["pg_steady_gbps"] / s["pg_raw_gbps"][pg_ref_k]
        s["pg_steady_breakdown"] = {k: median([p.get(k, 0.0) for p in pst]) for k in
                                    ("rx_buffer_s", "rx_recv_s", "rx_checksum_s", "rx_commit_s", "tx_send_s")}
    tr = res["training"]
    if "ranks" in tr:
        w = tr["warmup_saves"]
        modes: dict[str, Any] = {}
        for mode in ("none", "tcp"):
            rows = [row for rk in tr["ranks"] for row in rk["modes"][mode][w:]]
            m = {k: median([row[k] for row in rows]) for k in
                 ("blocking_s", "blocking_cpu_s", "save_s", "train_thread_replication_s", "compute_s")}
            if mode == "tcp":
                reps = [row for row in rows if row.get("replication_s")]
                m["replication_s"] = median([row["replication_s"] for row in reps])
                m["replication_gbps"] = median([gbps(row["replication_bytes"], row["replication_s"])
                                                for row in reps])
                m["replicated_after_s"] = median([row["replicated_after_s"] for row in rows])
                m["all_replicated"] = all(row.get("replication_state") == "replicated"
                                          for rk in tr["ranks"] for row in rk["modes"][mode])
                m["all_protected"] = all(row.get("protected") for rk in tr["ranks"]
                                         for row in rk["modes"][mode])
            m["rows"] = len(rows)
            modes[mode] = m
        s["training"] = modes
        tcp, none = modes["tcp"], modes["none"]
        s["train_thread_s"] = tcp["train_thread_replication_s"]
        s["train_thread_vs_save"] = tcp["train_thread_replication_s"] / tcp["save_s"]
        s["blocking_delta_s"] = tcp["blocking_s"] - none["blocking_s"]
        s["blocking_cpu_delta_s"] = tcp["blocking_cpu_s"] - none["blocking_cpu_s"]
        s["compute_alone_s"] = median([rk["compute_alone_s"] for rk in tr["ranks"]])
    # targets
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
    s["targets"] = targets
    return s


def push_table(pushes: list[dict], raw_sendfile: list[dict], send_key: str) -> None:
    print("   seconds per push; 'before' = connect, handshake, offer, receiver's buffer, 'ready'; "
          "'after' = tail of the\n   receive, xxh3 of every item, commit, ack (rx: measured in the receiver)")
    print(f"   {'push':>4}{'buffer':>10}{'s':>8}{'GB/s':>7}{'before':>8}{'rx buffer':>10}{'tx send':>9}"
          f"{'rx recv':>9}{'after':>8}{'rx xxh3':>9}{'rx commit':>10}{'CPU tx+rx':>11}{'raw sendfile':>14}")
    for i, r in enumerate(pushes):
        raw_s = f"{raw_sendfile[i]['s']:.3f}" if i < len(raw_sendfile) else "-"
        print(f"   {i:>4}{'recycled' if r['recycled'] else 'fresh':>10}{r['s']:>8.3f}{r['gbps']:>7.2f}"
              f"{r.get('tx_before_payload_s', 0):>8.3f}{r.get('rx_buffer_s', 0):>10.3f}"
              f"{r.get(send_key, 0):>9.3f}{r.get('rx_recv_s', 0):>9.3f}{r.get('tx_after_payload_s', 0):>8.3f}"
              f"{r.get('rx_checksum_s', 0):>9.3f}{r.get('rx_commit_s', 0):>10.4f}{r.get('cpu_s', 0):>11.3f}"
              f"{raw_s:>14}")


def report(res: dict[str, Any], s: dict[str, Any], cfg: Config) -> None:
    n = res["shard_bytes"]
    p = print
    p()
    p(f"mlcheckpoint {mlcheckpoint.__version__} replication benchmark: shard {n / GiB:.3f} GiB "
      f"({n / GB:.3f} GB: {res['state_dict']['tensors']} tensors, {LARGE_COUNT} large, + 2 non-tensor "
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
    push_table(res["tcp"]["pushes"], res["raw"]["sendfile"]["reps"], "tx_sendfile_s")
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
    if "tcp_steady_breakdown" in s:
        b = s["tcp_steady_breakdown"]
        p(f"     medians: before the payload {b['tx_before_payload_s'] * 1e3:.1f} ms (rx buffer "
          f"{b['rx_buffer_s'] * 1e3:.1f} ms), sendfile {b['tx_sendfile_s']:.3f} s, rx recv {b['rx_recv_s']:.3f} s, "
          f"after the payload {b['tx_after_payload_s'] * 1e3:.1f} ms (rx xxh3 {b['rx_checksum_s'] * 1e3:.1f} ms, "
          f"commit {b['rx_commit_s'] * 1e3:.1f} ms); receiver's retention after the ack "
          f"{b['retention_s'] * 1e3:.1f} ms")
    p(f"     CPU (sender + receiver process) per steady push: {s['tcp_steady_cpu_s']:.3f} s (tx "
      f"{s['tcp_steady_tx_cpu_s']:.3f}, rx {s['tcp_steady_rx_cpu_s']:.3f}) = {s['tcp_cpu_vs_raw_sendfile']:.2f}x raw "
      f"sendfile's {s['raw_cpu_s']['sendfile']:.3f} s, {s['tcp_cpu_vs_like_ours']:.2f}x \"as ours\" "
      f"({s['raw_cpu_s']['like_ours']:.3f} s)")

    p("\n3. ours, process group (gloo): PgTransport.push_shard, same measure")
    if "pg_steady_gbps" in s:
        push_table(res["pg"]["pushes"], res["pg"]["raw"]["sendfile"], "tx_send_s")
        p(f"   first push {s['pg_first_gbps']:.2f} GB/s; steady state {s['pg_steady_gbps']:.2f} GB/s "
          f"= {s['pg_vs_raw']:.2f}x raw (raw in the same window: sendall "
          f"{s['pg_raw_gbps']['sendall']:.2f}, sendfile {s['pg_raw_gbps']['sendfile']:.2f} GB/s)")
    else:
        p(f"   skipped: {res['pg'].get('skipped')}")

    p("\n4. training-thread time per replicated checkpoint: 2 simulated nodes (1 rank each, gloo),")
    p(f"   CheckpointManager(keep={cfg.keep}).async_save of a {n / GiB:.3f} GiB shard per rank, then "
      f"{cfg.compute_s:.2f} s of simulated compute;")
    if "training" in s:
        t = s["training"]
        p(f"   medians over both ranks, saves >= #{res['training']['warmup_saves']} "
          f"({t['tcp']['rows']} per mode)")
        p(f"   {'replication':<13}{'async_save blocks':>19}{'(thread CPU)':>14}{'save s':>9}"
          f"{'train-thread repl.':>20}{'push s':>9}{'push GB/s':>11}{'compute s':>11}")
        for mode in ("none", "tcp"):
            m = t[mode]
            push = f"{m['replication_s']:>9.3f}{m['replication_gbps']:>11.2f}" if mode == "tcp" else f"{'-':>9}{'-':>11}"
            p(f"   {mode:<13}{m['blocking_s']:>19.4f}{m['blocking_cpu_s']:>14.4f}{m['save_s']:>9.3f}"
              f"{m['train_thread_replication_s'] * 1e3:>17.3f} ms{push}{m['compute_s']:>11.3f}")
        p(f"   training-thread time per replicated checkpoint: {s['train_thread_s'] * 1e3:.3f} ms "
          f"= {s['train_thread_vs_save']:.4%} of the save ({t['tcp']['save_s']:.3f} s)")
        p(f"     (time the training thread spent inside replication code, instrumented; cross-check: "
          f"async_save blocks {s['blocking_delta_s'] * 1e3:+.1f} ms wall, "
          f"{s['blocking_cpu_delta_s'] * 1e3:+.1f} ms thread CPU with replication on vs off)")
        p(f"   replication itself runs on background threads: push {t['tcp']['replication_s']:.3f} s per "
          f"shard (both nodes pushing at once), replicated {t['tcp']['replicated_after_s']:.3f} s after "
          f"async_save was called; every step replicated: {t['tcp']['all_replicated']}, protected: "
          f"{t['tcp']['all_protected']}")
        p(f"   simulated compute: {s['compute_alone_s']:.3f} s alone, {t['none']['compute_s']:.3f} s beside "
          f"a background save, {t['tcp']['compute_s']:.3f} s beside a save + replication "
          f"(CPU contention: 2 nodes share {os.cpu_count()} cores)")
    else:
        p(f"   skipped: {res['training'].get('skipped')}")

    p("\ntargets")
    for tg in s["targets"]:
        p(f"  {'PASS' if tg['pass'] else 'FAIL'}  {tg['name']}: {tg['shown']}")
    p(f"  info  TCP first push (cold receiver buffer) vs raw socket: {s['tcp_first_vs_raw']:.2f}x; "
      f"CPU per steady push vs raw sendfile: {s['tcp_cpu_vs_raw_sendfile']:.2f}x (no target)")
    if "pg_vs_raw" in s:
        p(f"  info  pg/gloo steady-state push vs raw socket: {s['pg_vs_raw']:.2f}x (no target)")
    p(f"  (wall-clock ratios on a shared machine: load average {res['loadavg_start']} -> "
      f"{res['loadavg_end']} on {os.cpu_count()} cores; the CPU columns do not count waiting for a core)")


# ---------------------------------------------------------------------------------- main
def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the report and return every figure (see --json)."""
    cfg = parse_args(argv)
    res: dict[str, Any] = {"config": asdict(cfg), "loadavg_start": _loadavg()}
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
    res["loadavg_end"] = _loadavg()
    res["summary"] = summarize(res, cfg)
    report(res, res["summary"], cfg)
    if cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(res, f, indent=2, default=str)
        print(f"\nfigures written to {cfg.json_path}")
    return res


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
