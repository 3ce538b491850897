"""The one small interface every transport implements.

A transport moves *committed* shards and step metadata between ranks. The receiving side
always writes through the LocalStore commit protocol and verifies every checksum before it
commits, so a transfer cut anywhere leaves nothing visible.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections import Counter
from typing import Callable, Iterator

from ..errors import MLCheckpointError
from ..store.identity import Lineage


class ReplicationError(MLCheckpointError):
    """A push or fetch failed (peer gone, timed out, refused, or bytes failed verification)."""


class Pins:
    """Steps whose buffers someone is reading (a transfer, a persistent write): retention skips
    them, so a buffer is never recycled under a reader."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: Counter[int] = Counter()

    @contextlib.contextmanager
    def pinned(self, step: int) -> Iterator[None]:
        self.pin(step)
        try:
            yield
        finally:
            self.unpin(step)

    def pin(self, step: int) -> None:
        with self._lock:
            self._count[step] += 1

    def unpin(self, step: int) -> None:
        with self._lock:
            self._count[step] -= 1
            if self._count[step] <= 0:
                del self._count[step]

    def steps(self) -> set[int]:
        with self._lock:
            return set(self._count)


# Called on the receiving rank after a replica (step, owner rank) is committed there.
OnReceived = Callable[[int, int], None]


class Transport(abc.ABC):
    """Moves committed shards and metadata between ranks of one job."""

    name: str = "?"
    # Replicas are received only of saves in this history (set by ``accept_from``).
    history: Lineage | None = None

    def accept_from(self, history: Lineage) -> None:
        """Receive replicas only of saves made by this run or by the runs it resumed from (up
        to the step it took from each): a peer can then never plant a step of another
        incarnation of the job, or one no run of it saved."""
        self.history = history

    def check_admitted(self, run_id: str, step: int) -> None:
        """Refuse a replica (shard or metadata) of a save outside ``history``."""
        if self.history is not None and not self.history.admits(run_id, step):
            raise ReplicationError(f"replica of step {step} belongs to run {run_id!r}, which is "
                                   f"not part of this job's history")

    @abc.abstractmethod
    def push_shard(self, peer: int, step: int, owner: int) -> int:
        """Send our committed shard (step, owner) to rank ``peer``; return the bytes sent.

        Returns when the peer has verified the checksums and committed the replica (0 bytes
        if it already held an identical one). Raises ReplicationError otherwise.
        """

    @abc.abstractmethod
    def push_metadata(self, peer: int, step: int) -> None:
        """Send the step's global metadata to rank ``peer`` (acknowledged after verification)."""

    @abc.abstractmethod
    def fetch_shard(self, peer: int, step: int, owner: int) -> int:
        """Pull shard (step, owner) from rank ``peer`` into our store, verified and committed."""

    @abc.abstractmethod
    def read_items(self, peer: int, step: int, owner: int, ranges: list[tuple[int, int]],
                   sinks: list, on_range: Callable[[int], None] | None = None) -> int:
        """Read byte ranges of shard (step, owner) held by rank ``peer`` straight into ``sinks``
        (writable uint8 numpy arrays, one per range, of the range's size); return the bytes.
        ``on_range(i)`` is called as soon as range ``i`` has landed.

        Nothing is written to our store: recovery streams a replaced node's bytes directly into
        the model's tensors. The caller verifies checksums (while later ranges arrive).
        """

    @abc.abstractmethod
    def fetch_metadata(self, peer: int, step: int) -> None:
        """Pull the step's global metadata from rank ``peer``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving and release sockets/threads."""
