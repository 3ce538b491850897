"""The serving half of the TCP transport: one authenticated listener per rank.

New connections log in through the gate (``gate.py``); each logged-in connection gets a thread
and a session slot and runs requests, one at a time, through a table of handlers. Shards
leave with sendfile() straight from the tmpfs file (within the node's bandwidth budget when
the request says ``paced``, see ``budget.py``); replicas arrive with recv_into() straight
into the buffer the receive sink gives (``sink.py``), which verifies and commits them.

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
from collections.abc import Callable

from .._ratelimit import RateLimitedLog
from .._words import plural
from ..errors import ShardNotFoundError
from ..settings import MAX_STREAMS
from ..store import LocalStore
from ..store.local_store import ShardSource
from . import protocol as p
from .budget import Budget
from .gate import LoginGate
from .rendezvous import Rendezvous
from .sink import Receipt, ReceiveSink
from .striping import OpenStripes, StripedReceive

# One logger for the TCP transport, server and client alike.
log = logging.getLogger(__package__ + ".tcp")

Handler = Callable[[socket.socket, dict, int], None]


# Cut sessions end at once (their sockets are shut down); a thread still running after this
# is stuck elsewhere, and close stops waiting for it (the manager then keeps the store open).
SESSIONS_JOIN_S = 5.0


class TcpServer:
    """Serves this rank's store to its peers (arguments: see ``TcpTransport``; ``host``: the
    address to listen on, ``budget``: paces what a request asks to be paced)."""

    def __init__(self, store: LocalStore, sink: ReceiveSink, rdzv: Rendezvous, *,
                 host: str, timeout: float, budget: Budget, max_connections: int,
                 max_handshakes: int, max_handshakes_per_address: int, handshake_timeout: float):
        self.store, self.sink, self.rdzv, self.timeout = store, sink, rdzv, timeout
        self.budget = budget
        self.stripes = OpenStripes()  # striped receives awaiting their other stripes
        self.handlers: dict[str, Handler] = {
            "put_shard": self._on_put_shard, "put_part": self._on_put_part,
            "get_shard": self._on_get_shard, "read_items": self._on_read_items,
            "put_metadata": self._on_put_metadata, "get_metadata": self._on_get_metadata}
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
                               timeout=min(handshake_timeout, timeout), max_pending=max_handshakes,
                               per_address=max_handshakes_per_address)

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
                except p.ProtocolError as e:
                    log.warning("replication peer %s: %s", addr, e)
                    return
                self._dispatch(conn, req, addr)
        except (OSError, p.ProtocolError) as e:
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
        step = None
        try:
            handler = self.handlers.get(op) if isinstance(op, str) else None
            if handler is None:
                raise p.ProtocolError(f"unknown operation {str(op)[:100]!r}")
            if req.get("job_id") != self.store.job_id:
                raise p.ProtocolError(f"request for job {str(req.get('job_id'))[:100]!r}")
            step = p.want_int(req, "step", 0, p.MAX_STEP)
            handler(conn, req, step)
        except p.MALFORMED as e:
            # A logged-in peer is a rank of this job: every failure it meets is worth a line
            # (strangers never get here; the login gate rate-limits what they cause).
            log.warning("replication request %.100r of step %s from %s failed: %s", op, step,
                        addr, e)
            with contextlib.suppress(OSError):
                p.send_frame(conn, {"status": "error", "error": str(e)[:2000]})
            raise p.ProtocolError(str(e)) from None

    # ------------------------------------------------------------------ receiving
    def _on_put_shard(self, conn: socket.socket, req: dict, step: int) -> None:
        owner = p.want_int(req, "owner", 0, self.rdzv.world_size)
        m = p.manifest_from_wire(req.get("manifest"), self.store.job_id, step, owner)
        self.sink.check_admitted(m.run_id, step)
        if self.sink.holds(m):
            p.send_frame(conn, {"status": "have"})
            return
        streams = p.want_int(req, "streams", 1, MAX_STREAMS + 1) if "streams" in req else 1
        with self.sink.begin(m) as receipt:
            if streams == 1:
                p.send_frame(conn, {"status": "ready"})
                if m.data_bytes:
                    p.recv_into_exact(conn, receipt.array.data, receipt.landed)
            else:
                self._receive_striped(conn, receipt, streams)
            receipt.commit()
        p.send_frame(conn, {"status": "ok"})
        self.sink.received(m)

    def _receive_striped(self, conn: socket.socket, receipt: Receipt, streams: int) -> None:
        """Stripe 0 on this connection, the others on connections that present the token;
        returns once all have landed."""
        m = receipt.m
        rx = StripedReceive(receipt, streams)
        with self.stripes.opened(rx):
            try:
                p.send_frame(conn, {"status": "ready", "token": rx.token})
                offset, nbytes = rx.stripes[0]
                if nbytes:
                    p.recv_into_exact(conn, rx.array[offset:offset + nbytes].data,
                                      lambda got: receipt.arriving(got, nbytes))
                rx.wait(self.timeout)
            except BaseException:
                rx.cancel()  # no stripe may still write once the buffer goes back to the pool
                raise
        log.debug("received step %d rank %d over %d streams", m.step, m.rank, streams)

    def _on_put_part(self, conn: socket.socket, req: dict, step: int) -> None:
        index = p.want_int(req, "index", 1, MAX_STREAMS)
        rx = self.stripes.find(req.get("token"), step, req.get("owner"))
        offset, nbytes = rx.claim(index, conn)
        try:
            p.send_frame(conn, {"status": "ready"})
            if nbytes:
                p.recv_into_exact(conn, rx.array[offset:offset + nbytes].data,
                                  lambda got: rx.receipt.arriving(got, nbytes))
        except BaseException as e:
            rx.errors[index] = e
            raise
        finally:
            rx.done[index].set()

    def _on_put_metadata(self, conn: socket.socket, req: dict, step: int) -> None:
        nbytes = p.want_int(req, "nbytes", 1, p.MAX_METADATA_BYTES)
        if self.sink.holds_metadata(step, req.get("checksum")):
            p.send_frame(conn, {"status": "have"})
            return
        p.send_frame(conn, {"status": "ready"})
        self.sink.commit_metadata(step, p.recv_growing(conn, nbytes), offered=True)
        p.send_frame(conn, {"status": "ok"})

    # ------------------------------------------------------------------ serving
    def _open_or_missing(self, conn: socket.socket, step: int, owner: int) -> ShardSource | None:
        """The shard to serve (its data file checked whole), or None once "missing" is sent."""
        try:
            return self.store.open_shard(step, owner)
        except ShardNotFoundError:
            p.send_frame(conn, {"status": "missing"})
            return None

    def _send_file(self, conn: socket.socket, fd: int, offset: int, nbytes: int,
                   paced: bool) -> None:
        """A range of a shard file: within the node's budget when the requester asked for it
        (a heal), at the link's speed when not (a resume waits for these bytes)."""
        if paced:
            self.budget.sendfile(conn, fd, offset, nbytes)
        else:
            p.sendfile_all(conn, fd, offset, nbytes)

    def _on_get_shard(self, conn: socket.socket, req: dict, step: int) -> None:
        owner = p.want_int(req, "owner", 0, 1 << 20)
        paced = p.want_bool(req, "paced")
        with self.sink.pins.pinned(step):
            source = self._open_or_missing(conn, step, owner)
            if source is None:
                return
            with source:  # sent from the open file: a shard only served needs no mapping here
                p.send_frame(conn, {"status": "ok", "manifest": source.manifest.to_dict()})
                if source.manifest.data_bytes:
                    self._send_file(conn, source.fd, 0, source.manifest.data_bytes, paced)

    def _on_read_items(self, conn: socket.socket, req: dict, step: int) -> None:
        owner = p.want_int(req, "owner", 0, 1 << 20)
        paced = p.want_bool(req, "paced")
        ranges = req.get("ranges")
        if not isinstance(ranges, list) or len(ranges) > p.MAX_RANGES:
            raise p.ProtocolError("malformed ranges")
        with self.sink.pins.pinned(step):
            source = self._open_or_missing(conn, step, owner)
            if source is None:
                return
            with source:
                checked = p.checked_ranges(ranges, source.manifest.data_bytes)
                p.send_frame(conn, {"status": "ok"})
                for offset, nbytes in checked:
                    self._send_file(conn, source.fd, offset, nbytes, paced)

    def _on_get_metadata(self, conn: socket.socket, req: dict, step: int) -> None:
        paced = p.want_bool(req, "paced")
        try:
            raw = self.store.read_metadata_file(step)
        except ShardNotFoundError:
            p.send_frame(conn, {"status": "missing"})
            return
        p.send_frame(conn, {"status": "ok", "nbytes": len(raw)})
        if paced:
            self.budget.sendall(conn, raw)
        else:
            conn.sendall(raw)

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
