"""The one small interface every transport implements.

A transport only moves bytes: committed shards and step metadata between ranks, each call
bounded by a timeout. What it asks of a peer is asked by the one client (``client.py``), over
the transport's own wire; the operations below hand over to it. What it sends in the background (pushes, and shards it serves to a
fetch that asks to be paced) goes through the node's bandwidth budget (``budget.py``); what
a resume waits for takes the full link. What a peer asks of it is answered by the request
service (``service.py``), the same for every transport; what it receives lands through a
``ReceiveSink`` (``sink.py``), which verifies every checksum before it commits through the
LocalStore commit protocol, so a transfer cut anywhere leaves nothing visible. Pins, the
received-notification and the history of saves accepted live in the sink, not in the
transport."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

from ...errors import ReplicationError
from ...store.identity import Lineage
from ...store.manifest import ManifestItem
from .budget import Budget
from .client import PeerClient
from .sink import ReceiveSink

__all__ = ["ReplicationError", "Transport"]


class Transport(abc.ABC):
    """Moves committed shards and metadata between ranks of one job."""

    name: str = "?"
    sink: ReceiveSink  # where what this transport receives lands
    budget: Budget  # paces what it sends in the background; its counters say how much
    client: PeerClient  # asks peers, over this transport's wire

    def accept_from(self, history: Lineage) -> None:
        """Receive replicas only of saves in ``history`` (see ``ReceiveSink.accept_from``)."""
        self.sink.accept_from(history)

    def describe(self) -> str:
        """One line for the log: how this transport sends, and within what budget."""
        return f"{self.name}, {self.budget.describe()}"

    def push_shard(self, peer: int, step: int, owner: int,
                   items: Sequence[ManifestItem] | None = None) -> int:
        """Send our committed shard (step, owner) to rank ``peer``; return the bytes sent.
        With ``items`` (some of the shard's manifest items), send a partial replica: only
        those items' bytes, landing at their offsets under a manifest that lists them alone
        (``Manifest.only``).

        Paced by our budget. Returns when the peer has verified the checksums and committed
        the replica (0 bytes if it already held one with these items). Raises
        ReplicationError otherwise.
        """
        return self.client.push_shard(peer, step, owner, items)

    def push_metadata(self, peer: int, step: int) -> None:
        """Send the step's global metadata to rank ``peer`` (acknowledged after verification),
        paced by our budget."""
        self.client.push_metadata(peer, step)

    # The reads below are sent by the peer, so the request carries ``paced``: True makes
    # the peer send within its node's budget (background work, e.g. healing after a resume),
    # False at the full speed of the link (a resume waiting for the bytes).

    def read_items(self, peer: int, step: int, owner: int, ranges: list[tuple[int, int]],
                   sinks: list, on_range: Callable[[int], None] | None = None, *,
                   paced: bool = False) -> int:
        """Read byte ranges of shard (step, owner) held by rank ``peer`` straight into ``sinks``
        (writable uint8 numpy arrays, one per range, of the range's size); return the bytes.
        ``on_range(i)`` is called as soon as range ``i`` has landed.

        Nothing is written to our store: recovery streams a replaced node's bytes directly into
        the model's tensors. The caller verifies checksums (while later ranges arrive).
        ShardNotFoundError if the peer does not hold the shard.
        """
        return self.client.read_items(peer, step, owner, ranges, sinks, on_range, paced=paced)

    def fetch_metadata(self, peer: int, step: int, *, paced: bool = False) -> None:
        """Pull the step's global metadata from rank ``peer`` (checked, then installed);
        ShardNotFoundError if the peer has none."""
        self.client.fetch_metadata(peer, step, paced=paced)

    def reachable(self, peer: int, timeout: float) -> bool | None:
        """Whether rank ``peer``'s process still serves, asked within ``timeout`` seconds:
        False when nothing accepts where it listened (its process or its machine is gone),
        None where this transport cannot tell."""
        return None

    @abc.abstractmethod
    def close(self) -> bool:
        """Stop serving and release sockets/threads. False when a thread that serves peers
        (and may write into the store) is still running after a bounded wait."""
