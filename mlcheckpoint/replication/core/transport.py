"""The one interface every transport implements, and what it asks of peers, written once.

A transport only moves bytes: committed shards and step metadata between ranks, each call
bounded by a timeout. ``Transport`` asks its peers the four operations below itself, for every
transport alike: the request each makes, what every reply status means ("error": the peer
refused; "missing": ShardNotFoundError; "have": nothing to send), landing fetched metadata
through the receive sink, and the words of every error a caller sees. A wire format gives it a
``Wire``: how one request, its replies and its bytes move on that medium (a TCP connection;
the sealed mailbox and a process group), as a ``Call``. This code never sees a socket or a tag,
and a wire never decides what a reply means.

What a transport sends in the background (pushes, and shards it serves to a fetch that asks to
be paced) goes through the node's bandwidth budget (``budget.py``); what a resume waits for
takes the full link. What a peer asks of it is answered by the request service
(``service.py``), the other half of each exchange, the same for every transport; what it
receives lands through a ``ReceiveSink`` (``sink.py``), which verifies every checksum before it
commits through the LocalStore commit protocol, so a transfer cut anywhere leaves nothing
visible. Pins, the received-notification and the history of saves accepted (``accept_from``)
live in the sink, not in the transport.

Each operation's exchange, as the service answers it (a wire may add fields of its own to a
request, e.g. a stream count or a piece size):

    push_shard      put_shard     -> have | ready, the bytes -> ok
    push_metadata   put_metadata  -> have | ready, the file -> ok   (or ok at once, when the
                                                                     wire sent the file along)
    read_items      read_items    -> missing | ok, the ranges' bytes in order
    fetch_metadata  get_metadata  -> missing | ok, the file
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from ...errors import ProtocolError, ReplicationError, ShardNotFoundError
from ...store import LocalStore, Manifest
from ...store.manifest import ManifestItem
from .budget import Budget
from .checks import MAX_ERROR_TEXT
from .sink import ReceiveSink
from .streams import run_streams, split_evenly

__all__ = ["ReplicationError", "Transport"]
log = logging.getLogger(__name__)

class Call(Protocol):
    """One request to a peer and everything that follows it, as one wire carries them. Any
    method may raise OSError or ProtocolError: the transfer broke, or the peer (or a stranger in
    its place) broke the protocol; ``Transport`` words both for the caller."""

    def ask(self, request: dict) -> dict:
        """Send ``request`` (with the fields the wire adds); the peer's first reply."""

    def reply(self) -> dict:
        """The peer's next reply, once the bytes of the request moved."""

    def offer_shard(self, request: dict, m: Manifest, ranges: list[tuple[int, int]]) -> dict:
        """``ask`` a put_shard ``request`` whose bytes are ``ranges`` of our committed shard
        ``m``, naming what the wire needs to send them (a stream count, a piece size). A wire
        whose peer cannot be released once it waits for the bytes takes hold of them first."""

    def send_shard(self, m: Manifest, ranges: list[tuple[int, int]], ready: dict) -> None:
        """Send these byte ranges of our committed shard ``m``, in order, within the node's
        budget; ``ready``: the peer's answer to the offer."""

    def receive_range(self, sink: Any, reply: dict) -> None:
        """Fill ``sink`` (a writable uint8 array) with the next bytes the peer sends after
        ``reply``."""

    def offer_metadata(self, request: dict, raw: bytes) -> dict:
        """``ask`` a put_metadata ``request`` for the file ``raw``. A wire may send the file
        along (the peer then answers "ok" at once) or after the peer's "ready"."""

    def send_metadata(self, raw: bytes) -> None:
        """Send the file after the peer's "ready", within the node's budget."""

    def receive_metadata(self, reply: dict) -> bytes:
        """The metadata file the peer sends after ``reply``."""


class Wire(Protocol):
    """How a wire format reaches a peer: what a ``Transport`` asks over."""

    def call(self, peer: int) -> contextlib.AbstractContextManager[Call]:
        """A call to rank ``peer``, open while the block runs."""

    def streams(self, nbytes: int) -> int:
        """How many calls side by side a transfer of ``nbytes`` goes over (1: one call)."""


