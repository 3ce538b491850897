"""Replication under faults and hostile peers: real sockets, real processes, real signals.

Endpoints are TcpTransports joined through a TCPStore the test process hosts. Some live in the
test process (so the test can read their logs and stores directly), others in a process of
their own (tests/workers/repl_peer.py) so they can be SIGKILLed or SIGSTOPped. Nothing here
mocks sockets or torch.distributed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
import traceback

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import WAIT, wait_for
from tcp_job import (
    Job,
    assert_serves,
    connect,
    debris,
    frames_to_eof,
    half_close,
    make_shard,
    manifest_dict,
)

from mlcheckpoint import MemoryStorageWriter
from mlcheckpoint.integrity.checksum import checksum
from mlcheckpoint.replication import ReplicationError, Replicator
from mlcheckpoint.replication.core.checks import MAX_METADATA_BYTES
from mlcheckpoint.replication.tcp import protocol as p
from mlcheckpoint.replication.tcp.transport import TcpTransport
from mlcheckpoint.store import (
    LocalStore,
    ManifestItem,
    MetadataHeader,
)
from mlcheckpoint.store.manifest import encode_metadata
from mlcheckpoint.topology import Topology

pytestmark = pytest.mark.timeout(300)


# --------------------------------------------------------------------------- helpers
def snapshot(root: str) -> dict[str, tuple]:
    """Every file and directory under ``root``: path -> (kind, size)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(d, name), root)] = ("dir", 0)
        for name in files:
            path = os.path.join(d, name)
            with contextlib.suppress(FileNotFoundError):
                out[os.path.relpath(path, root)] = ("file", os.stat(path).st_size)
    return out


def peak_rss_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "X"


def read_to_eof(sock: socket.socket) -> bytes:
    """Everything the server still sends until it closes (a reset counts as closed)."""
    chunks = []
    while True:
        try:
            b = sock.recv(1 << 16)
        except ConnectionResetError:
            break
        if not b:
            break
        chunks.append(b)
    return b"".join(chunks)


def raw_frame(body: bytes) -> bytes:
    return p.FRAME + struct.pack("!I", len(body)) + body


def pair(job: Job, **receiver_kw) -> tuple[TcpTransport, TcpTransport]:
    """Receiver = rank 0 (it makes the secret), legitimate sender = rank 1, both in-process."""
    receiver = job.endpoint(0, **receiver_kw)
    sender = job.endpoint(1)
    return receiver, sender


# --------------------------------------------------------------------------- strangers
def _stranger_garbage(t: TcpTransport) -> None:
    with connect(t) as s:
        hello = p.recv_exact(s, len(p.MAGIC) + 1 + p.NONCE)
        assert hello[:4] == p.MAGIC
        s.sendall(os.urandom(p.NONCE + 32))
        assert read_to_eof(s) == b"", "a stranger got an answer to a garbage handshake"


def _stranger_wrong_secret(t: TcpTransport) -> None:
    with connect(t) as s, pytest.raises(p.ProtocolError):
        p.client_handshake(s, b"not the secret" * 4)


def _stranger_skips_handshake(t: TcpTransport) -> None:
    # knows the wire format and the job but not the secret: sends a put_shard right away
    req = {"op": "put_shard", "job_id": t.store.job_id, "step": 3, "owner": 1,
           "manifest": manifest_dict(t.store.job_id, 3, 1)}
    with connect(t) as s:
        s.sendall(raw_frame(json.dumps(req).encode()) + bytes(64))
        data = read_to_eof(s)
        assert len(data) <= len(p.MAGIC) + 1 + p.NONCE, "server answered beyond its greeting"


def _stranger_hangs_up(t: TcpTransport) -> None:
    with connect(t) as s:
        p.recv_exact(s, 5)


STRANGERS = {"garbage": _stranger_garbage, "wrong_secret": _stranger_wrong_secret,
             "skips_handshake": _stranger_skips_handshake, "hangs_up": _stranger_hangs_up}


