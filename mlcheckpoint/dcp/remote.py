"""What the reader needs from other nodes: byte ranges of a shard this node lacks, and
whether any other node holds a shard at all (else the reader turns to the item's copies).

Declared here, in layer 2, so the reader never imports recovery or replication (layers 3
and 4); recovery's ``Holders`` (recovery/holders.py) is the implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np


class RemoteReads(Protocol):
    """Reads of shards held by other nodes, for one step being loaded."""

    def read_ranges(self, step: int, owner: int, ranges: list[tuple[int, int]],
                    sinks: list[np.ndarray], on_range: Callable[[int], None],
                    group: tuple[int, ...] | None = None) -> list[int]:
        """Read the byte ranges ``(offset, nbytes)`` of ``owner``'s shard of ``step`` from the
        nodes that hold it, straight into ``sinks`` (one writable uint8 array per range),
        calling ``on_range(i)`` as range ``i`` lands (from any thread). Returns the node each
        range came from (so a checksum mismatch names that copy). The caller verifies the checksums.
        ``group``: the ranges are items of that copy group (``store/coverage.py``), which a
        partial replica holding the group may serve too (None: whole shards only).
        Raises ShardNotFoundError when no holder can serve it."""
        ...

    def has_holders(self, step: int, owner: int, group: tuple[int, ...] | None = None) -> bool:
        """Whether another node holds ``owner``'s shard of ``step`` (the one being loaded)
        whole, or, with ``group``, a partial replica of it holding that copy group."""
        ...
