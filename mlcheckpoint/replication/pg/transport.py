"""Process-group transport: bytes over torch.distributed send/recv on a dedicated group.

The group is created for replication alone (gloo for CPU buffers; NCCL through a GPU bounce
buffer), never the training group, so replication cannot deadlock with training collectives.
Control messages (offers, requests, replies) go through the job's c10d store, sealed
(``control.py``); the store has timeouts, so a send/recv is only ever posted when the other
side is known to be waiting for it. Once a side said it will send, nothing may stop it short of
the peer's failure: a recv cannot be called off, and one left waiting times out and closes the
group's pair to us for good. So whatever the sends need (the shard's mapping, a GPU bounce
buffer) is in hand before the offer or the reply that promises them. A pair that did close
(a transfer timed out: a peer stalled past ``timeout``, or died) is not opened again by the
group: this rank then says so once, and refuses every later transfer with that peer at once,
in both directions, instead of posting sends and recvs that can only fail after a timeout
(``lost_pairs``). Replication with that peer stays off until the job restarts.

Each rank serves its mailbox on one thread, one request at a time: the request service
(``core/service.py``) answers it, through the ``Request`` that carries its replies and bytes.
A rank looks in its mailbox only when its node's doorbell rang,
which the node's leader alone watches in the store, on a thread of its own (``control.py``).
What arrives lands through the receive sink (``core/sink.py``), which verifies and commits it.

Paced transfers (pushes, and fetches that ask for it) go in pieces of the bandwidth budget's
chunk, each booked on the node's budget (``core/budget.py``) before it is sent; the side that
sends names the piece size in its offer or reply, so the receiver posts matching recvs.
Unpaced ones go in one message (NCCL: one per bounce buffer), as before.

What this rank asks of its peers, ``core/transport.py`` asks the same for every transport,
over ``PgWire``: a request posted to the peer's mailbox, its replies awaited there, the bytes
by the group under the request's tag.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..._messages import RateLimitedLog
from ...errors import ProtocolError, ReplicationError
from ...settings import ReplicationOptions, Timeouts
from ...store import LocalStore, Manifest
from ...store.local_store import ShardSource
from ...topology import Topology
from ..core.budget import node_budget
from ..core.checks import MALFORMED, MAX_ERROR_TEXT, want_int, want_str
from ..core.network import choose_endpoint
from ..core.rendezvous import Rendezvous
from ..core.service import RequestService
from ..core.sink import Receipt, ReceiveSink
from ..core.transport import Transport
from .control import MAX_TAG, Doorbell, Mailbox

log = logging.getLogger(__name__)
_BOUNCE_BYTES = 256 << 20  # GPU staging chunk for NCCL
# Bounds on the piece size a peer names (0: one message): no one-byte messages, no piece
# larger than a bounce buffer.
MIN_PIECE_BYTES = 64 << 10
MAX_PIECE_BYTES = _BOUNCE_BYTES
STORE_RETRY_S = 1.0  # after a failed look at the c10d store (a doorbell, a mailbox)


def want_piece(msg: dict) -> int:
    """The piece size a peer's offer or reply names, checked (absent: 0, one message)."""
    piece = want_int(msg, "piece", 0, MAX_PIECE_BYTES + 1) if "piece" in msg else 0
    if 0 < piece < MIN_PIECE_BYTES:
        raise ProtocolError(f"piece of {piece} bytes is below {MIN_PIECE_BYTES}")
    return piece