@pytest.mark.parametrize("kind", list(STRANGERS))
def test_stranger_is_refused_and_listener_keeps_serving(make_job, tcp_warnings, kind):
    job = make_job()
    receiver, sender = pair(job)
    before = snapshot(job.node_dir(0))
    STRANGERS[kind](receiver)
    wait_for(lambda: any("refused replication connection" in m for m in tcp_warnings()),
             "a warning about the refused stranger", diag=lambda: "\n".join(tcp_warnings()))
    assert snapshot(job.node_dir(0)) == before, "a stranger's connection wrote into the store"
    assert receiver.store.inventory.steps() == []
    assert_serves(job, receiver, sender, step=3)


def test_idle_strangers_do_not_lock_out_partners(make_job):
    """Connections that never authenticate must not keep a partner's push out.

    A stranger (a port scanner, a health check) that opens connections and says nothing holds
    each one until the handshake times out; as many as ``max_connections`` of them must not
    make the listener refuse its real partner meanwhile."""
    job = make_job()
    receiver, sender = pair(job, max_connections=4)
    idle = [connect(receiver) for _ in range(4)]
    try:
        for s in idle:  # each is accepted and greeted: it holds a slot
            assert p.recv_exact(s, 5)[:4] == p.MAGIC
        m = make_shard(sender.store, 3, 1, 4096)
        assert sender.push_shard(0, 3, 1) == m.data_bytes
        receiver.store.verify_shard(3, 1)
    finally:
        for s in idle:
            s.close()


# --------------------------------------------------------------------------- authenticated junk
def _huge(job, t):  # a frame header claiming 4 GiB of JSON
    return struct.pack("!4sI", p.FRAME, 0xFFFFFFFF), None


def _over_limit(job, t):
    return struct.pack("!4sI", p.FRAME, p.MAX_FRAME_BYTES + 1), None


def _garbage(job, t):
    return b"\x00GARBAGE" + os.urandom(200), None


def _not_json(job, t):
    return raw_frame(b"\xff\xfe{not json"), None


def _not_object(job, t):
    return raw_frame(b"[1, 2, 3]"), None


def _unknown_op(job, t):
    return raw_frame(json.dumps({"op": "delete_everything", "job_id": job.job_id, "step": 1}).encode()), None


def _truncated(job, t):
    return struct.pack("!4sI", p.FRAME, 1000) + b'{"op": "put', None


def _tib_shard(job, t):  # a well-formed manifest claiming a 1 TiB shard
    n = 1 << 40
    req = {"op": "put_shard", "job_id": job.job_id, "step": 9, "owner": 1,
           "manifest": manifest_dict(job.job_id, 9, 1, n, [ManifestItem("w", 0, n, 0)])}
    return raw_frame(json.dumps(req).encode()), b"\x00" * 4096


def _over_max_shard(job, t):
    n = t.sink.max_shard_bytes + 64
    req = {"op": "put_shard", "job_id": job.job_id, "step": 9, "owner": 1,
           "manifest": manifest_dict(job.job_id, 9, 1, n, [ManifestItem("w", 0, 64, 0)])}
    return raw_frame(json.dumps(req).encode()), b"\x00" * 4096


def _huge_metadata(job, t):  # announces 1 GiB of metadata (under the 4 GiB cap), sends a little
    req = {"op": "put_metadata", "job_id": job.job_id, "step": 9, "nbytes": min(1 << 30, MAX_METADATA_BYTES - 1)}
    return raw_frame(json.dumps(req).encode()), b"\x00" * 4096


JUNK = {"huge_frame_length": _huge, "frame_over_limit": _over_limit, "garbage": _garbage,
        "not_json": _not_json, "not_an_object": _not_object, "unknown_op": _unknown_op,
        "truncated_frame": _truncated, "put_shard_1TiB": _tib_shard,
        "put_shard_over_max_shard_bytes": _over_max_shard, "put_metadata_1GiB": _huge_metadata}


