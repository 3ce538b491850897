"""One bulk TCP transfer between two namespaces, for ``NetCluster.raw_tcp_throughput``.

Run as a script (standard library only: it starts in milliseconds and imports no torch):

    python _tcp_peer.py recv HOST          prints "ready <port>", then "<bytes> <seconds>" at EOF
    python _tcp_peer.py send HOST PORT NBYTES

The sender uses sendfile() from a memory file, as replication sends from tmpfs; the receiver
times from the accepted connection to the sender's EOF, so the figure is what arrived, not
what was queued in the sender's socket buffer.
"""

from __future__ import annotations

import os
import socket
import sys
import time

CHUNK = 16 << 20


def receive(host: str) -> None:
    with socket.create_server((host, 0)) as server:
        print("ready", server.getsockname()[1], flush=True)
        conn, _ = server.accept()
        start = time.perf_counter()
        buf = bytearray(4 << 20)
        total = 0
        with conn:
            while n := conn.recv_into(buf):
                total += n
        print(total, time.perf_counter() - start, flush=True)


def send(host: str, port: int, nbytes: int) -> None:
    fd = os.memfd_create("tcp-peer")
    size = min(CHUNK, nbytes)
    os.write(fd, b"\x5a" * size)  # real pages, not holes: sendfile reads what it would read
    with socket.create_connection((host, port)) as conn:
        left = nbytes
        while left:
            offset = 0
            while offset < min(size, left):
                offset += os.sendfile(conn.fileno(), fd, offset, min(size, left) - offset)
            left -= offset
    os.close(fd)


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        receive(sys.argv[2])
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
