"""Process-group transport: bytes over torch.distributed send/recv on a dedicated group.

The group is created for replication alone (gloo for CPU buffers; NCCL through a GPU bounce
buffer), never the training group, so replication cannot deadlock with training collectives.
Control messages (offers, requests, replies) go through the job's c10d store, which has
timeouts, so a send/recv is only ever posted when the other side is known to be waiting
for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from typing import Callable
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .._faults import crash_point
from ..errors import MLCheckpointError, ShardNotFoundError
from ..store import LocalStore, Manifest
from .rendezvous import Rendezvous
from .transport import OnReceived, Pins, ReplicationError, Transport

log = logging.getLogger(__name__)
_BOUNCE_BYTES = 256 << 20  # GPU staging chunk for NCCL


class PgTransport(Transport):
    """Replication over a dedicated process group (collective to construct: all ranks)."""

    def __init__(self, store: LocalStore, rdzv: Rendezvous, *, backend: str = "gloo",
                 timeout: float = 60.0, pins: Pins | None = None,
                 on_received: OnReceived | None = None, poll_interval: float = 0.01):
        self.store, self.rdzv, self.timeout = store, rdzv, timeout
        self.pins = pins or Pins()
        self.on_received = on_received
        self.backend = backend
        self.name = f"pg/{backend}"
        self.group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout))
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        self._poll = poll_interval
        self._closed = threading.Event()
        self._client_lock = threading.Lock()  # one outgoing transfer at a time per rank
        self._thread = threading.Thread(target=self._serve_loop, name="mlckpt-pg-serve", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ mailbox
    def _post(self, peer: int, msg: dict) -> int:
        tag = self.rdzv.add("pg/tag", 1)
        seq = self.rdzv.add(f"pg/seq/{peer}", 1)
        msg = {**msg, "from": self.rdzv.rank, "tag": tag, "job_id": self.store.job_id}
        self.rdzv.store.set(f"pg/mbox/{peer}/{seq}", json.dumps(msg))
        return tag

    def _reply(self, peer: int, tag: int, msg: dict, phase: str = "r") -> None:
        self.rdzv.store.set(f"pg/reply/{peer}/{tag}/{phase}", json.dumps(msg))

    def _await_reply(self, tag: int, phase: str = "r") -> dict:
        key = f"pg/reply/{self.rdzv.rank}/{tag}/{phase}"
        try:
            self.rdzv.store.wait([key], timedelta(seconds=self.timeout))
        except RuntimeError as e:  # c10d raises on timeout
            raise ReplicationError(f"no reply within {self.timeout}s: {e}") from None
        msg = json.loads(self.rdzv.store.get(key))
        self.rdzv.store.delete_key(key)
        if msg.get("status") == "error":
            raise ReplicationError(f"peer refused: {msg.get('error')}")
        return msg

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
                msg = json.loads(self.rdzv.store.get(key))
                self.rdzv.store.delete_key(key)
            except Exception as e:  # the store went away: the job is ending
                if not self._closed.is_set():
                    log.warning("mlcheckpoint: pg transport mailbox failed: %s", e)
                return
            seq += 1
            try:
                self._handle(msg)
            except Exception as e:
                log.warning("mlcheckpoint: pg transport request %s failed: %s", msg.get("op"), e)

    def _handle(self, msg: dict) -> None:
        peer, tag, op = int(msg["from"]), int(msg["tag"]), msg.get("op")
        if msg.get("job_id") != self.store.job_id:
            self._reply(peer, tag, {"status": "error", "error": "wrong job"})
            return
        step = int(msg["step"])
        if op == "put_shard":
            try:
                m = Manifest.from_dict(msg["manifest"])
                if (m.job_id, m.step, m.rank) != (self.store.job_id, step, int(msg["owner"])):
                    raise ValueError("manifest does not match the offer")
                shard_begin = self._preallocate(m)
            except (MLCheckpointError, ValueError, TypeError, KeyError) as e:
                self._reply(peer, tag, {"status": "error", "error": str(e)})
                return
            self._reply(peer, tag, {"status": "ready"})
            try:
                self._receive_shard(m, peer, tag, lambda: shard_begin)
            except (MLCheckpointError, RuntimeError) as e:
                self._reply(peer, tag, {"status": "error", "error": str(e)}, phase="done")
                return
            self._reply(peer, tag, {"status": "ok"}, phase="done")
            if self.on_received is not None:
                self.on_received(step, m.rank)
        elif op in ("get_shard", "read_items"):
            with self.pins.pinned(step):
                try:
                    m, buf = self.store.map_shard(step, int(msg["owner"]))
                except ShardNotFoundError:
                    self._reply(peer, tag, {"status": "missing"})
                    return
                if op == "get_shard":  # the whole shard, with its manifest
                    ranges, reply = [(0, m.data_bytes)], {"status": "ok", "manifest": m.to_dict()}
                else:  # byte ranges, straight into the requester's tensors
                    ranges, reply = [(int(o), int(n)) for o, n in msg["ranges"]], {"status": "ok"}
                    if any(o < 0 or n < 0 or o + n > m.data_bytes for o, n in ranges):
                        self._reply(peer, tag, {"status": "error", "error": "range outside the shard"})
                        return
                self._reply(peer, tag, reply)
                for o, n in ranges:
                    if n:
                        self._send_bytes(buf.array[o:o + n], peer, tag)
        elif op in ("put_metadata", "get_metadata"):
            blob = f"pg/blob/{tag}"
            if op == "put_metadata":
                self.store.write_metadata_file(step, self.rdzv.store.get(blob))
                self.rdzv.store.delete_key(blob)
                self._reply(peer, tag, {"status": "ok"})
            else:
                try:
                    raw = self.store.read_metadata_file(step)
                except ShardNotFoundError:
                    self._reply(peer, tag, {"status": "missing"})
                    return
                self.rdzv.store.set(blob, raw)
                self._reply(peer, tag, {"status": "ok", "blob": blob})
        else:
            self._reply(peer, tag, {"status": "error", "error": f"unknown op {op!r}"})

    def _preallocate(self, m: Manifest):
        return self.store.begin_shard(m.step, m.rank, m.data_bytes)

    # ------------------------------------------------------------------ client
    def push_shard(self, peer: int, step: int, owner: int) -> int:
        with self._client_lock, self.pins.pinned(step):
            m, buf = self.store.map_shard(step, owner)
            tag = self._post(peer, {"op": "put_shard", "step": step, "owner": owner,
                                    "manifest": m.to_dict()})
            self._await_reply(tag)
            try:
                if m.data_bytes:
                    self._send_bytes(buf.array, peer, tag)
            except RuntimeError as e:
                raise ReplicationError(f"sending step {step} to rank {peer} failed: {e}") from None
            self._await_reply(tag, phase="done")
        return m.data_bytes

    def push_metadata(self, peer: int, step: int) -> None:
        raw = self.store.read_metadata_file(step)
        with self._client_lock:
            tag = self.rdzv.add("pg/tag", 0) + 1  # the tag _post will take
            self.rdzv.store.set(f"pg/blob/{tag}", raw)
            posted = self._post(peer, {"op": "put_metadata", "step": step})
            if posted != tag:  # another rank took that tag meanwhile: move the blob
                self.rdzv.store.set(f"pg/blob/{posted}", raw)
                self.rdzv.store.delete_key(f"pg/blob/{tag}")
            self._await_reply(posted)

    def fetch_shard(self, peer: int, step: int, owner: int) -> int:
        with self._client_lock:
            tag = self._post(peer, {"op": "get_shard", "step": step, "owner": owner})
            resp = self._await_reply(tag)
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} does not hold step {step} rank {owner}")
            m = Manifest.from_dict(resp["manifest"])
            if (m.job_id, m.step, m.rank) != (self.store.job_id, step, owner):
                raise ReplicationError("peer sent a manifest for another shard")
            try:
                self._receive_shard(m, peer, tag, lambda: self.store.begin_shard(step, owner, m.data_bytes))
            except RuntimeError as e:
                raise ReplicationError(f"fetching step {step} rank {owner} from {peer} failed: {e}") from None
        return m.data_bytes

    def read_items(self, peer: int, step: int, owner: int, ranges: list[tuple[int, int]],
                   sinks: list, on_range: Callable[[int], None] | None = None) -> int:
        with self._client_lock:
            tag = self._post(peer, {"op": "read_items", "step": step, "owner": owner,
                                    "ranges": [list(r) for r in ranges]})
            resp = self._await_reply(tag)
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
            tag = self._post(peer, {"op": "get_metadata", "step": step})
            resp = self._await_reply(tag)
            if resp.get("status") == "missing":
                raise ShardNotFoundError(f"rank {peer} has no metadata of step {step}")
            blob = resp["blob"]
            self.store.write_metadata_file(step, self.rdzv.store.get(blob))
            self.rdzv.store.delete_key(blob)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            dist.destroy_process_group(self.group)
