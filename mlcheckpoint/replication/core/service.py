"""What a rank answers to its peers' requests, whatever transport carried them: the one place
their meaning is written.

A transport's listener reads a request off its wire (a TCP frame, a sealed mailbox message),
wraps the way back to the requester in a ``Channel`` and hands both to
``RequestService.answer``. The service checks every field the request names (``checks.py``),
decides what to answer (a save outside the job's history is refused, a replica held already is
answered "have", a shard not here "missing"), pins the step it serves, and lands what it
receives through the sink (``begin``, verify and commit, then ``received`` publishes the
event). The channel only carries the answers and moves the bytes, each in its own wire's terms.

    op            fields            answers
    put_shard     owner, manifest   have | ready, the bytes, ok (verified and committed)
    read_items    owner, ranges,    missing | ok, the ranges in order
                  paced
    put_metadata  checksum          have | ready, the file, ok (checked and installed)
    get_metadata  paced             missing | ok, the file

The bytes of a pushed shard are its whole data, or, for a partial replica (a manifest marked
``partial``: only the items that lacked places were sent), its items' ranges in order
(``Manifest.held_ranges``), each landing at its own offset. A partial replica serves only
what it holds: a read naming bytes outside its items is answered "missing", never with holes.
A replaced node rebuilds a shard with reads of its items (``recovery/holders.py``), so no
request asks for a shard whole.

``paced``: send within the node's bandwidth budget (a heal), not at the link's speed (a resume
waits for these bytes). Every request also names ``job_id`` and ``step``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

from ...errors import ProtocolError, ShardNotFoundError
from ...store import LocalStore
from ...store.local_store import ShardSource
from .checks import (
    MAX_RANGES,
    MAX_STEP,
    checked_ranges,
    manifest_from_wire,
    want_bool,
    want_int,
    within,
)
from .sink import Receipt, ReceiveSink

MAX_OWNER = 1 << 20  # the bound on the rank a get or read names (it need not be a rank now)


class Channel(Protocol):
    """The way back to the requester of one request, as its transport carries it."""

    def answer(self, reply: dict) -> None:
        """Send ``reply`` (a status and its fields) to the requester."""

    def receive_shard(self, receipt: Receipt) -> None:
        """Answer "ready" (with what the wire needs) and fill ``receipt.array`` with the bytes
        the requester sends."""

    def send_shard(self, reply: dict, source: ShardSource, ranges: list[tuple[int, int]],
                   paced: bool) -> None:
        """Answer ``reply``, then send these byte ranges of the shard, in order (within the
        node's budget when ``paced``)."""

    def receive_metadata(self, req: dict) -> bytes:
        """Answer "ready" if the wire needs it, and receive the metadata file ``req`` offers."""

    def send_metadata(self, reply: dict, raw: bytes, paced: bool) -> None:
        """Answer ``reply`` (with what the wire needs to take the file), then send ``raw``."""


class RequestService:
    """Answers the requests of this rank's peers for every transport of the rank.

    Args:
        store: this node's store (what is served is read from it).
        sink: where what peers push lands (its pins guard what is served).
        world_size: ranks in the job (the owner of a pushed shard is one of them).
    """

    def __init__(self, store: LocalStore, sink: ReceiveSink, world_size: int):
        self.store, self.sink, self.world_size = store, sink, world_size
        self._ops: dict[str, Callable[[dict, int, Channel], None]] = {
            "put_shard": self._put_shard, "read_items": self._read_items,
            "put_metadata": self._put_metadata, "get_metadata": self._get_metadata}

    def step_of(self, req: dict) -> int:
        """The step a request names; ProtocolError for a request of another job."""
        if req.get("job_id") != self.store.job_id:
            raise ProtocolError(f"request for job {str(req.get('job_id'))[:100]!r}")
        return want_int(req, "step", 0, MAX_STEP)

    def answer(self, req: dict, channel: Channel) -> None:
        """Answer one request of a rank of this job (it proved it knows the secret). Anything
        malformed in it raises one of ``checks.MALFORMED``; the transport answers that with an
        error."""
        op = req.get("op")
        handler = self._ops.get(op) if isinstance(op, str) else None
        if handler is None:
            raise ProtocolError(f"unknown operation {str(op)[:100]!r}")
        handler(req, self.step_of(req), channel)

    # ------------------------------------------------------------------ receiving
    def _put_shard(self, req: dict, step: int, channel: Channel) -> None:
        owner = want_int(req, "owner", 0, self.world_size)
        m = manifest_from_wire(req.get("manifest"), self.store.job_id, step, owner)
        self.sink.check_admitted(m.run_id, step)
        if self.sink.holds(m):
            channel.answer({"status": "have"})
            return
        with self.sink.begin(m) as receipt:
            channel.receive_shard(receipt)
            receipt.commit()
        channel.answer({"status": "ok"})
        self.sink.received(m)

    def _put_metadata(self, req: dict, step: int, channel: Channel) -> None:
        if self.sink.holds_metadata(step, req.get("checksum")):
            channel.answer({"status": "have"})
            return
        self.sink.commit_metadata(step, channel.receive_metadata(req), offered=True)
        channel.answer({"status": "ok"})

    # ------------------------------------------------------------------ serving
    @contextlib.contextmanager
    def _serving(self, req: dict, step: int, channel: Channel) -> Iterator[ShardSource | None]:
        """The requested shard, open and its step pinned while the block sends it; None once
        "missing" is answered."""
        owner = want_int(req, "owner", 0, MAX_OWNER)
        with self.sink.pins.pinned(step):
            try:
                source = self.store.shards.open(step, owner)
            except ShardNotFoundError:
                channel.answer({"status": "missing"})
                yield None
                return
            with source:
                yield source

    def _read_items(self, req: dict, step: int, channel: Channel) -> None:
        paced = want_bool(req, "paced")
        ranges = req.get("ranges")
        if not isinstance(ranges, list) or len(ranges) > MAX_RANGES:
            raise ProtocolError("malformed ranges")
        with self._serving(req, step, channel) as source:
            if source is not None:
                m = source.manifest
                checked = checked_ranges(ranges, m.data_bytes)
                if m.partial and not within(checked, m.held_ranges()):
                    channel.answer({"status": "missing"})  # holes are never served
                    return
                channel.send_shard({"status": "ok"}, source, checked, paced)

    def _get_metadata(self, req: dict, step: int, channel: Channel) -> None:
        paced = want_bool(req, "paced")
        try:
            raw = self.store.metadata.read_file(step)
        except ShardNotFoundError:
            channel.answer({"status": "missing"})
            return
        channel.send_metadata({"status": "ok"}, raw, paced)
