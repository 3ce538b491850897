"""Process-group transport: bytes over torch.distributed send/recv on a dedicated group.

The group is created for replication alone (gloo for CPU buffers; NCCL through a GPU bounce
buffer), never the training group, so replication cannot deadlock with training collectives.
Control messages (offers, requests, replies) go through the job's c10d store, sealed
(``control.py``); the store has timeouts, so a send/recv is only ever posted when the other
side is known to be waiting for it. Each rank serves its mailbox on one thread, one request at
a time: the request service (``core/service.py``) answers it, through the ``Request`` that
carries its replies and bytes. A rank looks in its mailbox only when its node's doorbell rang,
which the node's leader alone watches in the store, on a thread of its own (``control.py``).
What arrives lands through the receive sink (``core/sink.py``), which verifies and commits it.

Paced transfers (pushes, and fetches that ask for it) go in pieces of the bandwidth budget's
chunk, each booked on the node's budget (``core/budget.py``) before it is sent; the side that
sends names the piece size in its offer or reply, so the receiver posts matching recvs.
Unpaced ones go in one message (NCCL: one per bounce buffer), as before.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..._ratelimit import RateLimitedLog
from ...errors import ProtocolError, ReplicationError, ShardNotFoundError
from ...settings import default
from ...store import LocalStore
from ...store.local_store import ShardSource
from ...store.manifest import ManifestItem
from ..core.budget import node_budget
from ..core.checks import MALFORMED, manifest_from_wire, want_int, want_str
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


@dataclass(frozen=True)
class PgSettings:
    """What the process-group transport alone is given: each field is the ``PgTransport``
    argument of the same name (``make_transport`` passes them as they are)."""

    poll_interval: float = default("mailbox_poll")


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
        self.reply({"status": "ready"}, then="done")
        self._transport._fill(receipt, self.peer, self.tag, piece)

    def send_shard(self, reply: dict, source: ShardSource, ranges: list[tuple[int, int]],
                   paced: bool) -> None:
        piece = self._transport._piece(paced)
        mapped = source.mapping(source.manifest.data_bytes) if any(n for _, n in ranges) else None
        self.reply({**reply, "piece": piece}, then="")
        for o, n in ranges:
            if n and mapped is not None:
                self._transport._send_bytes(mapped.array[o:o + n], self.peer, self.tag, piece)

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
        sink: where what we receive lands (default: one of its own over ``store``).
        backend: "gloo" (CPU buffers) or "nccl" (through a GPU bounce buffer; each rank must
            have selected its CUDA device).
        timeout: seconds any single wait may take.
        poll_interval: seconds between looks at the node's doorbell (its leader, in the store)
            and at the node's file of it (every rank).
        ranks_per_node: ranks on each node, numbered node by node (1: every rank watches its
            own doorbell).
        bandwidth: the node's budget for what we send in the background, bytes/s (0: no cap;
            "auto": the default for ``interface``, else for the one routing to MASTER_ADDR).
        interface: the NIC whose speed sets the "auto" budget (the group itself picks its
            interface: GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME).
    """

    def __init__(self, store: LocalStore, rdzv: Rendezvous, *, sink: ReceiveSink | None = None,
                 backend: str = "gloo", timeout: float = default("replication_timeout"),
                 poll_interval: float = default("mailbox_poll"), bandwidth: int | str = 0,
                 interface: str | None = None, master_addr: str = default("master_addr"),
                 master_port: int = default("master_port"), ranks_per_node: int = 1):
        self.store, self.rdzv, self.timeout = store, rdzv, timeout
        self.sink = sink if sink is not None else ReceiveSink(store)
        link = (choose_endpoint(interface=interface, master_addr=master_addr,
                                master_port=master_port).interface
                if bandwidth == "auto" else None)
        self.budget = node_budget(bandwidth, link, store.paths.bandwidth)
        self.backend = backend
        self.name = f"pg/{backend}"
        self.mailbox = Mailbox(rdzv, store.job_id, timeout, ranks_per_node)
        self.bell = Doorbell(rdzv, self.mailbox.seal, store.paths.pg_bell, ranks_per_node)
        self.logs = RateLimitedLog(log)
        self.group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout))
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        self._poll = poll_interval
        self._closed = threading.Event()
        self._client_lock = threading.Lock()  # one outgoing transfer at a time per rank
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

    def _send_bytes(self, array, peer: int, tag: int, piece: int = 0) -> None:
        """Send ``array`` in the cuts of ``piece``; each piece booked on the budget first when
        ``piece`` is set (a paced transfer)."""
        data = torch.from_numpy(array)
        bounce = None if self.device is None else torch.empty(
            min(_BOUNCE_BYTES, data.numel()), dtype=torch.uint8, device=self.device)
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
            raise ReplicationError(f"sending to rank {peer} failed: {e}") from None

    def _recv_bytes(self, array, peer: int, tag: int, piece: int = 0) -> None:
        """Receive ``array`` in the cuts the sender used (``piece``, as it named it)."""
        data = torch.from_numpy(array)
        bounce = None if self.device is None else torch.empty(
            min(_BOUNCE_BYTES, data.numel()), dtype=torch.uint8, device=self.device)
        try:
            for start, n in self._cuts(data.numel(), piece):
                if bounce is None:
                    dist.recv(data[start:start + n], src=peer, group=self.group, tag=tag)
                else:
                    dist.recv(bounce[:n], src=peer, group=self.group, tag=tag)
                    data[start:start + n].copy_(bounce[:n])
        except RuntimeError as e:  # the group's recv failed: the peer is gone or timed out
            raise ReplicationError(f"receiving from rank {peer} failed: {e}") from None

    def _fill(self, receipt: Receipt, peer: int, tag: int, piece: int) -> None:
        """Fill a receipt with the shard ``peer`` sends under ``tag`` (the caller commits):
        its ranges in order (a partial replica: its items'), each cut by ``piece``."""
        for offset, nbytes in receipt.ranges:
            self._recv_bytes(receipt.array[offset:offset + nbytes], peer, tag, piece)
        receipt.arriving(receipt.nbytes, receipt.nbytes)

    # ------------------------------------------------------------------ server
    def _relay_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self.bell.relay()
            except Exception as e:  # noqa: BLE001 (the store went away: the job is ending)
                if not self._closed.is_set():
                    log.warning("mlcheckpoint: pg transport doorbell failed: %s", e)
                return
            self._closed.wait(self._poll)

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
            except Exception as e:  # noqa: BLE001 (the store went away: the job is ending)
                if not self._closed.is_set():
                    log.warning("mlcheckpoint: pg transport mailbox failed: %s", e)
                return
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
            self.service.answer(msg, req)
        except (*MALFORMED, RuntimeError) as e:  # RuntimeError: any other torch failure
            log.warning("mlcheckpoint: pg transport request %.100r from rank %d failed: %s",
                        req.op, req.peer, e)  # a sealed request: a rank of this job, worth every line
            req.reply({"status": "error", "error": str(e)[:2000]})

    # ------------------------------------------------------------------ client
    def push_shard(self, peer: int, step: int, owner: int,
                   items: Sequence[ManifestItem] | None = None) -> int:
        piece = self._piece(paced=True)
        with self._client_lock, self.sink.pins.pinned(step):
            m, buf = self.store.map_shard(step, owner)
            if items is not None:
                m = m.only(list(items))
            ranges = m.held_ranges()
            tag, nonce = self.mailbox.post(peer, {"op": "put_shard", "step": step, "owner": owner,
                                           "manifest": m.to_dict(), "piece": piece})
            if self.mailbox.await_reply(tag, nonce).get("status") == "have":
                return 0
            for offset, nbytes in ranges:  # (a partial replica: its items' ranges, in order)
                self._send_bytes(buf.array[offset:offset + nbytes], peer, tag, piece)
            self.mailbox.await_reply(tag, nonce, phase="done")
        return sum(n for _, n in ranges)

    def push_metadata(self, peer: int, step: int) -> None:
        raw = self.store.read_metadata_file(step)
        with self._client_lock:
            self.budget.take(len(raw))  # it crosses the network to the c10d store's host
            nonce = secrets.token_hex(16)
            digest = self.mailbox.put_blob(self.rdzv.rank, nonce, raw)
            tag, _ = self.mailbox.post(peer, {"op": "put_metadata", "step": step, "sha256": digest},
                                nonce=nonce)
            self.mailbox.await_reply(tag, nonce)

    def fetch_shard(self, peer: int, step: int, owner: int, *, paced: bool = True) -> int:
        with self._client_lock:
            tag, nonce = self.mailbox.post(peer, {"op": "get_shard", "step": step, "owner": owner,
                                                  "paced": paced})
            resp = self.mailbox.await_reply(tag, nonce)
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} does not hold step {step} rank {owner}")
            m = manifest_from_wire(resp.get("manifest"), self.store.job_id, step, owner)
            piece = want_piece(resp)
            with self.sink.begin(m) as receipt:
                self._fill(receipt, peer, tag, piece)
                receipt.commit()
        return receipt.nbytes

    def read_items(self, peer: int, step: int, owner: int, ranges: list[tuple[int, int]],
                   sinks: list, on_range: Callable[[int], None] | None = None, *,
                   paced: bool = False) -> int:
        with self._client_lock:
            tag, nonce = self.mailbox.post(peer, {"op": "read_items", "step": step, "owner": owner,
                                           "ranges": [list(r) for r in ranges], "paced": paced})
            resp = self.mailbox.await_reply(tag, nonce)
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} does not hold step {step} rank {owner}")
            piece = want_piece(resp)
            for i, ((_, n), sink) in enumerate(zip(ranges, sinks, strict=True)):
                if n:
                    self._recv_bytes(sink, peer, tag, piece)
                if on_range is not None:
                    on_range(i)
        return sum(n for _, n in ranges)

    def fetch_metadata(self, peer: int, step: int, *, paced: bool = False) -> None:
        # The (small) metadata travels through the c10d store, and the peer serves it unpaced
        # whatever ``paced`` says: only resumes fetch metadata, and they are never paced.
        with self._client_lock:
            tag, nonce = self.mailbox.post(peer, {"op": "get_metadata", "step": step})
            resp = self.mailbox.await_reply(tag, nonce)
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} has no metadata of step {step}")
            raw = self.mailbox.take_blob(peer, nonce, resp.get("sha256"))
            self.sink.commit_metadata(step, raw, offered=False)

    def close(self) -> bool:
        self._closed.set()
        threads = [t for t in (self._thread, self._relay) if t is not None]
        for t in threads:
            t.join(timeout=5)
        with contextlib.suppress(Exception):
            dist.destroy_process_group(self.group)
        self.budget.close()
        return not any(t.is_alive() for t in threads)

