"""Striping one shard over several TCP streams: where the cuts go, and the receiver's record of
a transfer whose stripes arrive on separate connections (see ``transport.py`` for the protocol;
the streams run through ``core/streams.run_streams``).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import secrets
import socket
import threading
import time
from collections.abc import Iterator

from ..core.sink import Receipt
from . import protocol as p


def stripes(nbytes: int, streams: int) -> list[tuple[int, int]]:
    """(offset, length) of each stream's part of a shard: contiguous, 64-byte aligned cuts."""
    cuts = [0] + [min(nbytes, (nbytes * i // streams) // 64 * 64) for i in range(1, streams)] + [nbytes]
    return [(a, b - a) for a, b in itertools.pairwise(cuts)]


def packed_slices(ranges: list[tuple[int, int]], start: int, length: int) -> list[tuple[int, int]]:
    """The (offset, nbytes) pieces of the shard that bytes [start, start + length) of the
    stream of ``ranges`` (its held ranges, one after the other) are: a stripe of a partial
    replica covers parts of several items' ranges."""
    out, pos, end = [], 0, start + length
    for offset, nbytes in ranges:
        lo, hi = max(start, pos), min(end, pos + nbytes)
        if hi > lo:
            out.append((offset + lo - pos, hi - lo))
        pos += nbytes
        if pos >= end:
            break
    return out


def stream_parts(ranges: list[tuple[int, int]], streams: int) -> list[list[tuple[int, int]]]:
    """What each of ``streams`` streams carries of a shard whose held ``ranges`` are sent:
    the pieces of each one's stripe of the ranges laid end to end (see ``stripes``)."""
    total = sum(n for _, n in ranges)
    return [packed_slices(ranges, start, n) for start, n in stripes(total, streams)]


class StripedReceive:
    """A shard arriving over several connections: stripe 0 on the offering connection, the
    others on connections that present ``token``."""

    def __init__(self, receipt: Receipt, streams: int):
        # Every stripe reports its progress to the receipt (a test may stop the receiver at
        # half of any stream: whichever stripe the sender gets furthest on first).
        self.receipt, self.array, self.m = receipt, receipt.array, receipt.m
        self.stripes = stream_parts(receipt.ranges, streams)  # each stream's pieces
        self.token = secrets.token_hex(16)
        self.lock = threading.Lock()
        self.cancelled = False
        self.conns: dict[int, socket.socket] = {}
        self.done = [threading.Event() for _ in self.stripes]
        self.errors: list[BaseException | None] = [None] * len(self.stripes)

    def claim(self, index: int, conn: socket.socket) -> list[tuple[int, int]]:
        with self.lock:
            if self.cancelled or index in self.conns or not 0 < index < len(self.stripes):
                raise p.ProtocolError(f"stripe {index} of transfer is not open")
            self.conns[index] = conn
        return self.stripes[index]

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for i, ev in enumerate(self.done[1:], 1):
            if not ev.wait(max(0.0, deadline - time.monotonic())):
                raise p.ProtocolError(f"stripe {i} of step {self.m.step} rank {self.m.rank} "
                                      f"did not arrive within {timeout:.0f}s")
            if self.errors[i] is not None:
                raise p.ProtocolError(f"stripe {i} failed: {self.errors[i]}")

    def abort(self) -> None:
        """Fail every stripe that has not connected yet, so that ``wait`` returns now (the
        listener is closing; the connected ones end with their connections)."""
        with self.lock:
            self.cancelled = True
            unclaimed = [i for i in range(1, len(self.stripes)) if i not in self.conns]
        for i in unclaimed:
            self.errors[i] = p.ProtocolError("the listener closed")
            self.done[i].set()

    def cancel(self) -> None:
        """Stop every stripe still arriving and wait until none writes into the buffer."""
        with self.lock:
            self.cancelled = True
            conns = dict(self.conns)
        for conn in conns.values():
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for i in conns:
            self.done[i].wait()


class OpenStripes:
    """The striped receives of one listener still awaiting stripes, by token."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, StripedReceive] = {}
        self._landed: collections.Counter[int] = collections.Counter()  # stream count -> transfers

    @contextlib.contextmanager
    def opened(self, rx: StripedReceive) -> Iterator[StripedReceive]:
        """``rx`` takes stripes while the block runs."""
        with self._lock:
            self._open[rx.token] = rx
        try:
            yield rx
        finally:
            with self._lock:
                self._open.pop(rx.token, None)
        with self._lock:  # only once the block went through: every stripe landed
            self._landed[len(rx.stripes)] += 1

    def abort_all(self) -> None:
        """``abort`` every open transfer (the listener is closing)."""
        with self._lock:
            transfers = list(self._open.values())
        for rx in transfers:
            rx.abort()

    def landed(self) -> dict[int, int]:
        """How many striped receives had every stripe land, by their number of streams."""
        with self._lock:
            return dict(self._landed)

    def find(self, token: object, step: int, owner: object) -> StripedReceive:
        """The open transfer a stripe names; ProtocolError for any other."""
        with self._lock:
            rx = self._open.get(token) if isinstance(token, str) else None
        if rx is None or rx.m.step != step or owner != rx.m.rank:
            raise p.ProtocolError("stripe for a transfer that is not open")
        return rx

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)
