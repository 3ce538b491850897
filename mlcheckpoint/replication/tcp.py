"""TCP transport: one authenticated listener per rank, one connection per operation.

Payloads leave with sendfile() straight from the tmpfs file and arrive with recv_into()
straight into the destination mapping: no user-space copy on either side.

A large shard can go over several streams (``streams``): one TCP stream often cannot fill a
fast link. The receiver answers the offer with a one-time token; the sender opens the other
connections (each authenticated like any other) and names the token and its stripe on each.
The receiver verifies and commits only once every stripe has landed, and on any failure
stops the other stripes before it gives the buffer back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections import Counter
from typing import Callable

from .._faults import crash_point
from .._ratelimit import RateLimitedLog
from ..errors import ConfigError, CorruptShardError, MLCheckpointError, ShardNotFoundError
from ..store import LocalStore, Manifest
from ..store.checksum import StreamingChecksum, checksum
from ..store.local_store import ShardSource
from . import protocol as p
from .gate import LoginGate
from .protocol import manifest_from_wire
from .rendezvous import Rendezvous
from .striping import (MAX_STREAMS, StripedReceive, default_min_stripe_bytes, default_streams,
                       run_streams, split_evenly, stripes, verify_landed)
from .transport import OnReceived, Pins, ReplicationError, Transport

log = logging.getLogger(__name__)

MAX_METADATA_BYTES = 4 << 30
MAX_STEP = 10**12
MAX_RANGES = 1 << 20
# What a malformed request can raise in a handler: answered with an error frame, never left to
# kill the connection's thread.
MALFORMED = p.MALFORMED


def default_host() -> str:
    """The local address that routes to MASTER_ADDR: peers can reach us there (no packet sent)."""
    host = os.environ.get("MLCHECKPOINT_REPLICATION_HOST")
    if host:
        return host
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class StreamingVerifier:
    """Hashes each item as its bytes arrive (cache-hot), so no checksum pass trails the
    transfer; ``check`` raises CorruptShardError naming the first bad item."""

    def __init__(self, array, m: Manifest):
        self.array, self.m = array, m
        self.items = sorted(m.items, key=lambda it: it.offset)
        self.i, self.done, self.bad = 0, 0, None
        self.h = StreamingChecksum() if self.items else None

    def feed(self, upto: int) -> None:
        while self.i < len(self.items):
            it = self.items[self.i]
            start, stop = max(self.done, it.offset), min(upto, it.offset + it.nbytes)
            if stop > start:
                self.h.update(self.array[start:stop])
                self.done = stop
            if upto < it.offset + it.nbytes:
                return
            if self.h.digest() != it.checksum and self.bad is None:
                self.bad = it
            self.i += 1
            if self.i < len(self.items):
                self.h = StreamingChecksum()

    def check(self) -> None:
        self.feed(self.m.data_bytes)
        if self.bad is not None:
            raise CorruptShardError(f"replica of step {self.m.step} rank {self.m.rank}: checksum "
                                    f"mismatch in {self.bad.key!r} on arrival")


def receive_shard(sock: socket.socket, store: LocalStore, m: Manifest) -> None:
    """Receive ``m.data_bytes`` into a new buffer for (step, owner), verify, commit."""
    shard = store.begin_shard(m.step, m.rank, m.data_bytes)
    try:
        half = m.data_bytes // 2
        verifier = StreamingVerifier(shard.buffer.array, m)

        def progress(got: int, total: int) -> None:
            verifier.feed(got)
            if got >= half:
                crash_point("replica_mid_recv", m.step, m.rank)

        if m.data_bytes:
            p.recv_into_exact(sock, memoryview(shard.buffer.array), progress)
        verifier.check()
        shard.commit_manifest(m)
    except BaseException:
        shard.abort()
        raise


def send_range(sock: socket.socket, fd: int, offset: int, nbytes: int, m: Manifest) -> None:
    """Send one stream's range of a shard file (a test can SIGKILL the sender half way)."""
    half = nbytes // 2
    p.sendfile_all(sock, fd, offset, half)
    crash_point("replica_mid_send", m.step, m.rank)
    p.sendfile_all(sock, fd, offset + half, nbytes - half)


def same_shard(a: Manifest, b: Manifest) -> bool:
    """Whether a held replica is the offered one: the same save (a step saved again is a new
    save, even with equal bytes) and the same bytes."""
    return a.save_id == b.save_id and a.data_bytes == b.data_bytes and [(i.offset, i.nbytes, i.checksum) for i in a.items] == \
        [(i.offset, i.nbytes, i.checksum) for i in b.items]


