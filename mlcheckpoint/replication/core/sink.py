"""The receiving end of every transport: where a replica's bytes land, and what is checked
before they count.

A transport only moves bytes. For a shard it receives, the request service (a push,
``service.py``) or the transport's own fetch asks the sink for a ``Receipt`` (a fresh buffer in
the store, sized by the checked manifest); the transport fills ``receipt.array``, then
``commit()`` verifies every item's checksum and the store's commit protocol makes the replica
visible. Leaving the receipt any other way (an error, a cut connection) aborts it, so a
transfer cut anywhere leaves nothing visible:

    with sink.begin(manifest) as receipt:
        fill(receipt.array)     # calling receipt.landed(n) as bytes arrive in order, if they do
        receipt.commit()
    sink.received(manifest)     # a pushed replica, once acknowledged

The sink also holds what this node decides about replicas: which saves it accepts
(``accept_from``), the largest shard it takes, and the steps pinned while a transfer reads them
(``store/pins.py`` ``Pins``, which retention skips).
Once a pushed replica is in, it publishes a ``ReplicaReceived`` event to its subscribers, given
at construction (the manager subscribes its lifecycle, which applies retention there); the
sink calls nothing else above it. How each replica was received
(``ReceiptTimes``) is kept for the last few, in ``receipt_times``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..._faults import crash_point
from ...errors import MLCheckpointError, ReplicationError
from ...integrity.verify import (
    Listing,
    StreamVerifier,
    digest_item,
    digests_agree,
    same_layout,
)
from ...store import LocalStore, Manifest
from ...store.identity import Lineage
from ...store.pins import Pins
from . import checks

if TYPE_CHECKING:
    from ...store.shards import ShardWriter


log = logging.getLogger(__name__)
KEPT_RECEIPT_TIMES = 64  # ReceiveSink.receipt_times holds the last this many replicas'
# ``ReceiveSink.profile``: replicas committed, their bytes, and seconds getting their buffers,
# receiving (from the buffer to the last byte, streamed hashing included), hashing (on arrival
# and at the commit) and committing.
PROFILE_KEYS = ("received_replicas", "received_bytes", "receive_buffer_seconds",
                "receive_seconds", "verify_seconds", "commit_seconds")


@dataclass
class ReceiptTimes:
    """How one replica was received, for benchmarks and diagnostics. Seconds; ``*_at`` are
    ``time.monotonic()`` stamps, which processes of one machine share.

    ``checksum_s`` counts every hash of the replica, while its bytes arrived in order or at the
    commit (``checksum_at_commit_s`` of it); ``commit_s`` is the commit less its hashing.
    """

    buffer_s: float  # getting the buffer the bytes land in
    buffer_ready_at: float
    cpu_at_begin: float  # time.process_time() then: this process, all threads
    checksum_s: float = 0.0
    checksum_at_commit_s: float = 0.0
    commit_at: float | None = None  # every byte is in; verification and commit start
    commit_s: float | None = None
    cpu_s: float | None = None  # process CPU seconds from the buffer to the commit's end


@dataclass(frozen=True)
class ReplicaReceived:
    """The event a sink publishes once a replica a peer pushed is committed and acknowledged."""

    step: int
    owner: int  # the rank whose shard it is
    # The shard's data bytes: the size of the buffers the owner's next replicas land in. 0 for
    # a partial replica, which lands in a sparse file of its own, never in a pooled buffer.
    nbytes: int


# Subscribers run on the listener thread that received the replica, one after another.
Subscriber = Callable[[ReplicaReceived], None]


class ReceiveSink:
    """Where every transport of one rank lands what it receives.

    Args:
        store: this node's store.
        pins: steps retention must skip; transports pin a step while they read its shard
            (default: pins of its own, which no retention reads: a sink on its own).
        subscribers: called with a ``ReplicaReceived`` once a replica a peer pushed is
            committed and acknowledged (the manager subscribes its lifecycle, which applies
            retention there).
        max_shard_bytes: largest shard a peer may send us (checked before allocating).
    """

    def __init__(self, store: LocalStore, *, pins: Pins | None = None,
                 subscribers: Iterable[Subscriber] = (), max_shard_bytes: int = 1 << 40):
        self.store = store
        self.pins = pins if pins is not None else Pins()
        self.subscribers = list(subscribers)
        self.max_shard_bytes = max_shard_bytes
        # Replicas are received only of saves in this history (set by ``accept_from``).
        self.history: Lineage | None = None
        # (step, owner) -> how its replica was received, the newest KEPT_RECEIPT_TIMES.
        self.receipt_times: OrderedDict[tuple[int, int], ReceiptTimes] = OrderedDict()
        self._times_lock = threading.Lock()
        # Every committed replica's times, summed (``profile``).
        self._totals = dict.fromkeys(PROFILE_KEYS, 0.0)

    # ------------------------------------------------------------------ what is accepted
    def accept_from(self, history: Lineage) -> None:
        """Receive replicas only of saves made by this run or by the runs it resumed from (up
        to the step it took from each): a peer can then never plant a step of another
        incarnation of the job, or one no run of it saved."""
        self.history = history

    def check_admitted(self, run_id: str, step: int) -> None:
        """Refuse a replica (shard or metadata) a peer offers of a save outside ``history``."""
        if self.history is not None and not self.history.admits(run_id, step):
            raise ReplicationError(f"replica of step {step} belongs to run {run_id!r}, which is "
                                   f"not part of this job's history")

    def holds(self, m: Manifest) -> bool:
        """Whether the offered replica is committed here already: the same save (a step saved
        again is a new save, even with equal bytes) and the same bytes, or, for a partial
        replica, a shard of that save here that holds every item it offers."""
        try:
            held = self.store.shards.read_manifest(m.step, m.rank)
        except MLCheckpointError:
            return False
        if held.save_id != m.save_id or held.data_bytes != m.data_bytes:
            return False
        if not m.partial:
            return not held.partial and same_layout(held.items, m.items)
        return Listing(held.items).holds_all(m.items)

    def holds_metadata(self, step: int, digest: object) -> bool:
        """Whether the step's metadata here has this checksum (a push of it is a no-op)."""
        with contextlib.suppress(MLCheckpointError):
            return isinstance(digest, int) and digests_agree(
                digest, digest_item(self.store.metadata.read_file(step)))
        return False

    # ------------------------------------------------------------------ receiving
    def begin(self, m: Manifest) -> Receipt:
        """A fresh buffer for the replica ``m`` describes (its size checked first); for a
        partial replica, a sparse one in which only its items take memory."""
        checks.check_offer(m, self.max_shard_bytes)
        cpu0, t0 = time.process_time(), time.monotonic()
        shard = self.store.begin_shard(m.step, m.rank, m.data_bytes,
                                       m.held_ranges() if m.partial else None)
        t1 = time.monotonic()
        times = ReceiptTimes(buffer_s=t1 - t0, buffer_ready_at=t1, cpu_at_begin=cpu0)
        with self._times_lock:
            self.receipt_times.pop((m.step, m.rank), None)
            self.receipt_times[(m.step, m.rank)] = times
            while len(self.receipt_times) > KEPT_RECEIPT_TIMES:
                self.receipt_times.popitem(last=False)
        return Receipt(shard, m, times, on_commit=self._committed)

    def _committed(self, receipt: Receipt) -> None:
        """Add a committed replica's times to ``profile``; one DEBUG line each."""
        t = receipt.times
        receive = (t.commit_at or t.buffer_ready_at) - t.buffer_ready_at
        with self._times_lock:
            for key, value in zip(PROFILE_KEYS, (1, receipt.nbytes, t.buffer_s, receive,
                                                 t.checksum_s, t.commit_s or 0.0), strict=True):
                self._totals[key] += value
        log.debug("received step %d rank %d: %d bytes, buffer %.3fs, receiving %.3fs, "
                  "verifying %.3fs (%.3fs at the commit), committing %.3fs", receipt.m.step,
                  receipt.m.rank, receipt.nbytes, t.buffer_s, receive, t.checksum_s,
                  t.checksum_at_commit_s, t.commit_s or 0.0)

    def profile(self) -> dict[str, float]:
        """Every replica committed here so far: counts, bytes, seconds (``PROFILE_KEYS``)."""
        with self._times_lock:
            return dict(self._totals)

    def received(self, m: Manifest) -> None:
        """A replica a peer pushed is committed and acknowledged: tell the subscribers."""
        event = ReplicaReceived(m.step, m.rank, 0 if m.partial else m.data_bytes)
        for subscriber in self.subscribers:
            subscriber(event)

    def commit_metadata(self, step: int, raw: bytes, *, offered: bool) -> None:
        """Check a step's metadata file from a peer and install it. ``offered``: the peer
        pushed it (rather than answering our request), so it must be of this job's history."""
        header = checks.metadata_from_wire(raw, self.store.job_id, step)
        if offered:
            self.check_admitted(header.run_id, step)
        self.store.metadata.write_file(step, raw)


