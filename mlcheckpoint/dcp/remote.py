"""What the reader needs from other nodes: which nodes hold an item's bytes, and reads of byte
ranges from them.

Declared here, in layer 2, so the reader never imports recovery or replication (layers 3
and 4); recovery's ``Holders`` (recovery/holders.py) is the implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class RemoteRun:
    """Byte ranges ``(offset, nbytes)`` of ``owner``'s shard to read from ``node``, each
    straight into its sink (a writable uint8 array of ``nbytes``)."""

    owner: int
    node: int
    ranges: list[tuple[int, int]]
    sinks: list[np.ndarray]


class RemoteReads(Protocol):
    """Reads of shards held by other nodes, for one step being loaded."""

    def nodes_holding(self, step: int, owner: int, offset: int) -> list[int]:
        """The other nodes whose copy of ``owner``'s shard of ``step`` (the one being loaded)
        holds the item at ``offset``, in the order this rank should prefer them on a tie;
        [] when none does."""
        ...

    def read_runs(self, step: int, runs: list[RemoteRun],
                  on_range: Callable[[int, int], None]) -> list[BaseException | None]:
        """Read every run from its node, the nodes at once, calling ``on_range(run, range)``
        as each range lands (from any thread). Returns, per run, None or the error that
        stopped it (no rank of its node could serve it: ShardNotFoundError when they answered
        that they do not hold it), once nothing writes into any sink any more. The caller
        verifies the checksums."""
        ...
