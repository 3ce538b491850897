"""Building a transport by name: what ``CheckpointManager(replication=...)`` accepts, built
from the resolved ``ReplicationOptions`` and the manager's ``Timeouts`` (each transport takes
from them what it uses)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..settings import ReplicationOptions, Timeouts
from ..store import LocalStore
from ..topology import Topology
from .core.rendezvous import Rendezvous
from .core.sink import ReceiveSink
from .core.transport import Transport
from .pg.transport import PgTransport
from .tcp.transport import TcpTransport

__all__ = ["TRANSPORTS", "make_transport"]

log = logging.getLogger(__name__)

# "tcp": a listener per rank, sendfile/recv_into straight between tmpfs files;
# "pg": torch.distributed send/recv on a dedicated gloo group (CPU);
# "nccl": the same on a dedicated NCCL group, through a GPU bounce buffer.
TRANSPORTS = ("tcp", "pg", "nccl")


def make_transport(store: LocalStore, rdzv: Rendezvous, sink: ReceiveSink,
                   options: ReplicationOptions, timeouts: Timeouts | None = None, *,
                   topology: Topology | None = None) -> Transport:
    """The transport ``options.mode`` names (one of ``TRANSPORTS``) for this rank, built from
    ``options`` (resolved) and ``timeouts`` (default: the defaults, with ``options.timeout``).

    Collective for "pg" and "nccl" (each creates a process group: every rank calls it at the
    same point). For "nccl" each rank must have selected its CUDA device first
    (``torch.cuda.set_device``). ``topology``: the job's shape (default: one node): with
    several nodes a listener on a loopback address is refused (``core/network.py``), the
    node's local rank 0 logs where replication listens and at what budget it sends, and its
    MASTER_ADDR is where the listener's route is looked up.
    """
    kind = options.mode
    topology = topology or Topology()
    announce = topology.num_nodes > 1 and topology.is_node_leader
    transport: Transport
    if kind == "tcp":
        transport = TcpTransport(store, rdzv, options, timeouts, sink=sink, topology=topology)
    elif kind in ("pg", "nccl"):
        if kind == "nccl" and (not torch.cuda.is_available() or not dist.is_nccl_available()):
            raise ConfigError("replication='nccl' needs CUDA and a torch built with NCCL; use "
                              "'tcp' or 'pg' on this machine")
        if kind == "nccl":
            _check_one_device_per_rank(rdzv)
        if (options.interface is not None or options.host is not None) \
                and topology.is_node_leader:
            log.warning("mlcheckpoint: replication_interface and replication_host choose the "
                        "TCP transport's listener; replication=%r sends over its own %s group, "
                        "which picks its interface itself (GLOO_SOCKET_IFNAME, "
                        "NCCL_SOCKET_IFNAME)", kind, "gloo" if kind == "pg" else "NCCL")
        transport = PgTransport(store, rdzv, options, timeouts, sink=sink, topology=topology)
    else:
        raise ConfigError(f"replication transport {kind!r}: expected one of "
                          f"{', '.join(map(repr, TRANSPORTS))}")
    if announce:
        log.info("mlcheckpoint: node %d replicates over %s", topology.node_rank,
                 transport.describe())
    return transport


def _check_one_device_per_rank(rdzv: Rendezvous) -> None:
    """NCCL cannot put two ranks of one communicator on one GPU (e.g. simulated nodes sharing
    a machine's GPU, or ranks that all kept cuda:0): it fails or hangs at the first send.
    Every rank publishes its device's UUID and reads everyone's, so all of them refuse
    together, before any NCCL call."""
    device = torch.cuda.current_device()
    rdzv.publish("cuda-device", f"{torch.cuda.get_device_properties(device).uuid}")
    owners: dict[str, list[int]] = {}
    for rank in range(rdzv.world_size):
        owners.setdefault(rdzv.lookup("cuda-device", rank), []).append(rank)
    shared = [ranks for ranks in owners.values() if len(ranks) > 1]
    if shared:
        raise ConfigError(
            f"replication='nccl' needs a CUDA device per rank, but ranks {shared[0]} use one "
            f"GPU ({len(owners)} GPUs for {rdzv.world_size} ranks; this rank is on cuda:{device}; "
            "call torch.cuda.set_device(local_rank) first): NCCL cannot form a communicator "
            "with two ranks on one GPU; use replication='tcp' or 'pg'")
