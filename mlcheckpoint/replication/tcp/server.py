"""The serving half of the TCP transport: one authenticated listener per rank.

New connections log in through the gate (``gate.py``); each logged-in connection gets a thread
and a session slot and runs requests, one at a time: the request service
(``core/service.py``) answers them, through a ``Connection`` that carries the answers and the
bytes over this socket. Shards leave with sendfile() straight from the tmpfs file (within the
node's bandwidth budget when the request says ``paced``, see ``core/budget.py``); replicas
arrive with recv_into() straight into the buffer the receive sink gives (``core/sink.py``).

A striped push (see ``striping.py``): the offer names the stream count, the answer carries a
one-time token, and the sender's other connections each present the token and a stripe index
(``put_part``). The offering connection verifies and commits once every stripe has landed, and
on any failure stops the other stripes before it gives the buffer back.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

from ..._faults import crash_point
from ..._messages import RateLimitedLog, plural
from ...settings import MAX_STREAMS, Timeouts
from ...store import LocalStore
from ...store.local_store import ShardSource
from ..core.budget import Budget, sendfile_all
from ..core.checks import (
    MALFORMED,
    MAX_ERROR_TEXT,
    MAX_METADATA_BYTES,
    ProtocolError,
    want_int,
)
from ..core.rendezvous import Rendezvous
from ..core.service import RequestService
from ..core.sink import Receipt, ReceiveSink
from . import protocol as p
from .gate import LoginGate
from .striping import OpenStripes, StripedReceive

# One logger for the TCP transport, server and client alike.
log = logging.getLogger(__package__)

# Cut sessions end at once (their sockets are shut down); a thread still running after this
# is stuck elsewhere, and close stops waiting for it (the manager then keeps the store open).
SESSIONS_JOIN_S = 5.0
# Authenticated connections served at once: a striped push or read takes ``streams`` of them,
# and after a resharding many ranks may read from one. (Connections still in the handshake
# have budgets of their own, in the login gate: ``gate.py``.)
MAX_CONNECTIONS = 128


class TcpServer:
    """Serves this rank's store to its peers (arguments: see ``TcpTransport``; ``host``: the
    address to listen on, ``budget``: paces what a request asks to be paced)."""

    def __init__(self, store: LocalStore, sink: ReceiveSink, rdzv: Rendezvous, *,
                 host: str, timeouts: Timeouts, budget: Budget,
                 max_connections: int = MAX_CONNECTIONS):
        self.store, self.sink, self.rdzv = store, sink, rdzv
        self.timeout = timeout = timeouts.replication
        self.budget = budget
        self.stripes = OpenStripes()  # striped receives awaiting their other stripes
        self.service = RequestService(store, sink, rdzv.world_size)
        # Anything a peer or a stranger can make happen at will is logged through this.
        self.logs = RateLimitedLog(log)
        self._slots = threading.BoundedSemaphore(max_connections)  # authenticated sessions
        self._closed = threading.Event()
        # Open sessions, so that close can end them and join their threads before the store's
        # mappings they write into go away.
        self._sessions: dict[socket.socket, threading.Thread] = {}
        self._sessions_lock = threading.Lock()
        self._listener = socket.create_server((host, 0), backlog=256)
        host_bound, port = self._listener.getsockname()[:2]
        self.address = f"{host_bound}:{port}"
        # Unauthenticated connections never take a session slot or a thread: one gate thread
        # serves their handshakes, with its own budgets and a short deadline.
        self._gate = LoginGate(self._listener, rdzv.secret(), self._start_session, logs=self.logs,
                               timeout=min(timeouts.handshake, timeout))

    # ------------------------------------------------------------------ sessions
    def _start_session(self, conn: socket.socket, addr: tuple, proof: bytes) -> None:
        """A connection logged in (on the gate's thread): serve it on a thread of its own."""
        if not self._slots.acquire(blocking=False):
            self.logs.log(logging.WARNING, "full",
                          "refusing replication connection from %s: too many open", addr)
            conn.close()
            return
        thread = threading.Thread(target=self._serve, args=(conn, addr, proof), daemon=True,
                                  name="mlckpt-tcp-conn")
        with self._sessions_lock:
            if self._closed.is_set():  # logged in while close ran: close ends nothing it missed
                conn.close()
                self._slots.release()
                return
            self._sessions[conn] = thread
        thread.start()

    def _serve(self, conn: socket.socket, addr: tuple, proof: bytes) -> None:
        try:
            p.use_kernel_timeouts(conn, self.timeout)
            conn.sendall(proof)
            while not self._closed.is_set():
                try:
                    req = p.recv_frame(conn)
                except p.PeerClosed as e:
                    if e.got:  # else the client hung up between requests: it is done
                        log.warning("replication peer %s: %s", addr, e)
                    return
                except ProtocolError as e:
                    log.warning("replication peer %s: %s", addr, e)
                    return
                self._dispatch(conn, req, addr)
        except (OSError, ProtocolError) as e:
            if self._closed.is_set():  # close cut the session: what failed is expected
                log.debug("replication connection from %s ended by close: %s", addr, e)
            else:
                log.warning("replication connection from %s failed: %s", addr, e)
        except Exception:  # a bug: say so, but keep the listener's other sessions alive
            self.logs.log(logging.ERROR, "bug", "replication connection from %s failed", addr,
                          exc_info=True)
        finally:
            with self._sessions_lock:
                self._sessions.pop(conn, None)
            conn.close()
            self._slots.release()

    def _dispatch(self, conn: socket.socket, req: dict, addr: tuple) -> None:
        """Run one request; anything malformed in it is answered with an error frame, after
        which the connection is closed (ProtocolError)."""
        op = req.get("op")
        try:
            if op == "put_part":  # a stripe of a striped push: this wire's own request
                self._on_put_part(conn, req, self.service.step_of(req))
            else:
                streams = want_int(req, "streams", 1, MAX_STREAMS + 1) if "streams" in req else 1
                self.service.answer(req, Connection(self, conn, streams))
        except MALFORMED as e:
            # A logged-in peer is a rank of this job: every failure it meets is worth a line
            # (strangers never get here; the login gate rate-limits what they cause).
            log.warning("replication request %.100r of step %.20s from %s failed: %s", op,
                        req.get("step"), addr, e)
            with contextlib.suppress(OSError):
                p.send_frame(conn, {"status": "error", "error": str(e)[:MAX_ERROR_TEXT]})
            raise ProtocolError(str(e)) from None

    # ------------------------------------------------------------------ receiving
    def _receive_striped(self, conn: socket.socket, receipt: Receipt, streams: int) -> None:
        """Stripe 0 on this connection, the others on connections that present the token;
        returns once all have landed."""
        m = receipt.m
        rx = StripedReceive(receipt, streams)
        with self.stripes.opened(rx):
            try:
                p.send_frame(conn, {"status": "ready", "token": rx.token})
                pieces = rx.stripes[0]
                nbytes = sum(n for _, n in pieces)
                p.recv_pieces(conn, rx.array, pieces, lambda got: receipt.arriving(got, nbytes))
                rx.wait(self.timeout)
            except BaseException:
                rx.cancel()  # no stripe may still write once the buffer goes back to the pool
                raise
        log.debug("received step %d rank %d over %d streams", m.step, m.rank, streams)

    def _on_put_part(self, conn: socket.socket, req: dict, step: int) -> None:
        index = want_int(req, "index", 1, MAX_STREAMS)
        rx = self.stripes.find(req.get("token"), step, req.get("owner"))
        pieces = rx.claim(index, conn)
        nbytes = sum(n for _, n in pieces)
        try:
            p.send_frame(conn, {"status": "ready"})
            p.recv_pieces(conn, rx.array, pieces, lambda got: rx.receipt.arriving(got, nbytes))
        except BaseException as e:
            rx.errors[index] = e
            raise
        finally:
            rx.done[index].set()

    def close(self) -> bool:
        """Stop accepting, cut every open session (a receive in flight is dropped, as when
        its sender dies) and join the session threads for at most SESSIONS_JOIN_S seconds.
        True when none is left running."""
        self._closed.set()
        self._gate.close()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._sessions_lock:
            sessions = list(self._sessions.items())
        for conn, _ in sessions:
            with contextlib.suppress(OSError):  # wakes a thread blocked on it
                conn.shutdown(socket.SHUT_RDWR)
        self.stripes.abort_all()  # wakes a thread waiting for stripes that never came
        deadline = time.monotonic() + SESSIONS_JOIN_S
        for _, thread in sessions:
            thread.join(max(0.0, deadline - time.monotonic()))
        running = sum(thread.is_alive() for _, thread in sessions)
        if running:
            log.warning("replication listener closed with %s still running after %.0fs",
                        plural(running, "session thread"), SESSIONS_JOIN_S)
        return running == 0


class Connection:
    """One request's way back over a logged-in connection (the service's ``Channel``)."""

    def __init__(self, server: TcpServer, conn: socket.socket, streams: int):
        self.server, self.conn = server, conn
        self.streams = streams  # what a put_shard offer said it will send over

    def answer(self, reply: dict) -> None:
        p.send_frame(self.conn, reply)

    def receive_shard(self, receipt: Receipt) -> None:
        if self.streams > 1:
            self.server._receive_striped(self.conn, receipt, self.streams)
            return
        p.send_frame(self.conn, {"status": "ready"})
        for offset, view in receipt.views():  # (a partial replica: its items' ranges)
            p.recv_into_exact(self.conn, view, receipt.landed_from(offset))

    def send_shard(self, reply: dict, source: ShardSource, ranges: list[tuple[int, int]],
                   paced: bool) -> None:
        """Sent from the open file: a shard only served needs no mapping here; within the
        node's budget when the requester asked for it (a heal), at the link's speed when not
        (a resume waits for these bytes)."""
        p.send_frame(self.conn, reply)
        crash_point("serve_mid_read", source.manifest.step, source.manifest.rank)
        for offset, nbytes in ranges:
            if not nbytes:
                continue
            if paced:
                self.server.budget.sendfile(self.conn, source.fd, offset, nbytes)
            else:
                sendfile_all(self.conn, source.fd, offset, nbytes)

    def receive_metadata(self, req: dict) -> bytes:
        nbytes = want_int(req, "nbytes", 1, MAX_METADATA_BYTES)
        p.send_frame(self.conn, {"status": "ready"})
        return p.recv_growing(self.conn, nbytes)

    def send_metadata(self, reply: dict, raw: bytes, paced: bool) -> None:
        p.send_frame(self.conn, {**reply, "nbytes": len(raw)})
        if paced:
            self.server.budget.sendall(self.conn, raw)
        else:
            self.conn.sendall(raw)