class Transport(abc.ABC):
    """Moves committed shards and metadata between ranks of one job: asks its peers over
    ``wire`` (below, the same for every transport) and serves theirs (each transport's own).

    Args:
        store: this node's store (what we push is read from it).
        sink: where what we receive and fetch lands (its pins guard what we push).
    A transport sets ``wire``, its way to a peer, and ``budget`` before it asks anything.
    """

    name: str = "?"
    budget: Budget  # paces what it sends in the background; its counters say how much
    wire: Wire  # how a request to a peer moves on this transport's medium

    def __init__(self, store: LocalStore, sink: ReceiveSink):
        self.store, self.sink = store, sink
        self._reads_lock = threading.Lock()  # a resume reads from several holders at once
        self._reads: Counter[int] = Counter()  # calls side by side -> reads done over that many

    def describe(self) -> str:
        """One line for the log: how this transport sends, and within what budget."""
        return f"{self.name}, {self.budget.describe()}"

    def reachable(self, peer: int, timeout: float) -> bool | None:
        """Whether rank ``peer``'s process still serves, asked within ``timeout`` seconds:
        False when nothing accepts where it listened (its process or its machine is gone),
        None where this transport cannot tell."""
        return None

    @abc.abstractmethod
    def close(self) -> bool:
        """Stop serving and release sockets/threads. False when a thread that serves peers
        (and may write into the store) is still running after a bounded wait."""

    def reads_by_streams(self) -> dict[int, int]:
        """How many ``read_items`` calls completed over each number of streams."""
        with self._reads_lock:
            return dict(self._reads)

    # ------------------------------------------------------------------ replies
    @contextlib.contextmanager
    def _call(self, peer: int, what: str) -> Iterator[Call]:
        """A call to ``peer`` for ``what``; a broken transfer or protocol, on any wire, is one
        ReplicationError that names the peer and what was asked."""
        try:
            with self.wire.call(peer) as call:
                yield call
        except (OSError, ProtocolError) as e:
            raise ReplicationError(f"transfer with rank {peer} failed ({what}): {e}") from None

    @staticmethod
    def _status(reply: dict, peer: int, what: str, *expected: str) -> str:
        """The status of a peer's reply to ``what`` (one of ``expected``); ReplicationError if
        the peer refused, ProtocolError for a status the exchange does not have."""
        status = reply.get("status")
        if status == "error":
            raise ReplicationError(f"rank {peer} refused {what}: "
                                   f"{str(reply.get('error'))[:MAX_ERROR_TEXT]}")
        if status not in expected:
            raise ProtocolError(f"unexpected reply {str(status)[:100]!r} to {what}")
        return str(status)

    # ------------------------------------------------------------------ push
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
        what = f"the push of step {step} rank {owner}"
        with self.sink.pins.pinned(step):
            m = self.store.shards.read_manifest(step, owner)
            if items is not None:
                m = m.only(list(items))
            ranges = m.held_ranges()  # (a partial replica: its items' ranges, in order)
            with self._call(peer, what) as call:
                ready = call.offer_shard({"op": "put_shard", "step": step, "owner": owner,
                                          "manifest": m.to_dict()}, m, ranges)
                if self._status(ready, peer, what, "have", "ready") == "have":
                    return 0
                call.send_shard(m, ranges, ready)
                self._status(call.reply(), peer, what, "ok")
        return sum(n for _, n in ranges)

    def push_metadata(self, peer: int, step: int) -> None:
        """Send the step's global metadata to rank ``peer`` (acknowledged after verification),
        paced by our budget."""
        what = f"the push of the metadata of step {step}"
        raw = self.store.metadata.read_file(step)
        with self._call(peer, what) as call:
            first = call.offer_metadata({"op": "put_metadata", "step": step}, raw)
            if self._status(first, peer, what, "have", "ready", "ok") == "ready":
                call.send_metadata(raw)
                self._status(call.reply(), peer, what, "ok")

    # ------------------------------------------------------------------ pull
    # The reads below are sent by the peer, so the request carries ``paced``: True makes
    # the peer send within its node's budget (background work, e.g. healing after a resume),
    # False at the full speed of the link (a resume waiting for the bytes).

    def read_items(self, peer: int, step: int, owner: int, ranges: list[tuple[int, int]],
                   sinks: list, on_range: Callable[[int], None] | None = None, *,
                   paced: bool = False) -> int:
        """Read byte ranges of shard (step, owner) held by rank ``peer`` straight into ``sinks``
        (writable uint8 numpy arrays, one per range, of the range's size); return the bytes.
        ``on_range(i)`` is called as soon as range ``i`` has landed, whichever of the calls
        the read went over (``Wire.streams``) carried its last piece.

        Nothing is written to our store: recovery streams a replaced node's bytes directly into
        the model's tensors. The caller verifies checksums (while later ranges arrive).
        ShardNotFoundError if the peer does not hold the shard.
        """
        total = sum(n for _, n in ranges)
        groups = _deal(ranges, sinks, self.wire.streams(total))
        left = Counter(i for group in groups for i, _, _, _ in group)  # pieces of each range
        lock = threading.Lock()
        what = f"the read of step {step} rank {owner}"

        def read_group(group: list[_Piece]) -> None:
            with self._call(peer, what) as call:
                reply = call.ask({"op": "read_items", "step": step, "owner": owner,
                                  "ranges": [[offset, n] for _, offset, n, _ in group],
                                  "paced": paced})
                if self._status(reply, peer, what, "missing", "ok") == "missing":
                    raise ShardNotFoundError(f"rank {peer} does not hold step {step} rank {owner}")
                for i, _, n, sink in group:
                    if n:
                        call.receive_range(sink, reply)
                    with lock:
                        left[i] -= 1
                        last = left[i] == 0
                    if last and on_range is not None:
                        on_range(i)

        errors = run_streams(read_group, groups)  # returns once no call writes into the sinks
        if errors:
            raise next((e for e in errors if isinstance(e, ShardNotFoundError)), errors[0])
        with self._reads_lock:
            self._reads[len(groups)] += 1
        log.debug("read %d bytes of step %d rank %d from rank %d over %d streams", total, step,
                  owner, peer, len(groups))
        return total

    def fetch_metadata(self, peer: int, step: int, *, paced: bool = False) -> None:
        """Pull the step's global metadata from rank ``peer`` (checked, then installed);
        ShardNotFoundError if the peer has none."""
        what = f"the fetch of the metadata of step {step}"
        with self._call(peer, what) as call:
            reply = call.ask({"op": "get_metadata", "step": step, "paced": paced})
            if self._status(reply, peer, what, "missing", "ok") == "missing":
                raise ShardNotFoundError(f"rank {peer} has no metadata of step {step}")
            self.sink.commit_metadata(step, call.receive_metadata(reply), offered=False)


# One piece of a read: (index of its range, offset in the shard, bytes, where they land).
_Piece = tuple[int, int, int, Any]


def _deal(ranges: list[tuple[int, int]], sinks: list, streams: int) -> list[list[_Piece]]:
    """The pieces of a read, dealt to ``streams`` calls in about equal byte counts, each call's
    in order. Over one call each range is one piece; over several, ranges are cut so that a
    large one is shared out too."""
    if streams == 1:
        return [[(i, offset, n, sink)
                 for i, ((offset, n), sink) in enumerate(zip(ranges, sinks, strict=True))]]
    total = sum(n for _, n in ranges)
    piece_bytes = max(1, -(-total // (streams * 4)))
    pieces: list[_Piece] = []
    for i, ((offset, nbytes), sink) in enumerate(zip(ranges, sinks, strict=True)):
        for start in range(0, max(nbytes, 1), piece_bytes):  # (an empty range: one piece)
            n = min(piece_bytes, nbytes - start)
            pieces.append((i, offset + start, n, sink[start:start + n]))
    return [g for g in split_evenly(pieces, lambda piece: piece[2], streams) if g]
