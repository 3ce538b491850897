"""What the benchmarks share: sizes and statistics, timers, state-dict builders, helper
processes, and the baselines every figure is compared with in the same run (memcpy into a
warm buffer, a raw loopback socket, DCP's file system storage on /dev/shm).

Import it as ``from benchmarks.common import ...`` after putting the repository root on
``sys.path`` (each script does that first, so it runs both as ``python benchmarks/x.py`` and as
``from benchmarks.x import main``).
"""

from __future__ import annotations

import contextlib
import gc
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
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

StateDict = dict[str, Any]

GB = 1e9  # throughput is reported in decimal GB/s
MiB = 1 << 20
GiB = 1 << 30


# ---------------------------------------------------------------------------------- statistics
def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def p90(xs: list[float]) -> float:
    """The 90th percentile, nearest rank (no interpolation between two steps' times)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else float("nan")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of ``fn()``."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def proc_cpu() -> float:
    """CPU seconds (user + system) of this process, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def progress(msg: str) -> None:
    """A progress line on stderr (the report itself goes to stdout)."""
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def size_str(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


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


class Timers:
    """Seconds accumulated per name, from any thread; ``wrap`` times a function into a name."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.t: dict[str, float] = {}
        self.flags: dict[str, Any] = {}

    def add(self, name: str, dt: float) -> None:
        with self.lock:
            self.t[name] = self.t.get(name, 0.0) + dt

    def take(self) -> dict[str, Any]:
        """Everything so far (times and flags), and start again from nothing."""
        with self.lock:
            out = {**self.t, **self.flags}
            self.t, self.flags = {}, {}
        return out

    def wrap(self, name: str, fn: Callable, when: Callable[..., bool] | None = None,
             mark: str | None = None) -> Callable:
        """``fn`` timed into ``name`` (only calls for which ``when(*args)`` holds); ``mark``
        also records when the (last) call started."""
        def timed_call(*a: Any, **kw: Any) -> Any:
            if when is not None and not when(*a, **kw):
                return fn(*a, **kw)
            t0 = time.perf_counter()
            if mark is not None:
                self.flags[mark] = t0
            try:
                return fn(*a, **kw)
            finally:
                self.add(name, time.perf_counter() - t0)
        return timed_call


# ---------------------------------------------------------------------------------- workspace
def make_workspace(prefix: str, shm_dir: str = "/dev/shm", need_bytes: int = 0) -> str:
    """A private directory under ``shm_dir`` for everything one run writes (the caller removes
    it); refuses to start when the tmpfs has less than ``need_bytes`` free."""
    vfs = os.statvfs(shm_dir)
    free = vfs.f_bavail * vfs.f_frsize
    if free < need_bytes:
        raise SystemExit(f"{shm_dir} has {size_str(free)} free; this run needs about {size_str(need_bytes)}")
    root = tempfile.mkdtemp(prefix=prefix, dir=shm_dir)
    os.chmod(root, 0o700)
    return root


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so ``finally`` blocks remove what the run wrote."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """dcp.save/load without a process group warn on every call that they run single-process
    (and a FileSystemWriter that overwrites a checkpoint, on every call too)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*no_dist.*")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # we overwrite on purpose
        yield


# ---------------------------------------------------------------------------------- state dicts
@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def fill_random(t: torch.Tensor, pool: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill ``t`` by tiling a random pool from a random start: realistic (finite, non-constant)
    values at memcpy speed, where torch.randn would take several seconds per GiB."""
    flat, src = t.view(-1), pool.to(t.dtype)
    start, pos, n = int(torch.randint(0, src.numel(), (1,), generator=gen)), 0, flat.numel()
    while pos < n:
        k = min(n - pos, src.numel() - start)
        flat[pos:pos + k].copy_(src[start:start + k])
        pos, start = pos + k, 0
    return t


def build_tensors(specs: list[TensorSpec], seed: int = 0, pool_elems: int = 1 << 20) -> dict[str, torch.Tensor]:
    """The tensors ``specs`` name, filled with seeded random values (the same seed, the same
    bytes: a fresh process can rebuild what it expects to load)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(pool_elems, generator=gen)
    return {s.name: fill_random(torch.empty(s.shape, dtype=s.dtype), pool, gen) for s in specs}


# Layout of bench_local, bench_gc, bench_first_saves: most bytes in a few large matrices
# (embeddings, MLP weights), the rest in a few hundred small tensors (norms, biases, small
# projections) of 4 KiB-1 MiB, float32 and bfloat16.
LARGE_COUNT = 5
LARGE_SHARE = 0.75
LARGE_COLS = 4096
SMALL_MIN, SMALL_MAX = 4 << 10, 1 << 20
SMALL_SUFFIXES = ("ln_1.weight", "ln_1.bias", "attn.proj.bias", "ln_2.weight", "mlp.fc.bias")


def model_layout(size_bytes: int, seed: int = 0) -> list[TensorSpec]:
    gen = torch.Generator().manual_seed(seed + 1)
    specs = []
    per_large = int(size_bytes * LARGE_SHARE) // LARGE_COUNT
    for i in range(LARGE_COUNT):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        rows = max(1, per_large // (LARGE_COLS * dtype.itemsize))
        specs.append(TensorSpec(f"blocks.{i}.mlp.fc.weight", (rows, LARGE_COLS), dtype))
    used, j = sum(s.nbytes for s in specs), 0
    while size_bytes - used >= SMALL_MIN:
        nbytes = min(size_bytes - used, int(torch.randint(SMALL_MIN, SMALL_MAX + 1, (1,), generator=gen)))
        dtype = torch.bfloat16 if torch.rand(1, generator=gen).item() < 0.5 else torch.float32
        name = f"blocks.{j // len(SMALL_SUFFIXES)}.{SMALL_SUFFIXES[j % len(SMALL_SUFFIXES)]}"
        specs.append(TensorSpec(name, (nbytes // dtype.itemsize,), dtype))
        used += specs[-1].nbytes
        j += 1
    return specs


def model_state_dict(size_bytes: int, seed: int = 0) -> tuple[StateDict, list[TensorSpec]]:
    """``{"model": {...}, "step": int, "run_name": str}`` of about ``size_bytes``, shaped like a
    model (see ``model_layout``), and its layout."""
    specs = model_layout(size_bytes, seed)
    return {"model": build_tensors(specs, seed), "step": 123456, "run_name": "bench-local"}, specs


# Layout of bench_replication's shard: 4 large matrices (90%), ~48 small float32 tensors.
SHARD_LARGE_COUNT, SHARD_LARGE_SHARE, SHARD_SMALL_COUNT = 4, 0.9, 48


def shard_layout(size_bytes: int, prefix: str = "", seed: int = 0) -> list[TensorSpec]:
    gen = torch.Generator().manual_seed(seed + 1)
    sizes = [int(SMALL_MIN * (SMALL_MAX / SMALL_MIN) ** float(torch.rand(1, generator=gen)))
             for _ in range(SHARD_SMALL_COUNT)]
    small_total = min(sum(sizes), int(size_bytes * (1 - SHARD_LARGE_SHARE)))
    per_large = (size_bytes - small_total) // SHARD_LARGE_COUNT
    specs = []
    for i in range(SHARD_LARGE_COUNT):
        dtype = torch.bfloat16 if i == SHARD_LARGE_COUNT - 1 else torch.float32
        rows = max(1, per_large // (LARGE_COLS * dtype.itemsize))
        specs.append(TensorSpec(f"{prefix}layers.{i}.mlp.weight", (rows, LARGE_COLS), dtype))
    used = 0
    for j, n in enumerate(sizes):
        n = min(n, small_total - used) // 4
        if n <= 0:
            break
        specs.append(TensorSpec(f"{prefix}layers.{j % SHARD_LARGE_COUNT}.norm{j}.weight", (n,), torch.float32))
        used += 4 * n
    return specs


def tensors_of(sd: StateDict) -> list[torch.Tensor]:
    return list(sd["model"].values())


def warm_target(sd: StateDict) -> StateDict:
    """Same structure and shapes, tensors allocated and touched (copied once), values reset:
    what a model's parameters are when it loads a checkpoint."""
    model = {k: torch.empty_like(t).copy_(t) for k, t in sd["model"].items()}
    target = {**sd, "model": model}
    scrub(target)
    return target


def scrub(target: StateDict) -> None:
    """Reset a load target, so a load that silently does nothing fails ``check_equal``."""
    for t in target["model"].values():
        t.zero_()
    for k, v in target.items():
        if k != "model":
            target[k] = type(v)()


def check_equal(expected: StateDict, got: StateDict, what: str) -> None:
    """Fail loudly if a load did not reproduce the state dict (a fast wrong load is no result)."""
    for k, t in expected["model"].items():
        if not torch.equal(t, got["model"][k]):
            raise AssertionError(f"{what}: tensor {k!r} differs after load")
    for k, v in expected.items():
        if k != "model" and got[k] != v:
            raise AssertionError(f"{what}: {k} is {got[k]!r}, expected {v!r}")


def state_dict_bytes(sd: StateDict) -> int:
    return sum(t.nbytes for t in sd["model"].values())


# ---------------------------------------------------------------------------------- baselines
def make_memcpy(src: list[torch.Tensor], dst: list[torch.Tensor]) -> Callable[[], float]:
    """A function that copies every tensor into its already-touched twin and returns the time:
    the limit any in-memory checkpoint is measured against."""
    def once() -> float:
        t0 = time.perf_counter()
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
        return time.perf_counter() - t0
    return once


def dcp_fs_save(sd: StateDict, path: str) -> None:
    """DCP's FileSystemWriter into ``path`` (one process, no process group)."""
    import torch.distributed.checkpoint as dcp
    with quiet_dcp():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def dcp_fs_load(target: StateDict, path: str) -> None:
    """DCP's FileSystemReader from ``path`` into ``target`` (in place)."""
    import torch.distributed.checkpoint as dcp
    with quiet_dcp():
        dcp.load(target, storage_reader=dcp.FileSystemReader(path), no_dist=True)


# Raw socket transfer: the receiver's modes are bit flags in the request header.
HASH_AFTER, HASH_FUSED, TO_SHM, TIMEOUTS = 1, 2, 4, 8
RAW_HEADER = struct.Struct("!QB")
RAW_REPLY = struct.Struct("!ddd")  # receiver's recv seconds, hash seconds, process CPU seconds


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = conn.recv(n - len(buf))
        if not got:
            raise ConnectionError(f"raw transfer closed after {len(buf)} of {n} bytes")
        buf += got
    return bytes(buf)


class RawReceiver:
    """The raw socket baseline's receiving end: one connection per transfer, ``recv_into`` a
    preallocated, touched buffer (anonymous memory, or a warm tmpfs mapping at ``shm_path``),
    optionally with an xxh3 pass after the receive or per ``recv_into``. Serves on a thread."""

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
                n, flags = RAW_HEADER.unpack(_recv_exact(conn, RAW_HEADER.size))
                if flags & TIMEOUTS:
                    conn.settimeout(60.0)
                if n == 0:
                    conn.sendall(RAW_REPLY.pack(0.0, 0.0, 0.0))
                    return
                view = self._buffer(n, bool(flags & TO_SHM))
                h = xxhash.xxh3_64() if flags & HASH_FUSED else None
                c0, t0 = proc_cpu(), time.perf_counter()
                got = 0
                while got < n:  # chunks of at most 64 MiB, as the transports receive
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
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
            s.sendall(RAW_HEADER.pack(0, 0))
            s.recv(RAW_REPLY.size)
        self.thread.join(timeout=10)
        self.sock.close()
        self.anon = None
        if self.shm is not None:
            self.shm.close()


class RawSender:
    """The raw baseline's sending end: ``sendall`` of a touched in-memory buffer, or
    ``sendfile`` of the same bytes from a tmpfs file at ``src_file``."""

    def __init__(self, port: int, nbytes: int, src_file: str):
        self.port, self.n = port, nbytes
        self.buf: np.ndarray | None = np.ones(nbytes, dtype=np.uint8)  # touched
        self.buf[::4096] = np.arange(len(self.buf[::4096]), dtype=np.uint64).astype(np.uint8)
        self.src_file = src_file
        with open(src_file, "wb") as f:
            f.write(memoryview(self.buf))

    def transfer(self, how: str, flags: int = 0) -> dict[str, float]:
        """One transfer, connect -> the receiver's reply; ``how`` is "sendall" or "sendfile"."""
        assert self.buf is not None
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
            recv_s, hash_s, rx_cpu = RAW_REPLY.unpack(_recv_exact(s, RAW_REPLY.size))
        dt, tx_cpu = time.perf_counter() - t0, proc_cpu() - c0
        return {"s": dt, "gbps": gbps(self.n, dt), "rx_recv_s": recv_s, "rx_hash_s": hash_s,
                "tx_cpu_s": tx_cpu, "rx_cpu_s": rx_cpu, "cpu_s": tx_cpu + rx_cpu}

    def close(self) -> None:
        self.buf = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.src_file)


def raw_socket_seconds(nbytes: int, root: str, reps: int, how: str = "sendall") -> list[float]:
    """Seconds of ``reps`` single-stream loopback transfers of ``nbytes`` in this process (the
    receiver on a thread), into a warm anonymous buffer."""
    receiver = RawReceiver(os.path.join(root, "raw-dest.bin"))
    sender = RawSender(receiver.port, nbytes, os.path.join(root, "raw-src.bin"))
    try:
        sender.transfer(how)  # warm-up: touches both buffers
        return [sender.transfer(how)["s"] for _ in range(reps)]
    finally:
        sender.close()
        receiver.close()


# ---------------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(script: str, args: list[str], *, nnodes: int, node_rank: int, port: int,
                 nproc_per_node: int = 1) -> list[str]:
    """One torchrun agent of a job simulated on this machine (static rendezvous on loopback)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--node-rank={node_rank}", f"--nproc-per-node={nproc_per_node}",
            "--master-addr=127.0.0.1", f"--master-port={port}", script, *args]


def start_parent_watchdog(root: str) -> None:
    """In a helper process: when the parent dies (SIGKILL), remove ``root`` and exit."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                shutil.rmtree(root, ignore_errors=True)
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="bench-watchdog").start()


class Helpers:
    """The helper processes of one run. Each runs in its own session (so its whole process
    tree can be ended) with its output in ``<root>/<name>.log``; ``close`` ends those still
    running, SIGTERM first, then SIGKILL."""

    def __init__(self, root: str):
        self.root = root
        self.procs: list[tuple[subprocess.Popen, str, str]] = []

    def spawn(self, cmd: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log_path = os.path.join(self.root, f"{name}.log")
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, full_env.get("PYTHONPATH")) if p)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=REPO_ROOT)
        self.procs.append((proc, name, log_path))
        return proc

    def log_tail(self, name: str, n: int = 4000) -> str:
        try:
            with open(os.path.join(self.root, f"{name}.log"), errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def check(self) -> None:
        """Raise if a helper failed, with the end of its log."""
        for proc, name, _ in self.procs:
            rc = proc.poll()
            if rc not in (None, 0):
                raise RuntimeError(f"helper {name} exited with {rc}; its log ends:\n{self.log_tail(name)}")

    def wait(self, procs: list[subprocess.Popen], timeout: float,
             idle: Callable[[], bool] | None = None) -> None:
        """Wait until ``procs`` exit (or ``idle()`` holds), failing early if any helper fails."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and not (idle is not None and idle()):
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"helper processes did not finish within {timeout:.0f} s")
            time.sleep(0.005 if idle is not None else 0.05)
        self.check()

    def close(self) -> None:
        for proc, _, _ in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc, _, _ in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.procs.clear()
        gc.collect()
