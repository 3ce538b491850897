"""The processes of bench_pacing.py, one role each, run inside a NetCluster's nodes.

    pacing_peer.py serve HOST                          prints "ready <port>"; answers exchanges
    pacing_peer.py exchange HOST PORT NBYTES GAP_S SECONDS
    pacing_peer.py paced HOST PORT SECONDS adaptive|fixed

serve/exchange: a stand-in for a training step's collectives, without the CPU work of a
model: every GAP_S seconds both nodes send each other NBYTES at once over one TCP connection
(as a ring all-reduce of two ranks does); prints the seconds each exchange took, as JSON.
paced: replication's sender, ``Budget.sendfile`` from a memory file through the node's default
budget (``node_budget("auto", "eth0")``, adaptive or fixed pacing) to a ``_tcp_peer.py recv``,
for SECONDS; prints "ready" once connected, then {"bytes_per_s", "yields"} as JSON.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


def _read_exactly(conn: socket.socket, buf: bytearray, nbytes: int) -> None:
    view = memoryview(buf)
    while nbytes:
        got = conn.recv_into(view, min(len(buf), nbytes))
        if not got:
            raise ConnectionError("peer closed mid-exchange")
        nbytes -= got


def _swap(conn: socket.socket, data: bytes, buf: bytearray) -> None:
    """Send ``data`` while receiving as many bytes."""
    reader = threading.Thread(target=_read_exactly, args=(conn, buf, len(data)))
    reader.start()
    conn.sendall(data)
    reader.join()


def serve(host: str) -> None:
    with socket.create_server((host, 0)) as server:
        print("ready", server.getsockname()[1], flush=True)
        conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(1 << 20)
    with conn:
        while header := conn.recv(8, socket.MSG_WAITALL):
            _swap(conn, b"\0" * int.from_bytes(header, "little"), buf)


def exchange(host: str, port: str, nbytes: str, gap: str, seconds: str) -> None:
    data, buf, took = b"\0" * int(nbytes), bytearray(1 << 20), []
    with socket.create_connection((host, int(port))) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        end = time.monotonic() + float(seconds)
        while time.monotonic() < end:
            t0 = time.monotonic()
            conn.sendall(len(data).to_bytes(8, "little"))
            _swap(conn, data, buf)
            took.append(time.monotonic() - t0)
            time.sleep(float(gap))
    print(json.dumps(took), flush=True)


def paced(host: str, port: str, seconds: str, pacing: str) -> None:
    from mlcheckpoint.replication.core.budget import node_budget

    budget = node_budget("auto", "eth0", None, adaptive=pacing == "adaptive")
    fd = os.memfd_create("pacing-peer")
    piece = 8 << 20
    os.write(fd, b"\x5a" * piece)
    sent = 0
    with socket.create_connection((host, int(port))) as sock:
        print("ready", flush=True)
        t0 = time.monotonic()
        end = t0 + float(seconds)
        while time.monotonic() < end:
            budget.sendfile(sock, fd, 0, piece)
            sent += piece
        elapsed = time.monotonic() - t0
    print(json.dumps({"bytes_per_s": sent / elapsed, "yields": budget.yields}), flush=True)


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    roles: dict[str, Callable[..., None]] = {"serve": serve, "exchange": exchange, "paced": paced}
    roles[role](*args)