class Request:
    """One authenticated request being answered (the service's ``Channel``): who sent it, and
    where the next reply goes (the first one, then "done" once "ready" was sent, or nowhere
    once the requester awaits no more). Bytes go by the transport's group, under its tag."""

    def __init__(self, transport: PgTransport, msg: dict):
        self.msg, self._transport = msg, transport
        self.peer = want_int(msg, "from", 0, transport.rdzv.world_size)
        self.tag = want_int(msg, "tag", 0, MAX_TAG)
        self.nonce = want_str(msg, "nonce", 64)
        self.op = msg.get("op")
        self._phase = "r"

    def reply(self, answer: dict, then: str | None = None) -> None:
        if self._phase:
            self._transport.mailbox.reply(self.peer, self.tag, self.nonce, answer, self._phase)
        if then is not None:
            self._phase = then

    def answer(self, reply: dict) -> None:
        self.reply(reply)

    def receive_shard(self, receipt: Receipt) -> None:
        piece = want_piece(self.msg)  # the sender's, in its offer
        bounce = self._transport._bounce(receipt.ranges)  # (before "ready")
        self.reply({"status": "ready"}, then="done")
        self._transport._fill(receipt, self.peer, self.tag, piece, bounce)

    def send_shard(self, reply: dict, source: ShardSource, ranges: list[tuple[int, int]],
                   paced: bool) -> None:
        piece = self._transport._piece(paced)
        # (mapped, and the bounce made, before the reply: see ``_bounce``)
        mapped = source.mapping(source.manifest.data_bytes) if any(n for _, n in ranges) else None
        bounce = self._transport._bounce(ranges)
        self.reply({**reply, "piece": piece}, then="")
        for o, n in ranges:
            if n and mapped is not None:
                self._transport._send_bytes(mapped.array[o:o + n], self.peer, self.tag, piece, bounce)

    def receive_metadata(self, req: dict) -> bytes:
        return self._transport.mailbox.take_blob(self.peer, self.nonce, req.get("sha256"))

    def send_metadata(self, reply: dict, raw: bytes, paced: bool) -> None:
        # The (small) metadata travels through the c10d store, unpaced: only resumes fetch it.
        mailbox = self._transport.mailbox
        self.reply({**reply, "sha256": mailbox.put_blob(self._transport.rdzv.rank, self.nonce, raw)})