@pytest.mark.parametrize("kind", list(JUNK))
def test_authenticated_junk_is_rejected_without_allocating(make_job, tcp_warnings, kind):
    job = make_job()
    receiver, sender = pair(job)
    store = receiver.store
    before, usage = snapshot(job.node_dir(0)), store.capacity.usage_bytes()
    blob, payload = JUNK[kind](job, receiver)
    peak_rss_reset()
    base_rss = peak_rss_bytes()
    with connect(receiver) as s:
        p.client_handshake(s, receiver.secret)  # a peer that knows the secret
        s.sendall(blob)
        if payload is None:
            half_close(s)

        def on_ready():  # send a little of what was announced, then hang up
            s.sendall(payload)
            half_close(s)

        frames = frames_to_eof(s, on_ready=on_ready)
    grew = peak_rss_bytes() - base_rss
    # refused (an error frame, or the connection closed), never accepted
    assert all(f.get("status") in ("ready", "error") for f in frames), frames
    wait_for(lambda: tcp_warnings(), "a warning about the rejected request")
    # nothing allocated for the claimed size: no memory, no tmpfs, no file
    assert grew < 256 << 20, f"receiver's peak memory grew by {grew >> 20} MiB"
    assert store.capacity.usage_bytes() == usage
    # the node's lock file (taken to check capacity node-wide) is bookkeeping, not data
    after = {n: v for n, v in snapshot(job.node_dir(0)).items() if os.path.basename(n) != ".lock"}
    new = sorted(set(after) - set(before))
    assert [n for n in new if after[n][0] == "file"] == [], f"a rejected request left files: {new}"
    assert store.inventory.steps() == [], f"a rejected request left a (phantom) step behind: {new}"
    assert after == {n: v for n, v in before.items() if os.path.basename(n) != ".lock"}
    assert_serves(job, receiver, sender, step=4)


# --------------------------------------------------------------------------- names are not paths
def _put(job, step=5, owner=1, job_id=None, manifest=None, **extra):
    jid = job.job_id if job_id is None else job_id
    m = manifest if manifest is not None else manifest_dict(job.job_id, step if isinstance(step, int) and step >= 0 else 5,
                                                            owner if isinstance(owner, int) and owner >= 0 else 1)
    return {"op": "put_shard", "job_id": jid, "step": step, "owner": owner, "manifest": m, **extra}


def _meta_blob(job_id: str, step: int) -> bytes:
    payload = b"not really DCP metadata"
    h = MetadataHeader(job_id=job_id, step=step, world_size=2, ranks=[0, 1], total_bytes=64,
                       payload_bytes=len(payload), checksum=checksum(payload))
    return encode_metadata(h, payload)


def _read(job, step=5, owner=1, ranges=([0, 16],)):
    return {"op": "read_items", "job_id": job.job_id, "step": step, "owner": owner,
            "ranges": [list(r) for r in ranges]}


def _put_metadata(job, blob: bytes):
    return {"op": "put_metadata", "job_id": job.job_id, "step": 5, "nbytes": len(blob)}, blob


