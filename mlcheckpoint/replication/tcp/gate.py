"""The login gate of the TCP listener: connections that have not authenticated yet.

One selector thread accepts every connection, greets it and checks its answer, each with a
deadline; no thread and no session slot is spent on a connection before it has proved it
knows the secret. A stranger that connects and says nothing (slowloris) holds only a socket,
and only until one of these ends it:

- its deadline (``timeout``, a few seconds) passes;
- more than ``per_address`` connections from its address are in the handshake, or more than
  ``max_pending`` in all: the oldest one goes. A partner answers the greeting within a round
  trip, so an idle stranger is always older than a partner's connection: however many idle
  connections a stranger keeps open, the partner's handshake completes. Only a stranger that
  opens ``per_address`` new connections within that round trip could push it out.

Refusals are logged through a rate limiter: a stranger cannot flood the log either.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..._messages import RateLimitedLog
from ...settings import default
from . import protocol as p

ACCEPT_BATCH = 64  # accepts per turn, so pending handshakes are served between bursts

# Called on the gate's thread with a connection that proved it knows the secret, the peer's
# address, and the proof the server still owes it (the callee sends it).
OnLogin = Callable[[socket.socket, tuple, bytes], None]


@dataclass(eq=False)
class _Pending:
    sock: socket.socket
    addr: tuple
    deadline: float
    nonce: bytes
    unsent: bytes  # what is left of the greeting
    got: bytearray = field(default_factory=bytearray)

    @property
    def host(self) -> str:
        return self.addr[0]


class LoginGate:
    """Serves the handshake of every new connection to ``listener`` on one thread."""

    def __init__(self, listener: socket.socket, secret: bytes, on_login: OnLogin, *,
                 logs: RateLimitedLog, timeout: float = default("handshake"), max_pending: int = 256,
                 per_address: int = 64):
        self.listener, self.secret, self.on_login = listener, secret, on_login
        self.logs, self.timeout = logs, timeout
        self.max_pending, self.per_address = max_pending, min(per_address, max_pending)
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._per_host: Counter[str] = Counter()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._closed = threading.Event()
        listener.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="mlckpt-tcp-gate", daemon=True)
        self._thread.start()

    def pending(self) -> int:
        """Connections in the handshake now."""
        return len(self._pending)

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                events = self._sel.select(self._next_wait())
                accept = False
                for key, mask in events:
                    if key.fileobj is self.listener:
                        accept = True
                    elif key.fileobj is self._wake_r:
                        return
                    else:
                        self._advance(key.data, mask)
                if accept:  # after the answers above: a partner's reply beats new arrivals
                    self._accept_some()
                self._expire()
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending)
            self._sel.close()

    def _next_wait(self) -> float:
        if not self._pending:
            return 1.0
        oldest = next(iter(self._pending.values()))  # same timeout for all: oldest ends first
        return min(1.0, max(0.0, oldest.deadline - time.monotonic()))

    def _accept_some(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, or the listener is closed
                if self._closed.is_set():
                    return
                self.logs.log(logging.WARNING, "accept", "replication listener cannot accept: %s", e)
                if self._pending:  # free a descriptor for the next partner
                    self._drop(next(iter(self._pending.values())))
                return
            self._admit(conn, addr)

    def _admit(self, conn: socket.socket, addr: tuple) -> None:
        self._make_room(addr[0])
        hello, nonce = p.greeting()
        conn.setblocking(False)
        pending = _Pending(conn, addr, time.monotonic() + self.timeout, nonce, hello)
        self._pending[conn] = pending
        self._per_host[pending.host] += 1
        self._sel.register(conn, selectors.EVENT_READ | selectors.EVENT_WRITE, pending)

    def _make_room(self, host: str) -> None:
        """Evict the oldest handshake of ``host`` (or of anyone) when a budget is full."""
        if self._per_host[host] >= self.per_address:
            victim = next(q for q in self._pending.values() if q.host == host)
        elif len(self._pending) >= self.max_pending:
            victim = next(iter(self._pending.values()))
        else:
            return
        self.logs.log(logging.WARNING, "evicted", "replication handshakes over budget (%d from "
                      "%s, %d in all): closing the oldest unauthenticated connection", self._per_host[host],
                          host, len(self._pending))
        self._drop(victim)

    def _advance(self, q: _Pending, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE and q.unsent:
                q.unsent = q.unsent[q.sock.send(q.unsent):]
                if not q.unsent:
                    self._sel.modify(q.sock, selectors.EVENT_READ, q)
            if mask & selectors.EVENT_READ:
                part = q.sock.recv(p.CLIENT_REPLY_BYTES - len(q.got))
                if not part:
                    raise p.ProtocolError("closed during the handshake")
                q.got += part
                if len(q.got) == p.CLIENT_REPLY_BYTES:
                    self._login(q)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, p.ProtocolError) as e:
            self._refuse(q, str(e))

    def _login(self, q: _Pending) -> None:
        proof = p.answer_client(self.secret, q.nonce, bytes(q.got))  # ProtocolError: stranger
        self._forget(q)
        try:
            q.sock.setblocking(True)
            self.on_login(q.sock, q.addr, proof)
        except Exception:  # the gate must outlive any one connection
            self.logs.log(logging.ERROR, "login", "replication session for %s failed to start",
                          q.addr, exc_info=True)
            q.sock.close()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                return
            self._refuse(oldest, f"no login within {self.timeout:.0f}s")

    # ------------------------------------------------------------------ endings
    def _refuse(self, q: _Pending, why: str) -> None:
        self.logs.log(logging.WARNING, "refused", "refused replication connection from %s: %s", q.addr, why)
        self._drop(q)

    def _forget(self, q: _Pending) -> None:
        del self._pending[q.sock]
        self._per_host[q.host] -= 1
        if not self._per_host[q.host]:
            del self._per_host[q.host]
        self._sel.unregister(q.sock)

    def _drop(self, q: _Pending) -> None:
        self._forget(q)
        q.sock.close()

    def close(self) -> None:
        """Stop accepting, end every pending handshake (the caller closes the listener)."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        self._wake_r.close()
        self._wake_w.close()