class PgTransport(Transport):
    """Replication over a dedicated process group (collective to construct: all ranks).

    Args:
        store: this node's store (what we send is read from it).
        rdzv: the job's rendezvous (secret, session and control messages).
        options: resolved (``ReplicationOptions.resolved``). What this transport takes:
            ``mode`` ("nccl": an NCCL group, through a GPU bounce buffer, each rank having
            selected its CUDA device; else gloo, CPU buffers), ``bandwidth`` (the node's
            budget for what we send in the background, bytes/s; None or 0: no cap; "auto":
            the default for ``interface``, else for the one routing to MASTER_ADDR) and
            ``interface`` (the NIC whose speed sets the "auto" budget: the group itself picks
            its interface, GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME).
        timeouts: ``replication`` (seconds any single wait may take) and ``mailbox_poll``
            (seconds between looks at the node's doorbell, its leader's in the store, and at
            the node's file of it, every rank's); default: the defaults, with
            ``options.timeout``.
        sink: where what we receive lands (default: one of its own over ``store``).
        topology: the job's shape (default: one node): its ranks on each node, numbered node
            by node, share a doorbell; MASTER_ADDR and MASTER_PORT find the "auto" link.
    """

    def __init__(self, store: LocalStore, rdzv: Rendezvous, options: ReplicationOptions,
                 timeouts: Timeouts | None = None, *, sink: ReceiveSink | None = None,
                 topology: Topology | None = None):
        timeouts = timeouts or Timeouts(replication=options.timeout)
        topology = topology or Topology()
        super().__init__(store, sink if sink is not None else ReceiveSink(store))
        self.rdzv, self.timeout = rdzv, timeouts.replication
        bandwidth = options.bandwidth or 0
        link = (choose_endpoint(interface=options.interface, master_addr=topology.master_addr,
                                master_port=topology.master_port).interface
                if bandwidth == "auto" else None)
        self.budget = node_budget(bandwidth, link, store.paths.bandwidth)
        self.backend = "nccl" if options.mode == "nccl" else "gloo"
        self.name = f"pg/{self.backend}"
        self.mailbox = Mailbox(rdzv, store.job_id, self.timeout, topology)
        self.bell = Doorbell(rdzv, self.mailbox.seal, store.paths.pg_bell, topology)
        self.logs = RateLimitedLog(log)
        self.group = dist.new_group(backend=self.backend, timeout=timedelta(seconds=self.timeout))
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if self.backend == "nccl" else None)
        self._poll = timeouts.mailbox_poll
        self._closed = threading.Event()
        self.lost_pairs: dict[int, str] = {}  # peer -> the failure that closed the pair
        self.wire = PgWire(self)
        self.service = RequestService(store, self.sink, rdzv.world_size)
        self._thread = threading.Thread(target=self._serve_loop, name="mlckpt-pg-serve", daemon=True)
        self._thread.start()
        # The leader's look at the doorbell runs beside its serving, which may take as long as
        # a transfer: the node's other ranks are woken meanwhile.
        self._relay: threading.Thread | None = None
        if self.bell.leader:
            self._relay = threading.Thread(target=self._relay_loop, name="mlckpt-pg-bell", daemon=True)
            self._relay.start()

    # ------------------------------------------------------------------ bytes
    def _piece(self, paced: bool) -> int:
        """The piece size for a transfer we send: the budget's chunk when paced under a cap,
        else 0 (one message)."""
        if not paced or not self.budget.capped:
            return 0
        return min(MAX_PIECE_BYTES, max(MIN_PIECE_BYTES, self.budget.chunk))

    def _cuts(self, nbytes: int, piece: int) -> list[tuple[int, int]]:
        """(start, length) of the messages a transfer of ``nbytes`` is sent in; both sides
        compute the same from the piece size the sender named."""
        size = piece or nbytes
        if self.device is not None:
            size = min(size, _BOUNCE_BYTES)
        size = max(size, 1)
        return [(start, min(size, nbytes - start)) for start in range(0, nbytes, size)]

    def _bounce(self, ranges: list[tuple[int, int]]) -> torch.Tensor | None:
        """The GPU staging buffer for moving ``ranges`` ((offset, bytes), the largest piece
        bounded by ``_BOUNCE_BYTES``; NCCL: None on gloo). Made before the peer is told to
        expect the bytes: it then waits in a recv that nothing but our sends ends (a gloo or
        NCCL recv cannot be called off)."""
        if self.device is None:
            return None
        largest = max((n for _, n in ranges), default=0)
        return torch.empty(max(1, min(_BOUNCE_BYTES, largest)), dtype=torch.uint8, device=self.device)

    def _send_bytes(self, array, peer: int, tag: int, piece: int, bounce: torch.Tensor | None) -> None:
        """Send ``array`` in the cuts of ``piece``, through ``bounce`` (``_bounce``); each piece
        booked on the budget first when ``piece`` is set (a paced transfer)."""
        data = torch.from_numpy(array)
        try:
            for start, n in self._cuts(data.numel(), piece):
                if piece:
                    self.budget.take(n)
                part = data[start:start + n]
                if bounce is not None:
                    bounce[:n].copy_(part)
                    part = bounce[:n]
                dist.send(part, dst=peer, group=self.group, tag=tag)
        except RuntimeError as e:  # the group's send failed: the peer is gone or timed out
            raise self._lose_pair(peer, f"sending to rank {peer} failed: {e}") from None

    def _recv_bytes(self, array, peer: int, tag: int, piece: int = 0,
                    bounce: torch.Tensor | None = None) -> None:
        """Receive ``array`` in the cuts the sender used (``piece``, as it named it), through
        ``bounce`` (made here if the caller made none: a read of items learns the sizes from the
        reply)."""
        data = torch.from_numpy(array)
        if bounce is None:
            bounce = self._bounce([(0, data.numel())])
        try:
            for start, n in self._cuts(data.numel(), piece):
                if bounce is None:
                    dist.recv(data[start:start + n], src=peer, group=self.group, tag=tag)
                else:
                    dist.recv(bounce[:n], src=peer, group=self.group, tag=tag)
                    data[start:start + n].copy_(bounce[:n])
        except RuntimeError as e:  # the group's recv failed: the peer is gone or timed out
            raise self._lose_pair(peer, f"receiving from rank {peer} failed: {e}") from None

    def _lose_pair(self, peer: int, what: str) -> ReplicationError:
        """A send or recv with ``peer`` failed: the group closed its pair to it for good (see
        the module docstring). Said once, at ERROR; the error for the caller."""
        if peer not in self.lost_pairs:
            self.lost_pairs[peer] = what[:500]
            log.error("mlcheckpoint: %s; the process group does not open its connection to rank "
                      "%d again, so replication with rank %d stays off until the job restarts "
                      "(replication=\"tcp\" reconnects after such a failure)", what, peer, peer)
        return ReplicationError(what)

    def check_pair(self, peer: int) -> None:
        """ReplicationError, before anything is asked or promised, if the group's connection
        to ``peer`` closed earlier in this run."""
        lost = self.lost_pairs.get(peer)
        if lost is not None:
            raise ReplicationError(f"the process group's connection to rank {peer} closed earlier "
                                   f"in this run ({lost}); it stays closed until the job restarts")

    def _fill(self, receipt: Receipt, peer: int, tag: int, piece: int,
              bounce: torch.Tensor | None) -> None:
        """Fill a receipt with the shard ``peer`` pushes under ``tag`` (the caller commits):
        its ranges in order (a partial replica: its items'), each cut by ``piece``, through
        the ``bounce`` made before "ready"."""
        for offset, nbytes in receipt.ranges:
            self._recv_bytes(receipt.array[offset:offset + nbytes], peer, tag, piece, bounce)
        receipt.arriving(receipt.nbytes, receipt.nbytes)

    # ------------------------------------------------------------------ server
    def _relay_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self.bell.relay()
            except Exception as e:  # noqa: BLE001 - the store failed: a hiccup, or the job ends
                self._store_failed("doorbell", e)
                continue
            self._closed.wait(self._poll)

    def _store_failed(self, what: str, e: Exception) -> None:
        """A look at the c10d store failed: say so (at most every 10 s) and look again after
        STORE_RETRY_S, until ``close``. Before, one failure (a store operation timing out on
        a loaded machine) ended the loop for good: the node's requests went unanswered."""
        if not self._closed.is_set():
            self.logs.log(logging.WARNING, what, "mlcheckpoint: pg transport %s failed: %s; "
                          "looking again every %.1fs", what, e, STORE_RETRY_S)
            self._closed.wait(STORE_RETRY_S)

    def _serve_loop(self) -> None:
        seq, look = 1, False  # look: the doorbell rang since the mailbox was last seen empty
        while not self._closed.is_set():
            try:
                raw = self.mailbox.take_request(seq) if look else None
                if raw is None:
                    look = self.bell.rang()  # no store operation
                    if not look:
                        self._closed.wait(self._poll)
                    continue
            except Exception as e:  # noqa: BLE001 - the store failed: a hiccup, or the job ends
                self._store_failed("mailbox", e)
                continue
            slot, seq = seq, seq + 1  # each slot is read once: a message is never accepted twice
            try:
                self._handle(self.mailbox.open_request(slot, raw))
            except ProtocolError as e:
                self.logs.log(logging.WARNING, "refused",
                              "mlcheckpoint: pg transport refused a request: %s", e)
            except Exception:  # a bug: say so, and keep serving
                self.logs.log(logging.ERROR, "bug", "mlcheckpoint: pg transport request failed",
                              exc_info=True)

    def _handle(self, msg: dict) -> None:
        """Answer one authenticated request; anything malformed in it gets an error reply (or,
        when it does not even say where to reply, a warning)."""
        req = Request(self, msg)
        try:
            self.check_pair(req.peer)
        except ReplicationError as e:  # (said once, when it closed: the requester learns it now)
            req.reply({"status": "error", "error": str(e)[:MAX_ERROR_TEXT]})
            return
        try:
            self.service.answer(msg, req)
        except (*MALFORMED, RuntimeError) as e:  # RuntimeError: any other torch failure
            log.warning("mlcheckpoint: pg transport request %.100r from rank %d failed: %s",
                        req.op, req.peer, e)  # a sealed request: a rank of this job, worth every line
            req.reply({"status": "error", "error": str(e)[:MAX_ERROR_TEXT]})

    def close(self) -> bool:
        self._closed.set()
        threads = [t for t in (self._thread, self._relay) if t is not None]
        for t in threads:
            t.join(timeout=5)
        with contextlib.suppress(Exception):
            dist.destroy_process_group(self.group)
        self.budget.close()
        return not any(t.is_alive() for t in threads)