PATHS = {
    "job_id_dotdot": lambda j: (_put(j, job_id="../x", manifest=manifest_dict("../x", 5, 1)), bytes(64)),
    "job_id_absolute": lambda j: (_put(j, job_id="/tmp/x", manifest=manifest_dict("/tmp/x", 5, 1)), bytes(64)),
    "step_negative": lambda j: (_put(j, step=-1), bytes(64)),
    "step_string": lambda j: (_put(j, step="../../etc"), bytes(64)),
    "step_too_large": lambda j: (_put(j, step=10**12), bytes(64)),
    "step_float": lambda j: (_put(j, step=5.0), bytes(64)),
    "owner_path": lambda j: (_put(j, owner="../../etc"), bytes(64)),
    "owner_negative": lambda j: (_put(j, owner=-1), bytes(64)),
    "owner_outside_world": lambda j: (_put(j, owner=2, manifest=manifest_dict(j.job_id, 5, 2)), bytes(64)),
    "manifest_other_shard": lambda j: (_put(j, manifest=manifest_dict(j.job_id, 6, 0)), bytes(64)),
    "manifest_other_job": lambda j: (_put(j, manifest=manifest_dict("../x", 5, 1)), bytes(64)),
    "item_past_end": lambda j: (_put(j, manifest=manifest_dict(j.job_id, 5, 1, 64, [ManifestItem("w", 60, 8, 0)])), bytes(64)),
    "item_negative_offset": lambda j: (_put(j, manifest=manifest_dict(j.job_id, 5, 1, 64, [ManifestItem("w", -8, 8, 0)])), bytes(64)),
    "negative_data_bytes": lambda j: (_put(j, manifest=manifest_dict(j.job_id, 5, 1, -64, [])), b""),
    "manifest_not_object": lambda j: (_put(j, manifest="../../etc/passwd"), bytes(64)),
    "get_shard_served_no_more": lambda j: ({"op": "get_shard", "job_id": j.job_id, "step": 5, "owner": 1}, None),
    "read_items_owner_path": lambda j: (_read(j, owner="../../etc"), None),
    "read_items_step_path": lambda j: (_read(j, step="../5"), None),
    "read_items_past_end": lambda j: (_read(j, ranges=[[0, 4096], [4000, 1 << 20]]), None),
    "read_items_negative_offset": lambda j: (_read(j, ranges=[[-4096, 4096]]), None),
    "read_items_malformed_range": lambda j: (_read(j, ranges=[["/etc/passwd", 1]]), None),
    "put_metadata_step_negative": lambda j: ({"op": "put_metadata", "job_id": j.job_id, "step": -1, "nbytes": 64}, bytes(64)),
    "put_metadata_names_other_job": lambda j: _put_metadata(j, _meta_blob("../x", 5)),
    "put_metadata_names_other_step": lambda j: _put_metadata(j, _meta_blob(j.job_id, 6)),
}


@pytest.mark.parametrize("kind", list(PATHS))
def test_peer_supplied_names_are_never_paths(make_job, tcp_warnings, kind):
    job = make_job()
    receiver, sender = pair(job)
    req, payload = PATHS[kind](job)
    if req["op"] == "read_items":  # something real to read around: a committed 4 KiB shard
        assert_serves(job, receiver, sender, step=5)
    steps_before = receiver.store.inventory.steps()
    before = snapshot(job.root)
    with connect(receiver) as s:
        p.client_handshake(s, receiver.secret)
        p.send_frame(s, req)
        frames = frames_to_eof(s, on_ready=lambda: s.sendall(payload or b""))
    assert frames == [] or frames[-1].get("status") == "error", frames
    assert all(f.get("status") in ("ready", "error") for f in frames), frames
    wait_for(lambda: tcp_warnings(), "a warning about the rejected request")
    after = snapshot(job.root)
    new = sorted(set(after) - set(before))
    assert new == [], f"a rejected request created {new}"
    assert not os.path.exists(os.path.join(job.node_dir(0), "x"))
    assert not os.path.exists(os.path.join(job.root, "x"))
    assert receiver.store.inventory.steps() == steps_before
    assert_serves(job, receiver, sender, step=7)


# --------------------------------------------------------------------------- replicator behaviour
def topology(rank: int, world: int = 2) -> Topology:
    return Topology(rank=rank, world_size=world, local_rank=0, local_world_size=1,
                    node_rank=rank, num_nodes=world)


def small_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32, 16, generator=g), "step": torch.tensor([step])}


def save(store: LocalStore, step: int, rep: Replicator | None) -> None:
    """A training step's checkpoint: a real DCP save into the store, then the replicator told
    of it, as the Saver's publish does."""
    writer = MemoryStorageWriter(step, store)
    dcp.save(small_state(step), storage_writer=writer)
    if rep is not None:
        rep.notify(step, writer.save_id)


def start_replicator(job: Job, t: TcpTransport, rank: int = 0) -> Replicator:
    rep = Replicator(t.store, t, t.rdzv, topology(rank), poll_interval=0.05)
    job.replicators.append(rep)
    rep.activate()  # a manager does this once it has resumed (or saves)
    return rep


