"""One bulk TCP transfer between two namespaces, for ``NetCluster.raw_tcp_transfer``.

Run as a script (standard library only: it starts in milliseconds and imports no torch):

    python _tcp_peer.py recv HOST [DIR NBYTES]   prints "ready <port>", then
                                                 "<bytes> <seconds> <cpu seconds>" at EOF
    python _tcp_peer.py send HOST PORT NBYTES    prints "<cpu seconds>" when done

The sender uses sendfile() from a memory file, as replication sends from tmpfs; the receiver
times from the accepted connection to the sender's EOF, so the figure is what arrived, not
what was queued in the sender's socket buffer. With DIR the receiver lands the bytes where
replication does: in a fresh file there, allocated up front and filled through a mapping (the
file is removed at the end). The CPU seconds are the process's own (user + system) from when
it is ready to the end, so without the interpreter's start: the kernel's work inside its
system calls included, softirq work that ran elsewhere not.
"""

from __future__ import annotations

import mmap
import os
import socket
import sys
import time

CHUNK = 16 << 20
RECV_CHUNK = 4 << 20


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _receive_into(conn: socket.socket, view: memoryview) -> int:
    total = 0
    while total < len(view) and (n := conn.recv_into(view[total:total + RECV_CHUNK])):
        total += n
    return total


def receive(host: str, into: str | None, nbytes: int) -> None:
    with socket.create_server((host, 0)) as server:
        cpu0 = cpu_seconds()
        print("ready", server.getsockname()[1], flush=True)
        conn, _ = server.accept()
        start = time.perf_counter()
        with conn:
            if into is None:
                buf = memoryview(bytearray(RECV_CHUNK))
                total = 0
                while n := conn.recv_into(buf):
                    total += n
            else:
                fd, path = _fresh_file(into, nbytes)
                try:
                    with mmap.mmap(fd, nbytes) as m, memoryview(m) as view:
                        total = _receive_into(conn, view)
                        total += len(conn.recv(1))  # 0 at the sender's EOF; 1 if it sent more
                finally:
                    os.close(fd)
                    os.unlink(path)
        print(total, time.perf_counter() - start, cpu_seconds() - cpu0, flush=True)


def _fresh_file(directory: str, nbytes: int) -> tuple[int, str]:
    path = os.path.join(directory, f"tcp-peer-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    return fd, path


def send(host: str, port: int, nbytes: int) -> None:
    fd = os.memfd_create("tcp-peer")
    size = min(CHUNK, nbytes)
    os.write(fd, b"\x5a" * size)  # real pages, not holes: sendfile reads what it would read
    cpu0 = cpu_seconds()
    with socket.create_connection((host, port)) as conn:
        left = nbytes
        while left:
            offset = 0
            while offset < min(size, left):
                offset += os.sendfile(conn.fileno(), fd, offset, min(size, left) - offset)
            left -= offset
    os.close(fd)
    print(cpu_seconds() - cpu0, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        receive(sys.argv[2], *((sys.argv[3], int(sys.argv[4])) if len(sys.argv) > 3 else (None, 0)))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