class PgWire:
    """The way to a peer over the process group (``core/transport.Wire``): one call at
    a time per rank, each a request in the peer's mailbox."""

    def __init__(self, transport: PgTransport):
        self.transport = transport
        self._lock = threading.Lock()  # one outgoing transfer at a time per rank

    def streams(self, nbytes: int) -> int:
        return 1  # one group, one tag: a transfer goes as one request

    @contextlib.contextmanager
    def call(self, peer: int) -> Iterator[PgCall]:
        self.transport.check_pair(peer)
        with self._lock:
            yield PgCall(self.transport, peer)


class PgCall:
    """One request (``core/transport.Call``): posted, sealed, into the peer's mailbox; its first
    reply comes in phase "r", any later one in phase "done"; bytes go by the group under the
    request's tag, cut in the pieces the sending side named."""

    def __init__(self, transport: PgTransport, peer: int):
        self.transport, self.peer = transport, peer
        self.mailbox = transport.mailbox
        self.tag, self.nonce = 0, ""
        self.phase = "r"
        self.piece = 0  # of a push: what our offer named
        self._outgoing: tuple[Any, torch.Tensor | None] | None = None  # a push's mapping, bounce

    def ask(self, request: dict, nonce: str | None = None) -> dict:
        self.tag, self.nonce = self.mailbox.post(self.peer, request, nonce=nonce)
        return self.reply()

    def reply(self) -> dict:
        msg = self.mailbox.await_reply(self.tag, self.nonce, phase=self.phase)
        self.phase = "done"
        return msg

    # ------------------------------------------------------------------ shards
    def offer_shard(self, request: dict, m: Manifest, ranges: list[tuple[int, int]]) -> dict:
        """The shard mapped (the same save) and the bounce made before the offer: once the
        peer answers "ready" it waits for every byte, so nothing may fail between (see
        ``PgTransport._bounce``)."""
        with self.transport.store.shards.open(m.step, m.rank, m.save_id) as source:  # (this save's)
            buf = source.mapping(m.data_bytes)
        self._outgoing = buf, self.transport._bounce(ranges)
        self.piece = self.transport._piece(paced=True)
        return self.ask({**request, "piece": self.piece})

    def send_shard(self, m: Manifest, ranges: list[tuple[int, int]], ready: dict) -> None:
        if self._outgoing is None:
            raise ProtocolError("send_shard without an offer")
        buf, bounce = self._outgoing
        for offset, nbytes in ranges:
            self.transport._send_bytes(buf.array[offset:offset + nbytes], self.peer, self.tag,
                                       self.piece, bounce)

    def receive_range(self, sink: Any, reply: dict) -> None:
        self.transport._recv_bytes(sink, self.peer, self.tag, want_piece(reply))

    # ------------------------------------------------------------------ metadata
    def offer_metadata(self, request: dict, raw: bytes) -> dict:
        """The file goes first, as a blob in the store the sealed request names; the peer
        answers "ok" once it took it."""
        self.transport.budget.take(len(raw))  # it crosses the network to the c10d store's host
        nonce = secrets.token_hex(16)
        digest = self.mailbox.put_blob(self.transport.rdzv.rank, nonce, raw)
        return self.ask({**request, "sha256": digest}, nonce=nonce)

    def send_metadata(self, raw: bytes) -> None:
        raise ProtocolError("the peer asked again for metadata sent with the offer")

    def receive_metadata(self, reply: dict) -> bytes:
        # The (small) metadata travels through the c10d store, and the peer serves it unpaced
        # whatever the request says: only resumes fetch metadata, and they are never paced.
        return self.mailbox.take_blob(self.peer, self.nonce, reply.get("sha256"))