class Receipt:
    """One replica arriving into a fresh buffer: filled by a transport, then committed or
    aborted. As a context manager, leaving it without ``commit()`` aborts it."""

    def __init__(self, shard: ShardWriter, m: Manifest, times: ReceiptTimes | None = None,
                 *, on_commit: Callable[[Receipt], None] | None = None):
        self._shard, self.m = shard, m
        self._on_commit = on_commit
        now = time.monotonic()
        self.times = times or ReceiptTimes(0.0, now, time.process_time())
        self.array = shard.buffer.array  # where the transport puts the bytes
        # What arrives, in this order: the whole data, or a partial replica's item ranges
        # (the holes between them are never written: they take no memory).
        self.ranges = m.held_ranges()
        self.nbytes = sum(n for _, n in self.ranges)  # the bytes that cross the wire
        self._verifier = StreamVerifier(self.array, m.items, m.data_bytes,
                                        f"replica of step {m.step} rank {m.rank} on arrival")
        self._streamed = False
        self._passed = (0, 0)  # (ranges wholly landed, their bytes), for ``landed``

    def landed(self, upto: int) -> None:
        """Bytes of the ranges up to offset ``upto`` are in place (one stream, in order): hash
        what is new while it is cache-hot, so no checksum pass trails the transfer."""
        self._streamed = True
        t0 = time.monotonic()
        self._verifier.feed(upto)
        self.times.checksum_s += time.monotonic() - t0
        i, before = self._passed
        while i < len(self.ranges) and upto >= sum(self.ranges[i]):
            before += self.ranges[i][1]
            i += 1
        self._passed = (i, before)
        self.arriving(before + (max(0, upto - self.ranges[i][0]) if i < len(self.ranges) else 0),
                      self.nbytes)

    def landed_from(self, offset: int) -> Callable[[int], None]:
        """``landed`` for a range that starts at ``offset``, called with its bytes in so far."""
        def landed(got: int) -> None:
            self.landed(offset + got)
        return landed

    def views(self) -> list[tuple[int, memoryview]]:
        """(offset, writable view) of each range the bytes arrive in, in order."""
        return [(o, self.array[o:o + n].data) for o, n in self.ranges]

    def arriving(self, got: int, total: int) -> None:
        """``got`` of the ``total`` bytes one stream carries are in: from half way on, a test
        may kill the receiver here (crash point ``replica_mid_recv``)."""
        if got >= total // 2:
            crash_point("replica_mid_recv", self.m.step, self.m.rank)

    def commit(self) -> None:
        """Verify every item's checksum (CorruptShardError naming the first bad one), then
        commit the replica under its owner's manifest."""
        times = self.times
        times.commit_at = t0 = time.monotonic()
        if self._streamed:
            self._verifier.check()
        else:  # the bytes landed out of order or in bulk: hash them all now, on several threads
            self._shard.verify(self.m)
        t1 = time.monotonic()
        self._shard.commit_manifest(self.m)
        t2 = time.monotonic()
        times.checksum_at_commit_s = t1 - t0
        times.checksum_s += t1 - t0
        times.commit_s = t2 - t1
        times.cpu_s = time.process_time() - times.cpu_at_begin
        if self._on_commit is not None:
            self._on_commit(self)

    def abort(self) -> None:
        """Give the buffer back (nothing of it becomes visible); no-op once committed."""
        self._shard.abort()

    def __enter__(self) -> Receipt:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()