class RecordingTcp(TcpTransport):
    """A real TcpTransport that remembers which shards it pushed."""

    def __init__(self, *a, **kw):
        self.pushed: list[tuple[int, int, int]] = []
        self.metadata_pushed: list[tuple[int, int]] = []
        super().__init__(*a, **kw)

    def push_shard(self, peer: int, step: int, owner: int, items=None) -> int:
        self.pushed.append((peer, step, owner))
        return super().push_shard(peer, step, owner, items)

    def push_metadata(self, peer: int, step: int) -> None:
        self.metadata_pushed.append((peer, step))
        return super().push_metadata(peer, step)


def test_replicator_pushes_only_the_newest_and_supersedes_the_rest(make_job):
    job = make_job()
    sender = job.endpoint(0, cls=RecordingTcp)
    receiver = job.endpoint(1)
    for step in (1, 2, 3):  # committed before the replicator gets to run
        save(sender.store, step, None)
    job.idle_rank(1)
    rep = start_replicator(job, sender)
    wait_for(lambda: (st := rep.state(3)) is not None and st.state == "replicated",
             "step 3 to be replicated", diag=lambda: repr([rep.state(s) for s in (1, 2, 3)]))
    assert sender.pushed == [(1, 3, 0)]
    for s in (1, 2):
        st = rep.state(s)
        assert st is not None and st.state == "superseded" and "3" in (st.reason or ""), st
        assert st.attempts == 0
    rstore = receiver.store
    assert [s for s in rstore.inventory.steps() if 0 in rstore.inventory.step_state(s).committed_ranks] == [3]
    rstore.verify_shard(3, 0)
    # a newer save is pushed too; the superseded steps stay superseded and are never sent
    save(sender.store, 4, rep)
    wait_for(lambda: (st := rep.state(4)) is not None and st.state == "replicated", "step 4 replicated")
    assert sender.pushed == [(1, 3, 0), (1, 4, 0)]
    assert [rep.state(s).state for s in (1, 2, 3, 4)] == ["superseded", "superseded", "replicated", "replicated"]
    # rank 0 also sent the newest step's metadata to the partner node
    wait_for(lambda: rstore.inventory.step_state(4).has_metadata, "metadata of step 4 on the partner")


def test_metadata_written_after_the_shard_commits_still_reaches_the_partner(make_job):
    """A DCP-native save tells the replicator at its shard's commit that only this node will
    hold the save's metadata; the coordinator may write that metadata a moment later. A save
    no round ever names (a newer one superseded it) must still get its metadata to the
    partner once it is written, or the partner holds the save's shards without it: it was
    dropped as "not here" before (a job test saw it under load)."""
    job = make_job()
    sender = job.endpoint(0, cls=RecordingTcp)
    receiver = job.endpoint(1)
    job.idle_rank(1)
    rep = start_replicator(job, sender)
    writer = MemoryStorageWriter(5, sender.store)
    dcp.save(small_state(5), storage_writer=writer)
    meta = sender.store.paths.metadata(5)
    os.rename(meta, meta + ".late")  # the coordinator has not written it yet
    rep.notify(5, writer.save_id, share_metadata=True)
    time.sleep(0.5)  # several of the replicator's passes (every 0.05 s) look and find none
    save(sender.store, 6, rep)  # a newer save: rounds name step 6 only
    wait_for(lambda: (st := rep.state(6)) is not None and st.state == "replicated", "step 6 replicated")
    assert not receiver.store.inventory.step_state(5).has_metadata
    os.rename(meta + ".late", meta)  # ...and now it has
    wait_for(lambda: receiver.store.inventory.step_state(5).has_metadata, "step 5's metadata on the partner",
             diag=lambda: repr(sender.metadata_pushed))
    assert (1, 6) in sender.metadata_pushed and (1, 5) in sender.metadata_pushed
    assert (1, 5, 0) not in sender.pushed  # its shard stays superseded: only the metadata goes


