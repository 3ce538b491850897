"""Worker: send over a real TCP connection through an adaptive Budget, recording its rate.

    paced_sender.py HOST PORT SECONDS CEILING START

Connects to HOST:PORT (a ``_tcp_peer.py recv``), sends from a memory file with
``Budget.sendfile`` for SECONDS (the budget's ceiling and start rate in bytes/s; yielding,
adaptive, its own schedule), and samples ``Budget.current_rate()`` every 10 ms. Prints
"ready" once connected, then at the end one JSON line: {"samples": [[CLOCK_MONOTONIC seconds, bytes/s], ...], "sent": bytes}. Standard
library and mlcheckpoint only: no torch.
"""

import json
import os
import socket
import sys
import threading
import time

from mlcheckpoint.replication.core.budget import Budget


def main() -> None:
    host, port, seconds, ceiling, start = sys.argv[1:6]
    budget = Budget(int(ceiling), None, yielding=True, adaptive=True, start=int(start))
    fd = os.memfd_create("paced-sender")
    piece = 8 << 20
    os.write(fd, b"\x5a" * piece)
    samples: list[list[float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            samples.append([time.monotonic(), budget.current_rate()])

    sent = 0
    with socket.create_connection((host, int(port))) as sock:
        print("ready", flush=True)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        end = time.monotonic() + float(seconds)
        while time.monotonic() < end:
            budget.sendfile(sock, fd, 0, piece)
            sent += piece
    done.set()
    sampler.join()
    print(json.dumps({"samples": samples, "sent": sent}), flush=True)


if __name__ == "__main__":
    main()
