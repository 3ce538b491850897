"""Process-group transport: bytes over torch.distributed send/recv on a dedicated group.

The group is created for replication alone (gloo for CPU buffers; NCCL through a GPU bounce
buffer), never the training group, so replication cannot deadlock with training collectives.
Control messages (offers, requests, replies) go through the job's c10d store, which has
timeouts, so a send/recv is only ever posted when the other side is known to be waiting
for it.

Anyone who can reach the master port can read and write that store, so every control message
is sealed: an HMAC under a key derived from the job's secret and this run's session, over the
message, the store key it was written to and, for a reply, the random nonce of the request it
answers. A message is read once, at its key (a rank reads its mailbox slots in order), so a
stranger can neither forge one nor replay an old one; the most it can do is delete them.
Metadata blobs go through the store too and are accepted only with the digest the sealed
message names.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from .._faults import crash_point
from .._ratelimit import RateLimitedLog
from ..errors import MLCheckpointError, ShardNotFoundError
from ..store import LocalStore, Manifest
from . import protocol as p
from .rendezvous import Rendezvous
from .transport import OnReceived, Pins, ReplicationError, Transport

log = logging.getLogger(__name__)
_BOUNCE_BYTES = 256 << 20  # GPU staging chunk for NCCL
MAX_STEP = 10**12
MAX_RANGES = 1 << 20
MAX_TAG = 1 << 30  # gloo tags are 32-bit
# What a malformed request can raise while it is handled: answered with an error reply.
MALFORMED = p.MALFORMED


class Seal:
    """Authenticates control messages in the store (see the module docstring)."""

    def __init__(self, secret: bytes, session: bytes, prefix: str):
        self._key = hmac.new(secret, b"mlcheckpoint pg control\0" + session, hashlib.sha256).digest()
        self._prefix = prefix

    def _mac(self, key: str, answers: str, body: str) -> str:
        text = f"{self._prefix}/{key}\0{answers}\0{body}".encode()
        return hmac.new(self._key, text, hashlib.sha256).hexdigest()

    def seal(self, key: str, msg: dict, answers: str = "") -> str:
        """``msg`` as stored at ``key`` (a reply names the nonce of the request it ``answers``)."""
        body = json.dumps(msg, separators=(",", ":"))
        return json.dumps({"body": body, "mac": self._mac(key, answers, body)})

    def open(self, key: str, raw: bytes, answers: str = "") -> dict:
        """The message stored at ``key``; ProtocolError unless we sealed it for that key."""
        try:
            outer = json.loads(raw)
            body, mac = outer["body"], outer["mac"]
            if not isinstance(body, str) or not isinstance(mac, str):
                raise TypeError("body and mac must be strings")
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
            raise p.ProtocolError(f"control message at {key} is malformed: {e}") from None
        if not hmac.compare_digest(mac, self._mac(key, answers, body)):
            raise p.ProtocolError(f"control message at {key} failed authentication")
        try:
            msg = json.loads(body)
        except ValueError as e:
            raise p.ProtocolError(f"control message at {key} is malformed: {e}") from None
        if not isinstance(msg, dict):
            raise p.ProtocolError(f"control message at {key} is not an object")
        return msg


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


class PgTransport(Transport):
    """Replication over a dedicated process group (collective to construct: all ranks)."""

    def __init__(self, store: LocalStore, rdzv: Rendezvous, *, backend: str = "gloo",
                 timeout: float = 60.0, pins: Pins | None = None,
                 on_received: OnReceived | None = None, poll_interval: float = 0.01,
                 max_shard_bytes: int = 1 << 40):
        self.store, self.rdzv, self.timeout = store, rdzv, timeout
        self.pins = pins or Pins()
        self.on_received = on_received
        self.max_shard_bytes = max_shard_bytes
        self.backend = backend
        self.name = f"pg/{backend}"
        self.seal = Seal(rdzv.secret(), rdzv.session, rdzv.prefix)
        self.logs = RateLimitedLog(log)
        self.group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout))
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        self._poll = poll_interval
        self._closed = threading.Event()
        self._client_lock = threading.Lock()  # one outgoing transfer at a time per rank
        self._thread = threading.Thread(target=self._serve_loop, name="mlckpt-pg-serve", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ mailbox
    def _post(self, peer: int, msg: dict, nonce: str | None = None) -> tuple[int, str]:
        """Put a request in ``peer``'s mailbox; returns its (tag, nonce)."""
        tag = self.rdzv.add("pg/tag", 1) % MAX_TAG
        seq = self.rdzv.add(f"pg/seq/{peer}", 1)
        nonce = nonce or secrets.token_hex(16)
        msg = {**msg, "from": self.rdzv.rank, "tag": tag, "nonce": nonce, "job_id": self.store.job_id}
        key = f"pg/mbox/{peer}/{seq}"
        self.rdzv.store.set(key, self.seal.seal(key, msg))
        return tag, nonce

    def _reply(self, peer: int, tag: int, nonce: str, msg: dict, phase: str = "r") -> None:
        key = f"pg/reply/{peer}/{tag}/{phase}"
        self.rdzv.store.set(key, self.seal.seal(key, msg, answers=nonce))

    def _await_reply(self, tag: int, nonce: str, phase: str = "r") -> dict:
        key = f"pg/reply/{self.rdzv.rank}/{tag}/{phase}"
        try:
            self.rdzv.store.wait([key], timedelta(seconds=self.timeout))
        except RuntimeError as e:  # c10d raises on timeout
            raise ReplicationError(f"no reply within {self.timeout}s: {e}") from None
        raw = self.rdzv.store.get(key)
        self.rdzv.store.delete_key(key)
        try:
            msg = self.seal.open(key, raw, answers=nonce)
        except p.ProtocolError as e:
            raise ReplicationError(f"refused a reply: {e}") from None
        if msg.get("status") == "error":
            raise ReplicationError(f"peer refused: {str(msg.get('error'))[:2000]}")
        return msg

    def _put_blob(self, owner: int, nonce: str, raw: bytes) -> str:
        """Leave ``raw`` in the store for the other side of request ``nonce``; its digest."""
        self.rdzv.store.set(f"pg/blob/{owner}/{nonce}", raw)
        return _digest(raw)

    def _take_blob(self, owner: int, nonce: str, digest: object) -> bytes:
        key = f"pg/blob/{owner}/{nonce}"
        if not self.rdzv.store.check([key]):  # get() would wait for it until the store's timeout
            raise p.ProtocolError("the metadata blob its message names is not in the store")
        raw = self.rdzv.store.get(key)
        self.rdzv.store.delete_key(key)
        if not isinstance(digest, str) or not hmac.compare_digest(_digest(raw), digest):
            raise p.ProtocolError("metadata blob does not match the digest its message names")
        return raw

    # ------------------------------------------------------------------ bytes
    def _send_bytes(self, array, peer: int, tag: int) -> None:
        data = torch.from_numpy(array)
        if self.device is None:
            dist.send(data, dst=peer, group=self.group, tag=tag)
            return
        bounce = torch.empty(min(_BOUNCE_BYTES, data.numel()), dtype=torch.uint8, device=self.device)
        for start in range(0, data.numel(), bounce.numel()):
            chunk = data[start:start + bounce.numel()]
            bounce[:chunk.numel()].copy_(chunk)
            dist.send(bounce[:chunk.numel()], dst=peer, group=self.group, tag=tag)

    def _recv_bytes(self, array, peer: int, tag: int) -> None:
        data = torch.from_numpy(array)
        if self.device is None:
            dist.recv(data, src=peer, group=self.group, tag=tag)
            return
        bounce = torch.empty(min(_BOUNCE_BYTES, data.numel()), dtype=torch.uint8, device=self.device)
        for start in range(0, data.numel(), bounce.numel()):
            n = min(bounce.numel(), data.numel() - start)
            dist.recv(bounce[:n], src=peer, group=self.group, tag=tag)
            data[start:start + n].copy_(bounce[:n])

    def _receive_shard(self, m: Manifest, peer: int, tag: int, begin) -> None:
        shard = begin()
        try:
            if m.data_bytes:
                self._recv_bytes(shard.buffer.array, peer, tag)
            crash_point("replica_mid_recv", m.step, m.rank)
            shard.verify(m)
            shard.commit_manifest(m)
        except BaseException:
            shard.abort()
            raise

    # ------------------------------------------------------------------ server
    def _serve_loop(self) -> None:
        seq = 1
        while not self._closed.is_set():
            key = f"pg/mbox/{self.rdzv.rank}/{seq}"
            try:
                if not self.rdzv.store.check([key]):
                    time.sleep(self._poll)
                    continue
                raw = self.rdzv.store.get(key)
                self.rdzv.store.delete_key(key)
            except Exception as e:  # the store went away: the job is ending
                if not self._closed.is_set():
                    log.warning("mlcheckpoint: pg transport mailbox failed: %s", e)
                return
            seq += 1  # each slot is read once: a message is never accepted twice
            try:
                self._handle(self.seal.open(key, raw))
            except p.ProtocolError as e:
                self.logs.warning("refused", "mlcheckpoint: pg transport refused a request: %s", e)
            except Exception:  # a bug: say so, and keep serving
                self.logs.log(logging.ERROR, "bug", "mlcheckpoint: pg transport request failed",
                              exc_info=True)

    def _handle(self, msg: dict) -> None:
        """Answer one authenticated request; anything malformed in it gets an error reply (or,
        when it does not even say where to reply, a warning)."""
        peer = p.want_int(msg, "from", 0, self.rdzv.world_size)
        tag = p.want_int(msg, "tag", 0, MAX_TAG)
        nonce = p.want_str(msg, "nonce", 64)
        op = msg.get("op")
        handlers = {"put_shard": self._on_put_shard, "get_shard": self._on_send_shard,
                    "read_items": self._on_send_shard, "put_metadata": self._on_put_metadata,
                    "get_metadata": self._on_get_metadata}
        # Where the next reply goes: the first one, "done" once "ready" was sent, or nowhere
        # ("") once the requester awaits no more.
        phase = ["r"]

        def reply(answer: dict, then: str | None = None) -> None:
            if phase[0]:
                self._reply(peer, tag, nonce, answer, phase[0])
            if then is not None:
                phase[0] = then

        try:
            handler = handlers.get(op) if isinstance(op, str) else None
            if handler is None:
                raise p.ProtocolError(f"unknown op {str(op)[:100]!r}")
            if msg.get("job_id") != self.store.job_id:
                raise p.ProtocolError("wrong job")
            step = p.want_int(msg, "step", 0, MAX_STEP)
            handler(msg, step, peer, tag, nonce, reply)
        except (*MALFORMED, RuntimeError) as e:  # RuntimeError: gloo's send/recv failed
            log.warning("mlcheckpoint: pg transport request %.100r from rank %d failed: %s", op,
                        peer, e)  # a sealed request: a rank of this job, worth every line
            reply({"status": "error", "error": str(e)[:2000]})

    def _on_put_shard(self, msg: dict, step: int, peer: int, tag: int, nonce: str, reply) -> None:
        owner = p.want_int(msg, "owner", 0, self.rdzv.world_size)
        m = p.manifest_from_wire(msg.get("manifest"), self.store.job_id, step, owner)
        p.check_offer(m, self.max_shard_bytes)
        self.check_admitted(m.run_id, step)
        shard = self.store.begin_shard(m.step, m.rank, m.data_bytes)
        reply({"status": "ready"}, then="done")
        self._receive_shard(m, peer, tag, lambda: shard)
        reply({"status": "ok"})
        if self.on_received is not None:
            self.on_received(step, m.rank)

    def _on_send_shard(self, msg: dict, step: int, peer: int, tag: int, nonce: str, reply) -> None:
        owner = p.want_int(msg, "owner", 0, 1 << 20)
        with self.pins.pinned(step):
            try:
                m, buf = self.store.map_shard(step, owner)
            except ShardNotFoundError:
                reply({"status": "missing"})
                return
            if msg["op"] == "get_shard":  # the whole shard, with its manifest
                ranges, answer = [(0, m.data_bytes)], {"status": "ok", "manifest": m.to_dict()}
            else:  # byte ranges, straight into the requester's tensors
                ranges, answer = _ranges(msg.get("ranges"), m.data_bytes), {"status": "ok"}
            reply(answer, then="")
            for o, n in ranges:
                if n:
                    self._send_bytes(buf.array[o:o + n], peer, tag)

    def _on_put_metadata(self, msg: dict, step: int, peer: int, tag: int, nonce: str, reply) -> None:
        raw = self._take_blob(peer, nonce, msg.get("sha256"))
        self.check_admitted(p.metadata_from_wire(raw, self.store.job_id, step).run_id, step)
        self.store.write_metadata_file(step, raw)
        reply({"status": "ok"})

    def _on_get_metadata(self, msg: dict, step: int, peer: int, tag: int, nonce: str, reply) -> None:
        try:
            raw = self.store.read_metadata_file(step)
        except ShardNotFoundError:
            reply({"status": "missing"})
            return
        reply({"status": "ok", "sha256": self._put_blob(self.rdzv.rank, nonce, raw)})

    # ------------------------------------------------------------------ client
    def push_shard(self, peer: int, step: int, owner: int) -> int:
        with self._client_lock, self.pins.pinned(step):
            m, buf = self.store.map_shard(step, owner)
            tag, nonce = self._post(peer, {"op": "put_shard", "step": step, "owner": owner,
                                           "manifest": m.to_dict()})
            self._await_reply(tag, nonce)
            try:
                if m.data_bytes:
                    self._send_bytes(buf.array, peer, tag)
            except RuntimeError as e:
                raise ReplicationError(f"sending step {step} to rank {peer} failed: {e}") from None
            self._await_reply(tag, nonce, phase="done")
        return m.data_bytes

    def push_metadata(self, peer: int, step: int) -> None:
        raw = self.store.read_metadata_file(step)
        with self._client_lock:
            nonce = secrets.token_hex(16)
            digest = self._put_blob(self.rdzv.rank, nonce, raw)
            tag, _ = self._post(peer, {"op": "put_metadata", "step": step, "sha256": digest},
                                nonce=nonce)
            self._await_reply(tag, nonce)

    def fetch_shard(self, peer: int, step: int, owner: int) -> int:
        with self._client_lock:
            tag, nonce = self._post(peer, {"op": "get_shard", "step": step, "owner": owner})
            resp = self._await_reply(tag, nonce)
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} does not hold step {step} rank {owner}")
            m = p.manifest_from_wire(resp.get("manifest"), self.store.job_id, step, owner)
            p.check_offer(m, self.max_shard_bytes)
            try:
                self._receive_shard(m, peer, tag, lambda: self.store.begin_shard(step, owner, m.data_bytes))
            except RuntimeError as e:
                raise ReplicationError(f"fetching step {step} rank {owner} from {peer} failed: {e}") from None
        return m.data_bytes

    def read_items(self, peer: int, step: int, owner: int, ranges: list[tuple[int, int]],
                   sinks: list, on_range: Callable[[int], None] | None = None) -> int:
        with self._client_lock:
            tag, nonce = self._post(peer, {"op": "read_items", "step": step, "owner": owner,
                                           "ranges": [list(r) for r in ranges]})
            resp = self._await_reply(tag, nonce)
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} does not hold step {step} rank {owner}")
            try:
                for i, ((_, n), sink) in enumerate(zip(ranges, sinks)):
                    if n:
                        self._recv_bytes(sink, peer, tag)
                    if on_range is not None:
                        on_range(i)
            except RuntimeError as e:
                raise ReplicationError(f"reading step {step} rank {owner} from {peer} failed: {e}") from None
        return sum(n for _, n in ranges)

    def fetch_metadata(self, peer: int, step: int) -> None:
        with self._client_lock:
            tag, nonce = self._post(peer, {"op": "get_metadata", "step": step})
            resp = self._await_reply(tag, nonce)
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} has no metadata of step {step}")
            raw = self._take_blob(peer, nonce, resp.get("sha256"))
            p.metadata_from_wire(raw, self.store.job_id, step)
            self.store.write_metadata_file(step, raw)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            dist.destroy_process_group(self.group)


def _ranges(obj: object, data_bytes: int) -> list[tuple[int, int]]:
    """Peer-supplied (offset, nbytes) pairs, each inside a shard of ``data_bytes``."""
    if not isinstance(obj, list) or len(obj) > MAX_RANGES:
        raise p.ProtocolError("malformed ranges")
    out = []
    for r in obj:
        if (not isinstance(r, list) or len(r) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                or r[0] < 0 or r[1] < 0 or r[0] + r[1] > data_bytes):
            raise p.ProtocolError(f"range {str(r)[:100]} outside the shard")
        out.append((r[0], r[1]))
    return out
