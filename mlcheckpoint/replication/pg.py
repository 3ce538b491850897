"""Process-group transport: bytes over torch.distributed send/recv on a dedicated group.

The group is created for replication alone (gloo for CPU buffers; NCCL through a GPU bounce
buffer), never the training group, so replication cannot deadlock with training collectives.
Control messages (offers, requests, replies) go through the job's c10d store, sealed
(``control.py``); the store has timeouts, so a send/recv is only ever posted when the other
side is known to be waiting for it. Each rank serves its mailbox on one thread, one request at
a time, through a table of handlers. What arrives lands through the receive sink
(``sink.py``), which verifies and commits it.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from .._ratelimit import RateLimitedLog
from ..errors import ReplicationError, ShardNotFoundError
from ..store import LocalStore, Manifest
from ..store.buffers import MappedFile
from . import protocol as p
from .control import MAX_TAG, Mailbox
from .rendezvous import Rendezvous
from .sink import Receipt, ReceiveSink
from .transport import Transport

log = logging.getLogger(__name__)
_BOUNCE_BYTES = 256 << 20  # GPU staging chunk for NCCL


class Request:
    """One authenticated request being answered: who sent it, and where the next reply goes
    (the first one, then "done" once "ready" was sent, or nowhere once the requester awaits
    no more)."""

    def __init__(self, transport: PgTransport, msg: dict):
        self.msg, self._transport = msg, transport
        self.peer = p.want_int(msg, "from", 0, transport.rdzv.world_size)
        self.tag = p.want_int(msg, "tag", 0, MAX_TAG)
        self.nonce = p.want_str(msg, "nonce", 64)
        self.op = msg.get("op")
        self._phase = "r"

    def reply(self, answer: dict, then: str | None = None) -> None:
        if self._phase:
            self._transport.mailbox.reply(self.peer, self.tag, self.nonce, answer, self._phase)
        if then is not None:
            self._phase = then


class PgTransport(Transport):
    """Replication over a dedicated process group (collective to construct: all ranks).

    Args:
        store: this node's store (what we send is read from it).
        rdzv: the job's rendezvous (secret, session and control messages).
        sink: where what we receive lands (default: one of its own over ``store``).
        backend: "gloo" (CPU buffers) or "nccl" (through a GPU bounce buffer; each rank must
            have selected its CUDA device).
        timeout: seconds any single wait may take.
        poll_interval: seconds between looks at this rank's mailbox.
    """

    def __init__(self, store: LocalStore, rdzv: Rendezvous, *, sink: ReceiveSink | None = None,
                 backend: str = "gloo", timeout: float = 60.0, poll_interval: float = 0.01):
        self.store, self.rdzv, self.timeout = store, rdzv, timeout
        self.sink = sink if sink is not None else ReceiveSink(store)
        self.backend = backend
        self.name = f"pg/{backend}"
        self.mailbox = Mailbox(rdzv, store.job_id, timeout)
        self.logs = RateLimitedLog(log)
        self.group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout))
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        self._poll = poll_interval
        self._closed = threading.Event()
        self._client_lock = threading.Lock()  # one outgoing transfer at a time per rank
        self.handlers: dict[str, Callable[[Request, int], None]] = {
            "put_shard": self._on_put_shard, "get_shard": self._on_get_shard,
            "read_items": self._on_read_items, "put_metadata": self._on_put_metadata,
            "get_metadata": self._on_get_metadata}
        self._thread = threading.Thread(target=self._serve_loop, name="mlckpt-pg-serve", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ bytes
    def _send_bytes(self, array, peer: int, tag: int) -> None:
        try:
            self._send_tensor(torch.from_numpy(array), peer, tag)
        except RuntimeError as e:  # the group's send failed: the peer is gone or timed out
            raise ReplicationError(f"sending to rank {peer} failed: {e}") from None

    def _recv_bytes(self, array, peer: int, tag: int) -> None:
        try:
            self._recv_tensor(torch.from_numpy(array), peer, tag)
        except RuntimeError as e:  # the group's recv failed: the peer is gone or timed out
            raise ReplicationError(f"receiving from rank {peer} failed: {e}") from None

    def _send_tensor(self, data: torch.Tensor, peer: int, tag: int) -> None:
        if self.device is None:
            dist.send(data, dst=peer, group=self.group, tag=tag)
            return
        bounce = torch.empty(min(_BOUNCE_BYTES, data.numel()), dtype=torch.uint8, device=self.device)
        for start in range(0, data.numel(), bounce.numel()):
            chunk = data[start:start + bounce.numel()]
            bounce[:chunk.numel()].copy_(chunk)
            dist.send(bounce[:chunk.numel()], dst=peer, group=self.group, tag=tag)

    def _recv_tensor(self, data: torch.Tensor, peer: int, tag: int) -> None:
        if self.device is None:
            dist.recv(data, src=peer, group=self.group, tag=tag)
            return
        bounce = torch.empty(min(_BOUNCE_BYTES, data.numel()), dtype=torch.uint8, device=self.device)
        for start in range(0, data.numel(), bounce.numel()):
            n = min(bounce.numel(), data.numel() - start)
            dist.recv(bounce[:n], src=peer, group=self.group, tag=tag)
            data[start:start + n].copy_(bounce[:n])

    def _receive_shard(self, receipt: Receipt, peer: int, tag: int) -> None:
        """Fill a receipt with the shard ``peer`` sends under ``tag``, then verify and commit."""
        if receipt.m.data_bytes:
            self._recv_bytes(receipt.array, peer, tag)
        receipt.arriving(receipt.m.data_bytes, receipt.m.data_bytes)
        receipt.commit()

    # ------------------------------------------------------------------ server
    def _serve_loop(self) -> None:
        seq = 1
        while not self._closed.is_set():
            try:
                raw = self.mailbox.take_request(seq)
                if raw is None:
                    time.sleep(self._poll)
                    continue
            except Exception as e:  # noqa: BLE001 (the store went away: the job is ending)
                if not self._closed.is_set():
                    log.warning("mlcheckpoint: pg transport mailbox failed: %s", e)
                return
            slot, seq = seq, seq + 1  # each slot is read once: a message is never accepted twice
            try:
                self._handle(self.mailbox.open_request(slot, raw))
            except p.ProtocolError as e:
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
            handler = self.handlers.get(req.op) if isinstance(req.op, str) else None
            if handler is None:
                raise p.ProtocolError(f"unknown op {str(req.op)[:100]!r}")
            if msg.get("job_id") != self.store.job_id:
                raise p.ProtocolError("wrong job")
            handler(req, p.want_int(msg, "step", 0, p.MAX_STEP))
        except (*p.MALFORMED, RuntimeError) as e:  # RuntimeError: any other torch failure
            log.warning("mlcheckpoint: pg transport request %.100r from rank %d failed: %s",
                        req.op, req.peer, e)  # a sealed request: a rank of this job, worth every line
            req.reply({"status": "error", "error": str(e)[:2000]})

    def _on_put_shard(self, req: Request, step: int) -> None:
        owner = p.want_int(req.msg, "owner", 0, self.rdzv.world_size)
        m = p.manifest_from_wire(req.msg.get("manifest"), self.store.job_id, step, owner)
        self.sink.check_admitted(m.run_id, step)
        if self.sink.holds(m):
            req.reply({"status": "have"})
            return
        with self.sink.begin(m) as receipt:
            req.reply({"status": "ready"}, then="done")
            self._receive_shard(receipt, req.peer, req.tag)
        req.reply({"status": "ok"})
        self.sink.received(m)

    def _on_get_shard(self, req: Request, step: int) -> None:
        """The whole shard, with its manifest."""
        with self.sink.pins.pinned(step):
            shard = self._map_or_missing(req, step)
            if shard is None:
                return
            m, buf = shard
            req.reply({"status": "ok", "manifest": m.to_dict()}, then="")
            self._send_ranges(req, buf, [(0, m.data_bytes)])

    def _on_read_items(self, req: Request, step: int) -> None:
        """Byte ranges of the shard, straight into the requester's tensors."""
        with self.sink.pins.pinned(step):
            shard = self._map_or_missing(req, step)
            if shard is None:
                return
            m, buf = shard
            ranges = p.checked_ranges(req.msg.get("ranges"), m.data_bytes)
            req.reply({"status": "ok"}, then="")
            self._send_ranges(req, buf, ranges)

    def _map_or_missing(self, req: Request, step: int) -> tuple[Manifest, MappedFile] | None:
        """The requested shard (call with its step pinned), or None once "missing" is sent."""
        owner = p.want_int(req.msg, "owner", 0, 1 << 20)
        try:
            return self.store.map_shard(step, owner)
        except ShardNotFoundError:
            req.reply({"status": "missing"})
            return None

    def _send_ranges(self, req: Request, buf: MappedFile, ranges: list[tuple[int, int]]) -> None:
        for o, n in ranges:
            if n:
                self._send_bytes(buf.array[o:o + n], req.peer, req.tag)

    def _on_put_metadata(self, req: Request, step: int) -> None:
        raw = self.mailbox.take_blob(req.peer, req.nonce, req.msg.get("sha256"))
        self.sink.commit_metadata(step, raw, offered=True)
        req.reply({"status": "ok"})

    def _on_get_metadata(self, req: Request, step: int) -> None:
        try:
            raw = self.store.read_metadata_file(step)
        except ShardNotFoundError:
            req.reply({"status": "missing"})
            return
        req.reply({"status": "ok", "sha256": self.mailbox.put_blob(self.rdzv.rank, req.nonce, raw)})

    # ------------------------------------------------------------------ client
    def push_shard(self, peer: int, step: int, owner: int) -> int:
        with self._client_lock, self.sink.pins.pinned(step):
            m, buf = self.store.map_shard(step, owner)
            tag, nonce = self.mailbox.post(peer, {"op": "put_shard", "step": step, "owner": owner,
                                           "manifest": m.to_dict()})
            if self.mailbox.await_reply(tag, nonce).get("status") == "have":
                return 0
            if m.data_bytes:
                self._send_bytes(buf.array, peer, tag)
            self.mailbox.await_reply(tag, nonce, phase="done")
        return m.data_bytes

    def push_metadata(self, peer: int, step: int) -> None:
        raw = self.store.read_metadata_file(step)
        with self._client_lock:
            nonce = secrets.token_hex(16)
            digest = self.mailbox.put_blob(self.rdzv.rank, nonce, raw)
            tag, _ = self.mailbox.post(peer, {"op": "put_metadata", "step": step, "sha256": digest},
                                nonce=nonce)
            self.mailbox.await_reply(tag, nonce)

    def fetch_shard(self, peer: int, step: int, owner: int) -> int:
        with self._client_lock:
            tag, nonce = self.mailbox.post(peer, {"op": "get_shard", "step": step, "owner": owner})
            resp = self.mailbox.await_reply(tag, nonce)
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} does not hold step {step} rank {owner}")
            m = p.manifest_from_wire(resp.get("manifest"), self.store.job_id, step, owner)
            with self.sink.begin(m) as receipt:
                self._receive_shard(receipt, peer, tag)
        return m.data_bytes

    def read_items(self, peer: int, step: int, owner: int, ranges: list[tuple[int, int]],
                   sinks: list, on_range: Callable[[int], None] | None = None) -> int:
        with self._client_lock:
            tag, nonce = self.mailbox.post(peer, {"op": "read_items", "step": step, "owner": owner,
                                           "ranges": [list(r) for r in ranges]})
            resp = self.mailbox.await_reply(tag, nonce)
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} does not hold step {step} rank {owner}")
            for i, ((_, n), sink) in enumerate(zip(ranges, sinks, strict=True)):
                if n:
                    self._recv_bytes(sink, peer, tag)
                if on_range is not None:
                    on_range(i)
        return sum(n for _, n in ranges)

    def fetch_metadata(self, peer: int, step: int) -> None:
        with self._client_lock:
            tag, nonce = self.mailbox.post(peer, {"op": "get_metadata", "step": step})
            resp = self.mailbox.await_reply(tag, nonce)
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} has no metadata of step {step}")
            raw = self.mailbox.take_blob(peer, nonce, resp.get("sha256"))
            self.sink.commit_metadata(step, raw, offered=False)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            dist.destroy_process_group(self.group)