@pytest.mark.slow
def test_stopped_partner_does_not_stall_saves(make_job):
    """A partner frozen with SIGSTOP: saves keep committing locally while the push to it is
    stuck; once it resumes, replication catches up with the newest step (older ones dropped)."""
    job = make_job()
    sender = job.endpoint(0, timeout=WAIT, cls=RecordingTcp)
    proc = job.spawn(1, "serve", timeout=WAIT)
    job.status("1.ready", proc)
    rstore = LocalStore(job.node_dir(1), job.job_id, create=False)
    job.idle_rank(1)
    rep = start_replicator(job, sender)
    store = sender.store

    def state(s):
        st = rep.state(s)
        return None if st is None else st.state

    save(store, 0, rep)
    wait_for(lambda: state(0) == "replicated", "step 0 replicated to the live partner", diag=job.logs)
    # The metadata push follows the shard's: stopping the partner in the middle of it would hold
    # the replicator there (until its timeout) instead of on step 1's push, which is the case here.
    wait_for(lambda: not rep.metadata_targets or rep.state(0).metadata_pushed is not None,
             "step 0's metadata pushed", diag=job.logs)
    rstore.verify_shard(0, 0)

    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: proc_state(proc.pid) == "T", "the partner to stop")
        save(store, 1, rep)
        # the replicator has started pushing step 1 and is stuck on the frozen partner: on the
        # metadata, which rank 0 sends before naming the round (the other nodes read which
        # shards need no sending from it), or on the shard
        wait_for(lambda: (1, 1) in sender.metadata_pushed
                 or ((st := rep.state(1)) is not None and st.attempts >= 1), "a push of step 1")
        for step in (2, 3):  # training goes on: these saves return and commit locally
            save(store, step, rep)
        for step in (1, 2, 3):
            store.verify_shard(step, 0)
            assert store.inventory.step_state(step).complete
            assert not os.path.exists(rstore.paths.manifest(step, 0))
        assert state(1) in (None, "committed", "failed"), rep.state(1)  # pending, not replicated
        assert state(2) in (None, "committed") and state(3) in (None, "committed")
        assert proc_state(proc.pid) == "T"
    finally:
        os.kill(proc.pid, signal.SIGCONT)

    wait_for(lambda: state(3) == "replicated", "the newest step to be replicated after SIGCONT",
             diag=lambda: f"{[rep.state(s) for s in range(4)]}\n{job.logs()}")
    rstore.verify_shard(3, 0)
    with open(rstore.paths.data(3, 0), "rb") as a, open(store.paths.data(3, 0), "rb") as b:
        n = store.shards.read_manifest(3, 0).data_bytes
        assert a.read(n) == b.read(n)
    assert state(2) == "superseded", rep.state(2)  # queued behind the stuck push: dropped
    assert (1, 2, 0) not in sender.pushed
    assert not os.path.exists(rstore.paths.manifest(2, 0))
    assert state(1) != "committed"
    wait_for(lambda: os.path.exists(rstore.paths.metadata(3)), "metadata of step 3 on the partner")
    assert proc.poll() is None  # the partner survived being frozen


@pytest.mark.slow
def test_reachable_tells_a_killed_peer_from_a_live_one(make_job, tcp_warnings):
    """``reachable``, what a preemption flush asks of a rank whose part is missing: a live
    peer's listener logs the probe in and hears it hang up without a word; once the peer is
    SIGKILLed nothing accepts at its address and the answer is False within the timeout; a
    stranger that took the port and says nothing still counts as something there. A rank
    whose address this one never looked up cannot be told (None): the probe asks no store."""
    job = make_job(3)
    prober = job.endpoint(0)
    job.endpoint(1)  # in this process: its listener's warnings are ours to read
    assert prober.reachable(1, 1.0) is None
    prober.rdzv.lookup("tcp", 1)  # as a push to it or a read from it does
    assert prober.reachable(1, 1.0) is True
    assert tcp_warnings() == []
    proc = job.spawn(2, "serve")
    job.status("2.ready", proc)
    prober.rdzv.lookup("tcp", 2)
    assert prober.reachable(2, 1.0) is True
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    assert prober.reachable(2, 1.0) is False
    assert time.monotonic() - t0 < 30  # (refused at once on loopback; a lost machine: the timeout)
    host, port = prober.rdzv.lookup("tcp", 2).rsplit(":", 1)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind((host, int(port)))
        squatter.listen()
        assert prober.reachable(2, 1.0) is True


