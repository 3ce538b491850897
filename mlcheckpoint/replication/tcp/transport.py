"""The TCP transport: an authenticated listener per rank (``server.py``) and one connection per
request to a peer's listener (this module: the calling half, the wire over which
``core/transport.py`` asks its peers).

Payloads leave with sendfile() straight from the tmpfs file and arrive with recv_into()
straight into the destination mapping: no user-space copy on either side. Pushes are paced by
the node's bandwidth budget (``core/budget.py``; every stream of a striped push draws from it);
what arrives lands through the receive sink (``core/sink.py``), which verifies and commits it;
range reads land straight in the caller's arrays. A fetch tells the holder, which sends the
bytes, whether to pace them.

A large shard or read can go over several streams (``streams``; see ``striping.py``): one TCP
stream often cannot fill a fast link. The receiver answers the offer with a one-time token; the
sender opens the other connections (each authenticated like any other) and names the token and
its stripe on each. The receiver verifies and commits only once every stripe has landed, and on
any failure stops the other stripes before it gives the buffer back.

The listener binds the address ``core/network.choose_endpoint`` picks (``interface``, ``host``
or the route to MASTER_ADDR) and advertises it through the c10d store.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

from ..._faults import crash_point
from ...errors import ConfigError, ReplicationError
from ...integrity.checksum import checksum
from ...settings import MAX_STREAMS, ReplicationOptions, Timeouts, default, tuning
from ...store import LocalStore, Manifest
from ...topology import Topology
from ..core.budget import Budget, node_budget
from ..core.checks import MAX_ERROR_TEXT, MAX_METADATA_BYTES, want_int
from ..core.network import check_advertisable, choose_endpoint
from ..core.rendezvous import Rendezvous
from ..core.sink import ReceiveSink
from ..core.streams import run_streams
from ..core.transport import Transport
from . import protocol as p
from .server import MAX_CONNECTIONS, TcpServer
from .striping import stream_parts

# One logger for the TCP transport, server and client alike.
log = logging.getLogger(__package__)


def send_range(sock: socket.socket, fd: int, offset: int, nbytes: int, m: Manifest,
               budget: Budget) -> None:
    """Send one stream's range of a shard file within the budget (a test can SIGKILL the
    sender half way)."""
    half = nbytes // 2
    budget.sendfile(sock, fd, offset, half)
    crash_point("replica_mid_send", m.step, m.rank)
    budget.sendfile(sock, fd, offset + half, nbytes - half)


class TcpTransport(Transport):
    """Serves this rank's store to peers (``server``) and asks theirs over ``TcpWire``.

    Args:
        store: this node's store (what we send is read from it).
        rdzv: the job's rendezvous (secret and peer addresses).
        options: resolved (``ReplicationOptions.resolved``); a field left None takes its
            declared default, and a budget left None is none. What this transport takes:
            ``host`` and ``interface`` (the listener's address: ``interface``'s, else
            ``host``, else the one that routes to MASTER_ADDR), ``streams`` (connections a
            large shard or read goes over) and ``bandwidth`` (the node's budget for what we
            send in the background; "auto": the default for the interface, see
            ``core/budget.py``).
        timeouts: ``replication`` (seconds any single socket operation may block) and
            ``handshake`` (seconds a connection may take to authenticate); default: the
            defaults, with ``options.timeout``.
        sink: where what we receive lands (default: one of its own over ``store``).
        topology: the job's shape (default: one node). With several nodes a loopback address
            is refused (``network.check_advertisable``) and the node's local rank 0 logs the
            address each peer advertised; MASTER_ADDR and MASTER_PORT are where the
            listener's route is looked up.
        max_connections: authenticated connections served at once (``server.py``).
    The least a stream carries is the process's ``tuning().min_stripe_bytes``.
    """

    name = "tcp"
    wire: TcpWire

    def __init__(self, store: LocalStore, rdzv: Rendezvous, options: ReplicationOptions,
                 timeouts: Timeouts | None = None, *, sink: ReceiveSink | None = None,
                 topology: Topology | None = None, max_connections: int = MAX_CONNECTIONS):
        timeouts = timeouts or Timeouts(replication=options.timeout)
        topology = topology or Topology()
        super().__init__(store, sink if sink is not None else ReceiveSink(store))
        self.rdzv, self.timeout = rdzv, timeouts.replication
        self.streams = options.streams if options.streams is not None else default("replication_streams")
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ConfigError(f"streams must be in 1..{MAX_STREAMS}, not {self.streams}")
        self.min_stripe_bytes = tuning().min_stripe_bytes
        self.secret = rdzv.secret()
        self.endpoint = choose_endpoint(options.host, options.interface,
                                        master_addr=topology.master_addr,
                                        master_port=topology.master_port)
        # before anything listens or is published
        check_advertisable(self.endpoint, topology.num_nodes, topology.master_addr)
        self.budget = node_budget(options.bandwidth or 0, self.endpoint.interface,
                                  store.paths.bandwidth)
        self.server = TcpServer(store, self.sink, rdzv, host=self.endpoint.address,
                                timeouts=timeouts, budget=self.budget,
                                max_connections=max_connections)
        self.address = self.server.address
        rdzv.publish("tcp", self.address)
        log.debug("replication listener of rank %d on %s", rdzv.rank, self.address)
        log_peers = topology.num_nodes > 1 and topology.is_node_leader
        self.wire = TcpWire(self, log_peers=log_peers)

    def describe(self) -> str:
        interface = self.endpoint.interface or "no single interface"
        return (f"TCP: rank {self.rdzv.rank} listens on {self.address} ({interface}, chosen by "
                f"{self.endpoint.chosen_by}); {self.budget.describe()}")

    def close(self) -> bool:
        idle = self.server.close()
        self.budget.close()
        return idle

    def reachable(self, peer: int, timeout: float) -> bool | None:
        return self.wire.reachable(peer, timeout)


class Unreachable(ReplicationError):
    """Nothing accepted a connection at the address a peer advertised."""


class TcpWire:
    """The way to a peer over TCP (``core/transport.Wire``): a connection per call,
    to the address the peer advertised, logged in with the job's secret."""

    def __init__(self, transport: TcpTransport, *, log_peers: bool = False):
        self.transport = transport
        self.rdzv, self.timeout = transport.rdzv, transport.timeout
        self.secret = transport.secret
        self._log_peers = log_peers  # the node's local rank 0 does
        self._peers_logged: set[int] = set()

    def streams(self, nbytes: int) -> int:
        """The connections a transfer of ``nbytes`` goes over: the transport's ``streams``,
        fewer when each would carry less than its ``min_stripe_bytes``."""
        return max(1, min(self.transport.streams, nbytes // self.transport.min_stripe_bytes))

    def _address_of(self, peer: int) -> str:
        """The address ``peer`` advertised (logged the first time, on the node's local rank 0:
        the line to look for when replication uses the wrong network)."""
        address = self.rdzv.lookup("tcp", peer)
        if self._log_peers and peer not in self._peers_logged:
            self._peers_logged.add(peer)
            log.info("mlcheckpoint: rank %d reaches rank %d's replication listener at %s, the "
                     "address it advertised", self.rdzv.rank, peer, address)
        return address

    @contextlib.contextmanager
    def connection(self, peer: int, timeout: float | None = None) -> Iterator[socket.socket]:
        """A logged-in connection to ``peer``'s listener, closed after the block; ``timeout``
        bounds the connect and the login (default: the replication timeout)."""
        host, port = self._address_of(peer).rsplit(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout or self.timeout)
        except OSError as e:
            raise Unreachable(f"cannot reach rank {peer} at {host}:{port}: {e}") from None
        try:
            sock.settimeout(timeout or self.timeout)
            p.client_handshake(sock, self.secret)
            p.use_kernel_timeouts(sock, self.timeout)
            yield sock
        finally:
            sock.close()

    def reachable(self, peer: int, timeout: float) -> bool | None:
        """Log in to ``peer``'s listener and hang up, as a finished call does (its listener
        says nothing of it): False when nothing accepts the connection within ``timeout``.
        Only at an address this rank looked up before (None otherwise): the job's store may
        be gone with a lost node, and a connection to it cannot be bounded here."""
        if self.rdzv.known("tcp", peer) is None:
            return None
        try:
            with self.connection(peer, timeout):
                return True
        except Unreachable:
            return False
        except (OSError, ReplicationError):
            return True  # it accepted but the login failed: a process is there

    @contextlib.contextmanager
    def call(self, peer: int) -> Iterator[TcpCall]:
        with self.connection(peer) as sock:
            yield TcpCall(self, peer, sock)


class TcpCall:
    """One request over one connection (``core/transport.Call``): frames for the request and its
    replies, raw bytes between them; a striped push opens the other connections itself."""

    def __init__(self, wire: TcpWire, peer: int, sock: socket.socket):
        self.wire, self.peer, self.sock = wire, peer, sock
        self.transport = wire.transport
        self.streams = 1  # what a put_shard offer said it sends over

    def ask(self, request: dict) -> dict:
        p.send_frame(self.sock, {"job_id": self.transport.store.job_id, **request})
        return p.recv_frame(self.sock)

    def reply(self) -> dict:
        return p.recv_frame(self.sock)

    # ------------------------------------------------------------------ shards
    def offer_shard(self, request: dict, m: Manifest, ranges: list[tuple[int, int]]) -> dict:
        # (the file is opened after the answer: if it went meanwhile, closing the connection
        # tells the peer at once)
        self.streams = self.wire.streams(sum(n for _, n in ranges))
        if self.streams > 1:
            request = {**request, "streams": self.streams}
        return self.ask(request)

    def send_shard(self, m: Manifest, ranges: list[tuple[int, int]], ready: dict) -> None:
        """From the shard's file with sendfile(), within the node's budget: over this
        connection, or striped over ``streams`` of them."""
        budget = self.transport.budget
        with open(self.transport.store.paths.data(m.step, m.rank), "rb") as f:
            if self.streams == 1:
                for offset, nbytes in ranges:
                    send_range(self.sock, f.fileno(), offset, nbytes, m, budget)
            else:
                self._send_striped(f.fileno(), m, ranges, ready.get("token"))

    def _send_striped(self, fd: int, m: Manifest, ranges: list[tuple[int, int]],
                      token: object) -> None:
        """Stripe 0 on this connection, each other one on a connection of its own that names
        the receiver's ``token`` and the stripe (``put_part``, see ``striping.py``)."""
        if not isinstance(token, str):
            raise p.ProtocolError("receiver gave no token for a striped transfer")
        parts = stream_parts(ranges, self.streams)
        budget = self.transport.budget

        def send_part(index: int) -> None:
            if index == 0:
                for offset, nbytes in parts[0]:
                    send_range(self.sock, fd, offset, nbytes, m, budget)
                return
            with self.wire.connection(self.peer) as conn:
                p.send_frame(conn, {"job_id": self.transport.store.job_id, "op": "put_part",
                                    "step": m.step, "owner": m.rank, "token": token,
                                    "index": index})
                ready = p.recv_frame(conn)
                if ready.get("status") != "ready":
                    raise p.ProtocolError(f"stripe {index} refused: "
                                          f"{str(ready.get('error'))[:MAX_ERROR_TEXT]}")
                for offset, nbytes in parts[index]:
                    send_range(conn, fd, offset, nbytes, m, budget)

        errors = run_streams(send_part, list(range(self.streams)))
        if errors:
            raise p.ProtocolError(f"striped push over {self.streams} streams failed: {errors[0]}")

    def receive_range(self, sink: Any, reply: dict) -> None:
        p.recv_into_exact(self.sock, memoryview(sink).cast("B"))

    # ------------------------------------------------------------------ metadata
    def offer_metadata(self, request: dict, raw: bytes) -> dict:
        return self.ask({**request, "nbytes": len(raw), "checksum": checksum(raw)})

    def send_metadata(self, raw: bytes) -> None:
        self.transport.budget.sendall(self.sock, raw)

    def receive_metadata(self, reply: dict) -> bytes:
        return p.recv_growing(self.sock, want_int(reply, "nbytes", 1, MAX_METADATA_BYTES))
