"""Building a transport by name: what ``CheckpointManager(replication=...)`` accepts."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..store import LocalStore
from .pg import PgTransport
from .rendezvous import Rendezvous
from .sink import ReceiveSink
from .tcp import TcpTransport
from .transport import Transport

# "tcp": a listener per rank, sendfile/recv_into straight between tmpfs files;
# "pg": torch.distributed send/recv on a dedicated gloo group (CPU);
# "nccl": the same on a dedicated NCCL group, through a GPU bounce buffer.
TRANSPORTS = ("tcp", "pg", "nccl")


def make_transport(kind: str, store: LocalStore, rdzv: Rendezvous, sink: ReceiveSink, *,
                   timeout: float = 60.0, host: str | None = None,
                   streams: int | None = None) -> Transport:
    """The transport ``kind`` (one of ``TRANSPORTS``) for this rank.

    Collective for "pg" and "nccl" (each creates a process group: every rank calls it at the
    same point). For "nccl" each rank must have selected its CUDA device first
    (``torch.cuda.set_device``). ``host`` and ``streams`` are for "tcp" alone.
    """
    if kind == "tcp":
        return TcpTransport(store, rdzv, sink=sink, host=host, timeout=timeout, streams=streams)
    if kind == "pg":
        return PgTransport(store, rdzv, sink=sink, backend="gloo", timeout=timeout)
    if kind == "nccl":
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise ConfigError("replication='nccl' needs CUDA and a torch built with NCCL; use "
                              "'tcp' or 'pg' on this machine")
        return PgTransport(store, rdzv, sink=sink, backend="nccl", timeout=timeout)
    raise ConfigError(f"replication transport {kind!r}: expected one of "
                      f"{', '.join(map(repr, TRANSPORTS))}")