def test_replicas_outside_the_jobs_history_are_refused(make_job):
    """A rank receives replicas only of saves made by its run or by the runs it resumed from
    (up to the step it took from each): a peer cannot plant another incarnation's step."""
    from mlcheckpoint.store.identity import Lineage

    job = make_job()
    receiver, sender = job.endpoint(0), job.endpoint(1)
    receiver.sink.accept_from(Lineage("run-b", (("run-a", 5),)))
    refused = [(6, "run-a"), (1_000_000_000, "run-x"), (3, "run-x")]
    admitted = [(5, "run-a"), (2, "run-a"), (7, "run-b"), (8, "run-b")]
    for step, run in refused + admitted:
        make_shard(sender.store, step, 1, 4096, seed=step, run_id=run)
    for step, run in refused:
        with pytest.raises(ReplicationError, match="not part of this job's history"):
            sender.push_shard(0, step, 1)
    for step, run in admitted:
        assert sender.push_shard(0, step, 1) == 4096
    assert sorted(receiver.store.inventory.steps()) == sorted(s for s, _ in admitted)
    # metadata of another run is refused the same way
    header = MetadataHeader(job_id=job.job_id, step=3, world_size=2, ranks=[0, 1], total_bytes=64,
                            payload_bytes=1, checksum=checksum(b"m"), run_id="run-x", save_id="x3")
    sender.store.metadata.install(3, encode_metadata(header, b"m"))
    with pytest.raises(ReplicationError, match="not part of this job's history"):
        sender.push_metadata(0, 3)
    assert 3 not in receiver.store.inventory.steps()


def _session_threads() -> set:
    return {t for t in threading.enumerate() if t.name == "mlckpt-tcp-conn"}


def _functions_on_stack(thread: threading.Thread) -> list[str]:
    frame = sys._current_frames().get(thread.ident or -1)
    return [f.name for f in traceback.extract_stack(frame)] if frame is not None else []


@pytest.mark.parametrize("streams", [1, 2])
def test_close_ends_a_receive_in_flight_and_joins_its_thread(make_job, streams):
    """A peer stalls halfway through a push (with 2 streams: its second stripe never connects).
    ``close`` cuts the session, joins its thread (it would otherwise write into the store after
    the store closed) and leaves nothing of the partial replica behind."""
    job = make_job()
    receiver = job.endpoint(0, timeout=WAIT)
    before = _session_threads()
    nbytes = 1 << 20
    req = {"op": "put_shard", "job_id": job.job_id, "step": 3, "owner": 1,
           "manifest": manifest_dict(job.job_id, 3, 1, data_bytes=nbytes)}
    if streams > 1:
        req["streams"] = streams
    with connect(receiver) as s:
        p.client_handshake(s, receiver.secret)
        p.send_frame(s, req)
        ready = p.recv_frame(s)
        assert ready["status"] == "ready", ready
        # All of stripe 0 (with 2 streams, the first half), or half of the whole payload.
        s.sendall(bytes(nbytes // 2 if streams > 1 else nbytes // 4))
        wait_for(lambda: len(_session_threads() - before) == 1, "the session's thread")
        (session,) = _session_threads() - before
        # Where it blocks: in the payload's recv, or (2 streams) waiting for the second stripe.
        waits_in = "recv_into_exact" if streams == 1 else "wait"
        wait_for(lambda: waits_in in _functions_on_stack(session), f"the session to block in {waits_in}")
        assert receiver.close() is True
        assert not session.is_alive()
    assert receiver.store.inventory.steps() == [] and debris(receiver.store) == []
