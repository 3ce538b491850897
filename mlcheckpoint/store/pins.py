"""Steps whose buffers a reader in this process holds: a transfer serving or fetching a shard,
a persistent write reading the staged views. Retention (``mlcheckpoint/manager/retention.py``) skips a
pinned step, so a buffer is never recycled under its reader.

Pins live beside the buffers they guard, below everything that takes or honours one: the
transports (through the receive sink), the persistent writer and retention all import it from
here, and none of them calls another to reach it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator


class Pins:
    """Steps pinned in this process, counted (two readers of one step pin it twice). One per
    rank, shared by its transports, its persistent writer and its retention."""

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

    @contextlib.contextmanager
    def held(self) -> Iterator[frozenset[int]]:
        """The pinned steps, with no pin taken or released until the block ends. A retention
        pass plans and retires inside it: a reader pins before it opens the shard, so a pin
        either came first (the pass keeps the step) or finds the shard gone (the reader's
        open fails before it promised anything to a peer), never a shard retired under it."""
        with self._lock:
            yield frozenset(self._count)

    def steps(self) -> set[int]:
        with self._lock:
            return set(self._count)