class TcpTransport(Transport):
    """Serves this rank's store to peers and pushes/pulls shards to/from theirs.

    Args:
        store: this node's store.
        rdzv: the job's rendezvous (secret and peer addresses).
        host: interface to listen on (default: the one that routes to MASTER_ADDR).
        timeout: seconds any single socket operation may block.
        max_shard_bytes: largest shard a peer may send us (checked before allocating).
        max_connections: authenticated connections served at once; a striped push or read
            takes ``streams`` of them, and after a resharding many ranks may read from one.
        max_handshakes, max_handshakes_per_address: connections in the handshake at once, in
            all and from one address; beyond either, the oldest is closed (see ``gate.py``).
        handshake_timeout: seconds a connection may take to authenticate.
        streams: connections a large shard is pushed over (default ``default_streams()``).
        min_stripe_bytes: the least a stream carries, so small shards use fewer streams
            (default ``default_min_stripe_bytes()``).
    """

    name = "tcp"

    def __init__(self, store: LocalStore, rdzv: Rendezvous, *, host: str | None = None,
                 timeout: float = 60.0, pins: Pins | None = None,
                 on_received: OnReceived | None = None, max_shard_bytes: int = 1 << 40,
                 max_connections: int = 128, max_handshakes: int = 256,
                 max_handshakes_per_address: int = 64, handshake_timeout: float = 5.0,
                 streams: int | None = None, min_stripe_bytes: int | None = None):
        self.store, self.rdzv = store, rdzv
        self.streams = streams if streams is not None else default_streams()
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ConfigError(f"streams must be in 1..{MAX_STREAMS}, not {self.streams}")
        self.min_stripe_bytes = min_stripe_bytes or default_min_stripe_bytes()
        self._striped: dict[str, StripedReceive] = {}  # token -> transfer awaiting its stripes
        self._striped_lock = threading.Lock()
        self.timeout = timeout
        self.pins = pins or Pins()
        self.on_received = on_received
        self.max_shard_bytes = max_shard_bytes
        self.secret = rdzv.secret()
        # Anything a peer or a stranger can make happen at will is logged through this.
        self.logs = RateLimitedLog(log)
        self._slots = threading.BoundedSemaphore(max_connections)  # authenticated sessions
        self._closed = threading.Event()
        self._listener = socket.create_server((host or default_host(), 0), backlog=256)
        self.address = "%s:%d" % self._listener.getsockname()[:2]
        # Unauthenticated connections never take a session slot or a thread: one gate thread
        # serves their handshakes, with its own budgets and a short deadline.
        self._gate = LoginGate(self._listener, self.secret, self._start_session, logs=self.logs,
                               timeout=min(handshake_timeout, timeout), max_pending=max_handshakes,
                               per_address=max_handshakes_per_address)
        rdzv.publish("tcp", self.address)
        log.debug("replication listener of rank %d on %s", rdzv.rank, self.address)

    # ------------------------------------------------------------------ server
    def _start_session(self, conn: socket.socket, addr, proof: bytes) -> None:
        """A connection logged in (on the gate's thread): serve it on a thread of its own."""
        if not self._slots.acquire(blocking=False):
            self.logs.warning("full", "refusing replication connection from %s: too many open", addr)
            conn.close()
            return
        threading.Thread(target=self._serve, args=(conn, addr, proof), daemon=True,
                         name="mlckpt-tcp-conn").start()

    def _serve(self, conn: socket.socket, addr, proof: bytes) -> None:
        try:
            p.use_kernel_timeouts(conn, self.timeout)
            conn.sendall(proof)
            while not self._closed.is_set():
                try:
                    req = p.recv_frame(conn)
                except p.ProtocolError as e:
                    if "closed after 0 of" not in str(e):
                        log.warning("replication peer %s: %s", addr, e)
                    return
                self._dispatch(conn, req, addr)
        except (OSError, p.ProtocolError) as e:
            log.warning("replication connection from %s failed: %s", addr, e)
        except Exception:  # a bug: say so, but keep the listener's other sessions alive
            self.logs.log(logging.ERROR, "bug", "replication connection from %s failed", addr,
                          exc_info=True)
        finally:
            conn.close()
            self._slots.release()

    def _dispatch(self, conn: socket.socket, req: dict, addr) -> None:
        """Run one request; anything malformed in it is answered with an error frame, after
        which the connection is closed (ProtocolError)."""
        handlers = {"put_shard": self._on_put_shard, "get_shard": self._on_get_shard,
                    "read_items": self._on_read_items, "put_part": self._on_put_part,
                    "put_metadata": self._on_put_metadata, "get_metadata": self._on_get_metadata}
        op = req.get("op")
        step = None
        try:
            handler = handlers.get(op) if isinstance(op, str) else None
            if handler is None:
                raise p.ProtocolError(f"unknown operation {str(op)[:100]!r}")
            if req.get("job_id") != self.store.job_id:
                raise p.ProtocolError(f"request for job {str(req.get('job_id'))[:100]!r}")
            step = p.want_int(req, "step", 0, MAX_STEP)
            handler(conn, req, step)
        except MALFORMED as e:
            # A logged-in peer is a rank of this job: every failure it meets is worth a line
            # (strangers never get here; the login gate rate-limits what they cause).
            log.warning("replication request %.100r of step %s from %s failed: %s", op, step,
                        addr, e)
            with contextlib.suppress(OSError):
                p.send_frame(conn, {"status": "error", "error": str(e)[:2000]})
            raise p.ProtocolError(str(e)) from None

    def _on_put_shard(self, conn: socket.socket, req: dict, step: int) -> None:
        owner = p.want_int(req, "owner", 0, self.rdzv.world_size)
        m = manifest_from_wire(req.get("manifest"), self.store.job_id, step, owner)
        p.check_offer(m, self.max_shard_bytes)
        self.check_admitted(m.run_id, step)
        with contextlib.suppress(MLCheckpointError):
            if same_shard(self.store.read_manifest(step, owner), m):
                p.send_frame(conn, {"status": "have"})
                return
        streams = p.want_int(req, "streams", 1, MAX_STREAMS + 1) if "streams" in req else 1
        if streams == 1:
            p.send_frame(conn, {"status": "ready"})
            receive_shard(conn, self.store, m)
        else:
            self._receive_striped(conn, m, streams)
        p.send_frame(conn, {"status": "ok"})
        if self.on_received is not None:
            self.on_received(step, owner)

    def _receive_striped(self, conn: socket.socket, m: Manifest, streams: int) -> None:
        shard = self.store.begin_shard(m.step, m.rank, m.data_bytes)
        rx = StripedReceive(shard.buffer.array, m, streams)
        with self._striped_lock:
            self._striped[rx.token] = rx
        try:
            p.send_frame(conn, {"status": "ready", "token": rx.token})
            offset, nbytes = rx.stripes[0]
            half = nbytes // 2

            def progress(got: int, total: int) -> None:
                if got >= half:
                    crash_point("replica_mid_recv", m.step, m.rank)

            if nbytes:
                p.recv_into_exact(conn, memoryview(rx.array[offset:offset + nbytes]), progress)
            rx.wait(self.timeout)
            verify_landed(rx.array, m)
            shard.commit_manifest(m)
            log.debug("received step %d rank %d over %d streams", m.step, m.rank, streams)
        except BaseException:
            rx.cancel()  # no stripe may still write once the buffer goes back to the pool
            shard.abort()
            raise
        finally:
            with self._striped_lock:
                self._striped.pop(rx.token, None)

    def _on_put_part(self, conn: socket.socket, req: dict, step: int) -> None:
        index = p.want_int(req, "index", 1, MAX_STREAMS)
        with self._striped_lock:
            rx = self._striped.get(req.get("token")) if isinstance(req.get("token"), str) else None
        if rx is None or rx.m.step != step or req.get("owner") != rx.m.rank:
            raise p.ProtocolError("stripe for a transfer that is not open")
        offset, nbytes = rx.claim(index, conn)
        try:
            p.send_frame(conn, {"status": "ready"})
            if nbytes:
                p.recv_into_exact(conn, memoryview(rx.array[offset:offset + nbytes]))
        except BaseException as e:
            rx.errors[index] = e
            raise
        finally:
            rx.done[index].set()

    def _open_or_missing(self, conn: socket.socket, step: int, owner: int) -> ShardSource | None:
        """The shard to serve (its data file checked whole), or None once "missing" is sent."""
        try:
            return self.store.open_shard(step, owner)
        except ShardNotFoundError:
            p.send_frame(conn, {"status": "missing"})
            return None

    def _on_get_shard(self, conn: socket.socket, req: dict, step: int) -> None:
        owner = p.want_int(req, "owner", 0, 1 << 20)
        with self.pins.pinned(step):
            source = self._open_or_missing(conn, step, owner)
            if source is None:
                return
            with source:  # sent from the open file: a shard only served needs no mapping here
                p.send_frame(conn, {"status": "ok", "manifest": source.manifest.to_dict()})
                if source.manifest.data_bytes:
                    p.sendfile_all(conn, source.fd, 0, source.manifest.data_bytes)

    def _on_read_items(self, conn: socket.socket, req: dict, step: int) -> None:
        owner = p.want_int(req, "owner", 0, 1 << 20)
        ranges = req.get("ranges")
        if not isinstance(ranges, list) or len(ranges) > MAX_RANGES:
            raise p.ProtocolError("malformed ranges")
        with self.pins.pinned(step):
            source = self._open_or_missing(conn, step, owner)
            if source is None:
                return
            with source:
                checked = []
                for r in ranges:
                    if (not isinstance(r, list) or len(r) != 2 or not all(isinstance(x, int) for x in r)
                            or r[0] < 0 or r[1] < 0 or r[0] + r[1] > source.manifest.data_bytes):
                        raise p.ProtocolError(f"range {r!r} outside the shard")
                    checked.append(r)
                p.send_frame(conn, {"status": "ok"})
                for offset, nbytes in checked:
                    p.sendfile_all(conn, source.fd, offset, nbytes)

    def _on_put_metadata(self, conn: socket.socket, req: dict, step: int) -> None:
        nbytes = p.want_int(req, "nbytes", 1, MAX_METADATA_BYTES)
        with contextlib.suppress(MLCheckpointError):
            if checksum(self.store.read_metadata_file(step)) == req.get("checksum"):
                p.send_frame(conn, {"status": "have"})
                return
        p.send_frame(conn, {"status": "ready"})
        raw = p.recv_growing(conn, nbytes)
        self.check_admitted(p.metadata_from_wire(raw, self.store.job_id, step).run_id, step)
        self.store.write_metadata_file(step, raw)
        p.send_frame(conn, {"status": "ok"})

    def _on_get_metadata(self, conn: socket.socket, req: dict, step: int) -> None:
        try:
            raw = self.store.read_metadata_file(step)
        except ShardNotFoundError:
            p.send_frame(conn, {"status": "missing"})
            return
        p.send_frame(conn, {"status": "ok", "nbytes": len(raw)})
        conn.sendall(raw)

    # ------------------------------------------------------------------ client
    @contextlib.contextmanager
    def _connect(self, peer: int):
        host, port = self.rdzv.lookup("tcp", peer).rsplit(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=self.timeout)
        except OSError as e:
            raise ReplicationError(f"cannot reach rank {peer} at {host}:{port}: {e}") from None
        try:
            sock.settimeout(self.timeout)
            p.client_handshake(sock, self.secret)
            p.use_kernel_timeouts(sock, self.timeout)
            yield sock
        except (OSError, p.ProtocolError) as e:
            raise ReplicationError(f"transfer with rank {peer} failed: {e}") from None
        finally:
            sock.close()

    def _request(self, sock: socket.socket, req: dict) -> dict:
        p.send_frame(sock, {"job_id": self.store.job_id, **req})
        resp = p.recv_frame(sock)
        if resp.get("status") == "error":
            raise ReplicationError(f"peer refused {req['op']}: {resp.get('error')}")
        return resp

    def push_shard(self, peer: int, step: int, owner: int) -> int:
        with self.pins.pinned(step):
            m = self.store.read_manifest(step, owner)
            streams = max(1, min(self.streams, m.data_bytes // self.min_stripe_bytes))
            offer = {"op": "put_shard", "step": step, "owner": owner, "manifest": m.to_dict()}
            if streams > 1:
                offer["streams"] = streams
            with self._connect(peer) as sock:
                resp = self._request(sock, offer)
                if resp.get("status") == "have":
                    return 0
                if streams == 1:
                    self._send_whole(sock, m)
                else:
                    self._send_striped(sock, peer, m, streams, resp.get("token"))
                resp = p.recv_frame(sock)
                if resp.get("status") != "ok":
                    raise ReplicationError(f"rank {peer} rejected step {step} rank {owner}: {resp.get('error')}")
        return m.data_bytes

    def _send_whole(self, sock: socket.socket, m: Manifest) -> None:
        with open(self.store.data_path(m.step, m.rank), "rb") as f:
            send_range(sock, f.fileno(), 0, m.data_bytes, m)

    def _send_striped(self, sock: socket.socket, peer: int, m: Manifest, streams: int,
                      token: object) -> None:
        if not isinstance(token, str):
            raise p.ProtocolError("receiver gave no token for a striped transfer")
        parts = stripes(m.data_bytes, streams)
        with open(self.store.data_path(m.step, m.rank), "rb") as f:

            def send_part(index: int) -> None:
                if index == 0:  # stripe 0 goes on the offering connection
                    send_range(sock, f.fileno(), *parts[0], m)
                    return
                with self._connect(peer) as part:
                    resp = self._request(part, {"op": "put_part", "step": m.step, "owner": m.rank,
                                                "token": token, "index": index})
                    if resp.get("status") != "ready":
                        raise ReplicationError(f"rank {peer} refused stripe {index}: {resp}")
                    send_range(part, f.fileno(), *parts[index], m)

            errors = run_streams(send_part, list(range(streams)))
        if errors:
            raise ReplicationError(f"striped push of step {m.step} rank {m.rank} to rank {peer} "
                                   f"failed: {errors[0]}")

    def push_metadata(self, peer: int, step: int) -> None:
        raw = self.store.read_metadata_file(step)
        with self._connect(peer) as sock:
            resp = self._request(sock, {"op": "put_metadata", "step": step, "nbytes": len(raw),
                                        "checksum": checksum(raw)})
            if resp.get("status") == "have":
                return
            sock.sendall(raw)
            resp = p.recv_frame(sock)
            if resp.get("status") != "ok":
                raise ReplicationError(f"rank {peer} rejected metadata of step {step}: {resp.get('error')}")

    def fetch_shard(self, peer: int, step: int, owner: int) -> int:
        with self._connect(peer) as sock:
            resp = self._request(sock, {"op": "get_shard", "step": step, "owner": owner})
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} does not hold step {step} rank {owner}")
            m = manifest_from_wire(resp.get("manifest"), self.store.job_id, step, owner)
            if m.data_bytes > self.max_shard_bytes:
                raise ReplicationError(f"shard of {m.data_bytes} bytes exceeds max_shard_bytes")
            receive_shard(sock, self.store, m)
        return m.data_bytes

    def read_items(self, peer: int, step: int, owner: int, ranges: list[tuple[int, int]],
                   sinks: list, on_range: Callable[[int], None] | None = None) -> int:
        total = sum(n for _, n in ranges)
        streams = max(1, min(self.streams, total // self.min_stripe_bytes))
        # Cut the ranges into pieces and deal them to the streams in equal byte counts; a range
        # is reported once its last piece has landed, whichever stream carried it.
        pieces: list[tuple[int, int, int, memoryview]] = []  # (range index, offset, nbytes, sink)
        piece_bytes = max(1, -(-total // (streams * 4)))
        for i, ((offset, nbytes), sink) in enumerate(zip(ranges, sinks)):
            view = memoryview(sink).cast("B")
            for start in range(0, max(nbytes, 1), piece_bytes):
                n = min(piece_bytes, nbytes - start)
                pieces.append((i, offset + start, n, view[start:start + n]))
        groups = [g for g in split_evenly(pieces, lambda piece: piece[2], streams) if g]
        left = Counter(piece[0] for piece in pieces)
        lock = threading.Lock()

        def landed(i: int) -> None:
            with lock:
                left[i] -= 1
                last = left[i] == 0
            if last and on_range is not None:
                on_range(i)

        def read_group(group: list) -> None:
            with self._connect(peer) as sock:
                resp = self._request(sock, {"op": "read_items", "step": step, "owner": owner,
                                            "ranges": [[off, n] for _, off, n, _ in group]})
                if resp.get("status") == "missing":
                    raise ShardNotFoundError(f"rank {peer} does not hold step {step} rank {owner}")
                for i, _, n, view in group:
                    if n:
                        p.recv_into_exact(sock, view)
                    landed(i)

        errors = run_streams(read_group, groups)  # returns once no stream writes into the sinks
        if errors:
            raise next((e for e in errors if isinstance(e, ShardNotFoundError)), errors[0])
        log.debug("read %d bytes of step %d rank %d from rank %d over %d streams", total, step,
                  owner, peer, len(groups))
        return total

    def fetch_metadata(self, peer: int, step: int) -> None:
        with self._connect(peer) as sock:
            resp = self._request(sock, {"op": "get_metadata", "step": step})
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} has no metadata of step {step}")
            nbytes = p.want_int(resp, "nbytes", 1, MAX_METADATA_BYTES)
            raw = p.recv_growing(sock, nbytes)
            p.metadata_from_wire(raw, self.store.job_id, step)
            self.store.write_metadata_file(step, raw)

    def close(self) -> None:
        self._closed.set()
        self._gate.close()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
