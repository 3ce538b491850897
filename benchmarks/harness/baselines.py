"""The baselines every figure is compared with in the same run: memcpy into a warm buffer, a
raw loopback socket, DCP's file system storage on /dev/shm."""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from .stats import gbps, proc_cpu
from .workloads import StateDict, quiet_dcp


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
