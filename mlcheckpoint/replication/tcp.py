"""TCP transport: an authenticated listener per rank (``tcp_server.py``) and one connection
per operation to a peer's listener (``tcp_client.py``).

Payloads leave with sendfile() straight from the tmpfs file and arrive with recv_into()
straight into the destination mapping: no user-space copy on either side. What arrives lands
through the receive sink (``sink.py``), which verifies and commits it.

A large shard can go over several streams (``streams``): one TCP stream often cannot fill a
fast link. The receiver answers the offer with a one-time token; the sender opens the other
connections (each authenticated like any other) and names the token and its stripe on each.
The receiver verifies and commits only once every stripe has landed, and on any failure
stops the other stripes before it gives the buffer back.

The listener binds the address ``network.choose_endpoint`` picks (``interface``, ``host`` or
the route to MASTER_ADDR) and advertises it through the c10d store. What we send in the
background goes through the node's bandwidth budget (``budget.py``), shared by every stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..errors import ConfigError
from ..settings import MAX_STREAMS, default, tuning
from ..store import LocalStore
from .budget import node_budget
from .network import check_advertisable, choose_endpoint
from .rendezvous import Rendezvous
from .sink import ReceiveSink
from .tcp_client import TcpClient
from .tcp_server import TcpServer
from .transport import Transport

log = logging.getLogger(__name__)


class TcpTransport(Transport):
    """Serves this rank's store to peers and pushes/pulls shards to/from theirs.

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
            "auto": the default for the interface, see ``budget.py``).
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
        self.endpoint = choose_endpoint(host, interface, master_addr=master_addr,
                                        master_port=master_port)
        check_advertisable(self.endpoint, num_nodes, master_addr)  # before anything listens or is published
        self.budget = node_budget(bandwidth, self.endpoint.interface, store.paths.bandwidth)
        self.server = TcpServer(store, self.sink, rdzv, host=self.endpoint.address,
                                timeout=timeout, budget=self.budget,
                                max_connections=max_connections, max_handshakes=max_handshakes,
                                max_handshakes_per_address=max_handshakes_per_address,
                                handshake_timeout=handshake_timeout)
        self.client = TcpClient(store, self.sink, rdzv, timeout=timeout, streams=self.streams,
                                min_stripe_bytes=self.min_stripe_bytes, budget=self.budget,
                                log_peers=log_peers)
        self.address = self.server.address
        rdzv.publish("tcp", self.address)
        log.debug("replication listener of rank %d on %s", rdzv.rank, self.address)

    def describe(self) -> str:
        interface = self.endpoint.interface or "no single interface"
        return (f"TCP: rank {self.rdzv.rank} listens on {self.address} ({interface}, chosen by "
                f"{self.endpoint.chosen_by}); {self.budget.describe()}")

    def push_shard(self, peer: int, step: int, owner: int) -> int:
        return self.client.push_shard(peer, step, owner)

    def push_metadata(self, peer: int, step: int) -> None:
        self.client.push_metadata(peer, step)

    def fetch_shard(self, peer: int, step: int, owner: int, *, paced: bool = True) -> int:
        return self.client.fetch_shard(peer, step, owner, paced=paced)

    def read_items(self, peer: int, step: int, owner: int, ranges: list[tuple[int, int]],
                   sinks: list, on_range: Callable[[int], None] | None = None, *,
                   paced: bool = False) -> int:
        return self.client.read_items(peer, step, owner, ranges, sinks, on_range, paced=paced)

    def fetch_metadata(self, peer: int, step: int, *, paced: bool = False) -> None:
        self.client.fetch_metadata(peer, step, paced=paced)

    def close(self) -> bool:
        idle = self.server.close()
        self.budget.close()
        return idle
