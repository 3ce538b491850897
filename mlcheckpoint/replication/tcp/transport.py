"""The TCP transport: an authenticated listener per rank (``server.py``) and one connection per
operation to a peer's listener (this module: the calling half).

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
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..._faults import crash_point
from ...errors import ConfigError, ReplicationError, ShardNotFoundError
from ...integrity.checksum import checksum
from ...settings import MAX_STREAMS, default, tuning
from ...store import LocalStore, Manifest
from ...store.manifest import ManifestItem
from ..core.budget import Budget, node_budget
from ..core.checks import MAX_METADATA_BYTES, manifest_from_wire, want_int
from ..core.network import check_advertisable, choose_endpoint
from ..core.rendezvous import Rendezvous
from ..core.sink import ReceiveSink
from ..core.streams import run_streams
from ..core.transport import Transport
from . import protocol as p
from .server import TcpServer
from .striping import split_evenly, stream_parts

# One logger for the TCP transport, server and client alike.
log = logging.getLogger(__package__)


@dataclass(frozen=True)
class TcpSettings:
    """What the TCP transport alone is given: each field is the ``TcpTransport`` argument of
    the same name (``make_transport`` passes them as they are)."""

    host: str | None = None
    streams: int | None = None
    handshake_timeout: float = default("handshake")
    min_stripe_bytes: int | None = None


def send_range(sock: socket.socket, fd: int, offset: int, nbytes: int, m: Manifest,
               budget: Budget) -> None:
    """Send one stream's range of a shard file within the budget (a test can SIGKILL the
    sender half way)."""
    half = nbytes // 2
    budget.sendfile(sock, fd, offset, half)
    crash_point("replica_mid_send", m.step, m.rank)
    budget.sendfile(sock, fd, offset + half, nbytes - half)


class TcpTransport(Transport):
    """Serves this rank's store to peers (``server``) and pushes/pulls shards to/from theirs.

    Args:
        store: this node's store (what we send is read from it).
        rdzv: the job's rendezvous (secret and peer addresses).
        sink: where what we receive lands (default: one of its own over ``store``).
        host: address to listen on (default: ``interface``'s, else the one that routes to
            MASTER_ADDR).
        interface: network interface whose IPv4 address to listen on (wins over ``host``).
        timeout: seconds any single socket operation may block.
        max_connections: authenticated connections served at once; a striped push or read
            takes ``streams`` of them, and after a resharding many ranks may read from one.
        max_handshakes, max_handshakes_per_address: connections in the handshake at once, in
            all and from one address; beyond either, the oldest is closed (see ``gate.py``).
        handshake_timeout: seconds a connection may take to authenticate.
        streams: connections a large shard is pushed over (default: the declared default of
            ``replication_streams``, settings.py).
        min_stripe_bytes: the least a stream carries, so small shards use fewer streams
            (default ``settings.tuning().min_stripe_bytes``).
        bandwidth: the node's budget for what we send in the background, bytes/s (0: no cap;
            "auto": the default for the interface, see ``core/budget.py``).
        num_nodes: nodes in the job; with several, a loopback address is refused
            (``network.check_advertisable``).
        master_addr, master_port: the launcher's MASTER_ADDR and MASTER_PORT
            (``topology.Topology``): without ``interface`` or ``host`` the listener binds the
            address that routes there.
        log_peers: log the address each peer advertised, the first time we reach it (the
            node's local rank 0 does).
    """

    name = "tcp"

    def __init__(self, store: LocalStore, rdzv: Rendezvous, *, sink: ReceiveSink | None = None,
                 host: str | None = None, timeout: float = default("replication_timeout"), max_connections: int = 128,
                 max_handshakes: int = 256, max_handshakes_per_address: int = 64,
                 handshake_timeout: float = default("handshake"), streams: int | None = None,
                 min_stripe_bytes: int | None = None, interface: str | None = None,
                 bandwidth: int | str = 0, num_nodes: int = 1, log_peers: bool = False,
                 master_addr: str = default("master_addr"),
                 master_port: int = default("master_port")):
        self.store, self.rdzv, self.timeout = store, rdzv, timeout
        self.sink = sink if sink is not None else ReceiveSink(store)
        self.streams = streams if streams is not None else default("replication_streams")
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ConfigError(f"streams must be in 1..{MAX_STREAMS}, not {self.streams}")
        self.min_stripe_bytes = min_stripe_bytes or tuning().min_stripe_bytes
        self.secret = rdzv.secret()
        self._log_peers = log_peers
        self._peers_logged: set[int] = set()
        self._reads_lock = threading.Lock()  # a resume reads from several holders at once
        self._reads: Counter[int] = Counter()  # stream count -> reads done over that many
        self.endpoint = choose_endpoint(host, interface, master_addr=master_addr,
                                        master_port=master_port)
        check_advertisable(self.endpoint, num_nodes, master_addr)  # before anything listens or is published
        self.budget = node_budget(bandwidth, self.endpoint.interface, store.paths.bandwidth)
        self.server = TcpServer(store, self.sink, rdzv, host=self.endpoint.address,
                                timeout=timeout, budget=self.budget,
                                max_connections=max_connections, max_handshakes=max_handshakes,
                                max_handshakes_per_address=max_handshakes_per_address,
                                handshake_timeout=handshake_timeout)
        self.address = self.server.address
        rdzv.publish("tcp", self.address)
        log.debug("replication listener of rank %d on %s", rdzv.rank, self.address)

    def describe(self) -> str:
        interface = self.endpoint.interface or "no single interface"
        return (f"TCP: rank {self.rdzv.rank} listens on {self.address} ({interface}, chosen by "
                f"{self.endpoint.chosen_by}); {self.budget.describe()}")

    def close(self) -> bool:
        idle = self.server.close()
        self.budget.close()
        return idle

    def reads_by_streams(self) -> dict[int, int]:
        """How many ``read_items`` calls completed over each number of streams."""
        with self._reads_lock:
            return dict(self._reads)

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
    def _connect(self, peer: int) -> Iterator[socket.socket]:
        host, port = self._address_of(peer).rsplit(":", 1)
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

    # ------------------------------------------------------------------ push
    def push_shard(self, peer: int, step: int, owner: int,
                   items: Sequence[ManifestItem] | None = None) -> int:
        with self.sink.pins.pinned(step):
            m = self.store.read_manifest(step, owner)
            if items is not None:
                m = m.only(list(items))
            ranges = m.held_ranges()
            total = sum(n for _, n in ranges)
            streams = max(1, min(self.streams, total // self.min_stripe_bytes))
            offer: dict[str, Any] = {"op": "put_shard", "step": step, "owner": owner,
                                     "manifest": m.to_dict()}
            if streams > 1:
                offer["streams"] = streams
            with self._connect(peer) as sock:
                resp = self._request(sock, offer)
                if resp.get("status") == "have":
                    return 0
                if streams == 1:
                    self._send_whole(sock, m, ranges)
                else:
                    self._send_striped(sock, peer, m, ranges, streams, resp.get("token"))
                resp = p.recv_frame(sock)
                if resp.get("status") != "ok":
                    raise ReplicationError(f"rank {peer} rejected step {step} rank {owner}: "
                                           f"{resp.get('error')}")
        return total

    def _send_whole(self, sock: socket.socket, m: Manifest, ranges: list[tuple[int, int]]) -> None:
        with open(self.store.data_path(m.step, m.rank), "rb") as f:
            for offset, nbytes in ranges:  # (a partial replica: its items' ranges, in order)
                send_range(sock, f.fileno(), offset, nbytes, m, self.budget)

    def _send_striped(self, sock: socket.socket, peer: int, m: Manifest,
                      ranges: list[tuple[int, int]], streams: int, token: object) -> None:
        if not isinstance(token, str):
            raise p.ProtocolError("receiver gave no token for a striped transfer")
        parts = stream_parts(ranges, streams)
        with open(self.store.data_path(m.step, m.rank), "rb") as f:

            def send_pieces(conn: socket.socket, index: int) -> None:
                for offset, nbytes in parts[index]:
                    send_range(conn, f.fileno(), offset, nbytes, m, self.budget)

            def send_part(index: int) -> None:
                if index == 0:  # stripe 0 goes on the offering connection
                    send_pieces(sock, 0)
                    return
                with self._connect(peer) as part:
                    resp = self._request(part, {"op": "put_part", "step": m.step, "owner": m.rank,
                                                "token": token, "index": index})
                    if resp.get("status") != "ready":
                        raise ReplicationError(f"rank {peer} refused stripe {index}: {resp}")
                    send_pieces(part, index)

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
            self.budget.sendall(sock, raw)
            resp = p.recv_frame(sock)
            if resp.get("status") != "ok":
                raise ReplicationError(f"rank {peer} rejected metadata of step {step}: "
                                       f"{resp.get('error')}")

    # ------------------------------------------------------------------ pull
    def fetch_shard(self, peer: int, step: int, owner: int, *, paced: bool = True) -> int:
        with self._connect(peer) as sock:
            resp = self._request(sock, {"op": "get_shard", "step": step, "owner": owner,
                                        "paced": paced})
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} does not hold step {step} rank {owner}")
            m = manifest_from_wire(resp.get("manifest"), self.store.job_id, step, owner)
            with self.sink.begin(m) as receipt:
                for offset, view in receipt.views():  # (a partial replica: its items' ranges)
                    p.recv_into_exact(sock, view, receipt.landed_from(offset))
                receipt.commit()
        return receipt.nbytes

    def read_items(self, peer: int, step: int, owner: int, ranges: list[tuple[int, int]],
                   sinks: list, on_range: Callable[[int], None] | None = None, *,
                   paced: bool = False) -> int:
        total = sum(n for _, n in ranges)
        streams = max(1, min(self.streams, total // self.min_stripe_bytes))
        # Cut the ranges into pieces and deal them to the streams in equal byte counts; a range
        # is reported once its last piece has landed, whichever stream carried it.
        pieces: list[tuple[int, int, int, memoryview]] = []  # (range index, offset, nbytes, sink)
        piece_bytes = max(1, -(-total // (streams * 4)))
        for i, ((offset, nbytes), sink) in enumerate(zip(ranges, sinks, strict=True)):
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
                                            "ranges": [[off, n] for _, off, n, _ in group],
                                            "paced": paced})
                if resp.get("status") == "missing":
                    raise ShardNotFoundError(f"rank {peer} does not hold step {step} rank {owner}")
                for i, _, n, view in group:
                    if n:
                        p.recv_into_exact(sock, view)
                    landed(i)

        errors = run_streams(read_group, groups)  # returns once no stream writes into the sinks
        if errors:
            raise next((e for e in errors if isinstance(e, ShardNotFoundError)), errors[0])
        with self._reads_lock:
            self._reads[len(groups)] += 1
        log.debug("read %d bytes of step %d rank %d from rank %d over %d streams", total, step,
                  owner, peer, len(groups))
        return total

    def fetch_metadata(self, peer: int, step: int, *, paced: bool = False) -> None:
        with self._connect(peer) as sock:
            resp = self._request(sock, {"op": "get_metadata", "step": step, "paced": paced})
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} has no metadata of step {step}")
            nbytes = want_int(resp, "nbytes", 1, MAX_METADATA_BYTES)
            self.sink.commit_metadata(step, p.recv_growing(sock, nbytes), offered=False)
