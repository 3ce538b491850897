"""One contract, every transport: push, fetch, range read, metadata, missing, corrupt, timeout,
and the bandwidth budget: what is sent in the background is paced, what a resume waits for
is not.

Each test runs over TCP with one stream, TCP with several streams, and the process-group
transport on gloo (and on NCCL where two GPUs are present). The test process is rank 0 and
calls the transport; rank 1 serves from a process of its own (tests/workers/transport_peer.py),
joined through a real TCPStore and a real gloo group, so it can be frozen with SIGSTOP. Both
sides build their transport with ``make_transport``, as the manager does, with a bandwidth
budget (``BANDWIDTH``: every test runs paced). Shards are written and checked straight in each
node's tmpfs directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist
from cluster import WORKERS
from helpers import damage_shard, end_peer, put_metadata, wait_for
from tcp_job import debris

from mlcheckpoint import (
    ConfigError,
    ReplicationError,
    ShardNotFoundError,
)
from mlcheckpoint.errors import MLCheckpointError
from mlcheckpoint.integrity import digests
from mlcheckpoint.replication import ReceiveSink, Rendezvous, Transport
from mlcheckpoint.replication.core.budget import NodeSchedule
from mlcheckpoint.replication.factory import make_transport
from mlcheckpoint.replication.pg.control import MAX_TAG
from mlcheckpoint.replication.pg.transport import PgTransport
from mlcheckpoint.replication.tcp.transport import TcpTransport
from mlcheckpoint.settings import ReplicationOptions
from mlcheckpoint.store import LocalStore

sys.path.insert(0, WORKERS)
from repl_peer import make_shard  # a worker module, found through WORKERS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MiB = 1 << 20
NBYTES = 6 * MiB + 5  # over several stripes of 1 MiB; not a multiple of anything
TIMEOUT = 5.0  # every wait of every transport (the timeout test waits this long once each)
PEER = 1
BANDWIDTH = 512 * 10**6  # each node's budget: chunks of 2 MB, a few per shard, quick


@dataclass
class Setup:
    name: str
    kind: str  # make_transport's
    streams: int | None = None  # the calling side's (TCP)
    gpus: int = 0


SETUPS = [Setup("tcp-1-stream", "tcp", streams=1), Setup("tcp-4-streams", "tcp", streams=4),
          Setup("pg-gloo", "pg"), Setup("pg-nccl", "nccl", gpus=2)]


def _runnable(s: Setup) -> bool:
    return torch.cuda.device_count() >= s.gpus


class Job:
    """Rank 0 here and rank 1 in a process of its own, each with one transport of every kind
    (the peer serves; the tests call ``locals[name]``). Each rank's store is written and read
    straight from here: ``store`` (rank 0) and ``peer_store`` (rank 1)."""

    def __init__(self, root: str):
        self.root = root
        self.job_id = f"contract-{uuid.uuid4().hex[:8]}"
        self.status_dir = os.path.join(root, "status")
        os.makedirs(self.status_dir)
        self.c10d = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        self.log_path = os.path.join(root, "peer.log")
        # Collective constructions (the process groups) happen in this order on both ranks.
        self.kinds = list(dict.fromkeys(s.kind for s in SETUPS if _runnable(s)))
        cfg = {"host": "127.0.0.1", "port": self.c10d.port, "job": self.job_id,
               "dir": self.node_dir(PEER), "kinds": self.kinds, "timeout": TIMEOUT,
               "device": 1 if "nccl" in self.kinds else None, "status_dir": self.status_dir,
               "bandwidth": BANDWIDTH}
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("MLCHECKPOINT_CRASH_AT", None)
        with open(self.log_path, "w") as logf:
            self.proc = subprocess.Popen([sys.executable, os.path.join(WORKERS, "transport_peer.py"),
                                          json.dumps(cfg)], env=env, stdin=subprocess.PIPE,
                                         stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        self.locals: dict[str, Transport] = {}

    def node_dir(self, rank: int) -> str:
        d = os.path.join(self.root, f"node{rank}")
        os.makedirs(d, mode=0o700, exist_ok=True)
        return d

    def start(self) -> None:
        """Join the peer's group and build our transports (collective with the peer)."""
        if "nccl" in self.kinds:
            torch.cuda.set_device(0)
        dist.init_process_group("gloo", store=dist.PrefixStore("contract", self.c10d), rank=0,
                                world_size=2)
        self.store = LocalStore(self.node_dir(0), self.job_id)
        self.peer_store = LocalStore(self.node_dir(PEER), self.job_id)
        self.rdzv = rdzv = Rendezvous.from_default_group(self.job_id, timeout=60)
        sink = ReceiveSink(self.store)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MLCHECKPOINT_TCP_MIN_STRIPE", str(MiB))  # so a few MiB take 4 streams
            for s in SETUPS:
                if _runnable(s):  # (the TCP ones both listen; the peer calls neither)
                    options = ReplicationOptions(mode=s.kind, host="127.0.0.1", timeout=TIMEOUT,
                                                 bandwidth=BANDWIDTH, streams=s.streams)
                    self.locals[s.name] = make_transport(self.store, rdzv, sink, options)
        dist.barrier()

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def booked(self, rank: int) -> int:
        """Bytes booked so far on the bandwidth budget of rank's node (all its processes)."""
        store = self.store if rank == 0 else self.peer_store
        schedule = NodeSchedule(store.paths.bandwidth)
        try:
            return schedule.total_bytes()
        finally:
            schedule.close()

    def received(self, step: int, owner: int) -> bool:
        """The peer's sink reported the pushed replica (step, owner)."""
        return os.path.exists(os.path.join(self.status_dir, f"received-{step}-{owner}"))

    def close(self) -> None:
        for t in self.locals.values():
            t.close()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a failed timeout test may leave it stopped
        end_peer(self.proc)
        if dist.is_initialized():
            dist.destroy_process_group()
        del self.c10d


@pytest.fixture(scope="module")
def job() -> Iterator[Job]:
    assert not dist.is_initialized(), "another test left a default process group behind"
    root = tempfile.mkdtemp(prefix="mlckpt-contract-", dir="/dev/shm")
    j = Job(root)
    try:
        j.start()
        yield j
    finally:
        j.close()
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Pair:
    """What a test works with: the job, and the transport under test on rank 0."""

    job: Job
    local: Transport

    @property
    def store(self) -> LocalStore:
        return self.job.store

    @property
    def peer_store(self) -> LocalStore:
        return self.job.peer_store


def _param(s: Setup):
    marks = [pytest.mark.gpu, pytest.mark.skipif(not _runnable(s), reason=f"needs {s.gpus} CUDA devices")] \
        if s.gpus else []
    return pytest.param(s, id=s.name, marks=marks)


@pytest.fixture(params=[_param(s) for s in SETUPS])
def pair(request, job) -> Pair:
    return Pair(job, job.locals[request.param.name])


_steps = iter(range(1, 1 << 20))


@pytest.fixture
def step() -> int:
    """A step number no other test of the module uses (the pair lives for the whole module)."""
    return next(_steps)


def data_of(store: LocalStore, step: int, owner: int, nbytes: int = NBYTES) -> bytes:
    with open(store.paths.data(step, owner), "rb") as f:
        return f.read(nbytes)


# --------------------------------------------------------------------------- push
def test_push_lands_verified_and_is_reported(pair, step):
    """A pushed shard lands verified and identical, the peer's sink reports it, and the same
    save pushed again sends nothing."""
    m = make_shard(pair.store, step, 0, NBYTES, seed=step, nitems=7)
    assert pair.local.push_shard(PEER, step, 0) == NBYTES
    got = pair.peer_store.verify_shard(step, 0)
    assert [(i.offset, i.nbytes, i.checksum) for i in got.items] == \
        [(i.offset, i.nbytes, i.checksum) for i in m.items]
    assert got.save_id == m.save_id
    assert data_of(pair.peer_store, step, 0) == data_of(pair.store, step, 0)
    wait_for(lambda: pair.job.received(step, 0), "the peer's sink to report the replica",
             diag=pair.job.log)
    # the same save again: the peer holds it, nothing is sent
    assert pair.local.push_shard(PEER, step, 0) == 0


def test_push_of_a_corrupt_copy_is_refused(pair, step):
    """A push of a corrupt shard is refused with a checksum mismatch: the peer commits nothing
    and drops the buffer."""
    make_shard(pair.store, step, 0, NBYTES, seed=step)
    damage_shard(pair.store, step, 0)
    with pytest.raises(ReplicationError, match="checksum mismatch"):
        pair.local.push_shard(PEER, step, 0)
    with pytest.raises(ShardNotFoundError):
        pair.peer_store.shards.read_manifest(step, 0)
    wait_for(lambda: debris(pair.peer_store) == [], "the refused buffer to be dropped",
             diag=pair.job.log)
    assert not pair.job.received(step, 0)


# Items a save checksummed on the device (wsum64) are verified by the receiver's host engine
# as they arrive, beside xxh3 items: over one stream in order, over several stripes at the end.
DEVICE_ITEMS = (digests.WSUM, digests.XXH3)


def test_push_of_device_checksummed_items_lands_verified(pair, step):
    """Items checksummed on the device (wsum64) beside xxh3 ones are verified on arrival and
    keep their algorithms."""
    m = make_shard(pair.store, step, 0, NBYTES, seed=step, nitems=5, algorithms=DEVICE_ITEMS)
    assert pair.local.push_shard(PEER, step, 0) == NBYTES
    got = pair.peer_store.verify_shard(step, 0)
    assert [(i.algorithm, i.checksum) for i in got.items] == [(i.algorithm, i.checksum) for i in m.items]
    assert got.items[0].algorithm == digests.WSUM and got.items[1].algorithm is None


def test_push_of_a_corrupt_device_checksummed_item_is_refused(pair, step):
    """A corrupt wsum64 item is caught by the receiver, naming the item: nothing committed,
    the buffer dropped."""
    make_shard(pair.store, step, 0, NBYTES, seed=step, nitems=5, algorithms=DEVICE_ITEMS)
    assert damage_shard(pair.store, step, 0, item=2).algorithm == digests.WSUM
    with pytest.raises(ReplicationError, match="checksum mismatch in 'item2'"):
        pair.local.push_shard(PEER, step, 0)
    with pytest.raises(ShardNotFoundError):
        pair.peer_store.shards.read_manifest(step, 0)
    wait_for(lambda: debris(pair.peer_store) == [], "the refused buffer to be dropped",
             diag=pair.job.log)


# --------------------------------------------------------------------------- partial push
PARTIAL = (1, 3, 6)  # the items of a 7-item shard a partial push sends


def allocated(store: LocalStore, step: int, owner: int) -> int:
    """Bytes of memory the data file of (step, owner) takes (its pages, not its size)."""
    return os.stat(store.paths.data(step, owner)).st_blocks * 512


def test_a_partial_push_lands_only_its_items_at_their_offsets(pair, step):
    """Only the items named cross (over several stripes on tcp-4-streams); the replica holds
    them at the owner's offsets, verified, under a manifest marked partial that lists them
    alone; the bytes between them are holes that take no memory. Offered again, nothing is
    sent; the whole shard then replaces it."""
    m = make_shard(pair.store, step, 0, NBYTES, seed=step, nitems=7)
    items = [m.items[i] for i in PARTIAL]
    held = sum(it.nbytes for it in items)
    assert held > 2 * MiB  # (striped on tcp-4-streams)
    sent = pair.local.budget.bytes_sent
    assert pair.local.push_shard(PEER, step, 0, items) == held
    assert pair.local.budget.bytes_sent - sent == held  # no byte of the other items crossed
    got = pair.peer_store.verify_shard(step, 0)
    assert got.partial and got.data_bytes == m.data_bytes and got.save_id == m.save_id
    assert [(i.offset, i.nbytes, i.checksum) for i in got.items] == \
        [(i.offset, i.nbytes, i.checksum) for i in items]
    mine, theirs = data_of(pair.store, step, 0), data_of(pair.peer_store, step, 0)
    for it in items:
        assert theirs[it.offset:it.offset + it.nbytes] == mine[it.offset:it.offset + it.nbytes]
    assert allocated(pair.peer_store, step, 0) < held + 4 * 4096 * len(items)
    wait_for(lambda: pair.job.received(step, 0), "the peer's sink to report the replica",
             diag=pair.job.log)
    assert pair.local.push_shard(PEER, step, 0, items[:2]) == 0  # held already
    assert pair.local.push_shard(PEER, step, 0) == NBYTES  # the whole shard is more
    assert not pair.peer_store.verify_shard(step, 0).partial


def test_a_corrupt_item_in_a_partial_push_is_refused(pair, step):
    """A flipped byte in an item the partial push carries: refused on arrival, nothing
    committed, no debris. One in an item it does not carry is none of its business."""
    m = make_shard(pair.store, step, 0, NBYTES, seed=step, nitems=7)
    damage_shard(pair.store, step, 0, item=PARTIAL[1])
    with pytest.raises(ReplicationError, match="checksum mismatch"):
        pair.local.push_shard(PEER, step, 0, [m.items[i] for i in PARTIAL])
    with pytest.raises(ShardNotFoundError):
        pair.peer_store.shards.read_manifest(step, 0)
    wait_for(lambda: debris(pair.peer_store) == [], "the refused buffer to be dropped",
             diag=pair.job.log)
    assert not pair.job.received(step, 0)
    others = [m.items[i] for i in (0, 2)]
    assert pair.local.push_shard(PEER, step, 0, others) == sum(it.nbytes for it in others)
    assert pair.peer_store.verify_shard(step, 0).partial


def test_a_partial_replica_serves_only_its_items(pair, step):
    """Read from a partial replica: its items come, a range in a hole is "missing" (never
    zeros); fetched, it lands here partial too, with only its items."""
    m = make_shard(pair.peer_store, step, PEER, NBYTES, seed=step, nitems=7)
    items = [m.items[i] for i in PARTIAL]
    whole = data_of(pair.peer_store, step, PEER)
    pair.peer_store.shards.retire(step, PEER)
    part = pair.peer_store.begin_shard(step, PEER, m.data_bytes,
                                       m.only(items).held_ranges())
    for it in items:
        part.buffer.array[it.offset:it.offset + it.nbytes] = np.frombuffer(
            whole[it.offset:it.offset + it.nbytes], np.uint8)
    part.commit_manifest(m.only(items))
    it = items[1]
    sink = np.zeros(it.nbytes, np.uint8)
    assert pair.local.read_items(PEER, step, PEER, [(it.offset, it.nbytes)], [sink]) == it.nbytes
    assert sink.tobytes() == whole[it.offset:it.offset + it.nbytes]
    hole = m.items[2]
    with pytest.raises(ShardNotFoundError):
        pair.local.read_items(PEER, step, PEER, [(hole.offset, 64)], [np.zeros(64, np.uint8)])


# --------------------------------------------------------------------------- range read
def test_read_items_lands_each_range_whole(pair, step):
    """read_items fills each range exactly (empty and tail ranges too), each whole when
    reported, and writes nothing to the reader's store."""
    make_shard(pair.peer_store, step, PEER, NBYTES, seed=step)
    data = data_of(pair.peer_store, step, PEER)
    ranges = [(0, 3 * MiB), (3 * MiB, 0), (3 * MiB, 100), (3 * MiB + 100, 2 * MiB), (NBYTES - 23, 23)]
    sinks = [np.zeros(n, np.uint8) for _, n in ranges]
    whole_when_reported: dict[int, bool] = {}

    def on_range(i: int) -> None:
        off, n = ranges[i]
        whole_when_reported[i] = sinks[i].tobytes() == data[off:off + n]

    assert pair.local.read_items(PEER, step, PEER, ranges, sinks, on_range) == \
        sum(n for _, n in ranges)
    assert whole_when_reported == {i: True for i in range(len(ranges))}
    for (off, n), sink in zip(ranges, sinks, strict=True):
        assert sink.tobytes() == data[off:off + n]
    assert step not in pair.store.inventory.steps()  # nothing is written to our store


def test_read_items_of_a_missing_shard(pair, step):
    """read_items of a shard the peer lacks raises ShardNotFoundError."""
    with pytest.raises(ShardNotFoundError):
        pair.local.read_items(PEER, step, PEER, [(0, 16)], [np.zeros(16, np.uint8)])


def test_read_items_outside_the_shard_is_refused(pair, step):
    """A range past the shard's end is refused, and the peer still serves the next read."""
    make_shard(pair.peer_store, step, PEER, 4096, seed=step)
    with pytest.raises(ReplicationError):
        pair.local.read_items(PEER, step, PEER, [(4000, 200)], [np.zeros(200, np.uint8)])
    # the peer still serves
    sink = np.zeros(96, np.uint8)
    assert pair.local.read_items(PEER, step, PEER, [(4000, 96)], [sink]) == 96
    assert sink.tobytes() == data_of(pair.peer_store, step, PEER, 4096)[4000:]


# --------------------------------------------------------------------------- metadata
def test_metadata_push_and_fetch(pair, step):
    """Metadata pushed and fetched arrives byte-identical; a second push is a no-op, not an
    error."""
    put_metadata(pair.store, step)
    pair.local.push_metadata(PEER, step)
    assert pair.peer_store.metadata.read_file(step) == pair.store.metadata.read_file(step)
    pair.local.push_metadata(PEER, step)  # again: a no-op, not an error
    fetched = step + 500_000  # a step only the peer has metadata of
    put_metadata(pair.peer_store, fetched)
    pair.local.fetch_metadata(PEER, fetched)
    assert pair.store.metadata.read_file(fetched) == pair.peer_store.metadata.read_file(fetched)
    header, _ = pair.store.metadata.read(fetched)
    assert header.step == fetched


def test_fetch_of_missing_metadata(pair, step):
    """Fetching metadata the peer lacks raises ShardNotFoundError."""
    with pytest.raises(ShardNotFoundError):
        pair.local.fetch_metadata(PEER, step)


# --------------------------------------------------------------------------- the budget
def test_a_push_is_paced_byte_for_byte(pair, step):
    """Whole, striped (tcp-4-streams) and in pieces (pg): every byte of the shard is booked on
    the pushing node's budget, and nothing on the receiver's."""
    make_shard(pair.store, step, 0, NBYTES, seed=step)
    mine, theirs, sent = pair.job.booked(0), pair.job.booked(PEER), pair.local.budget.bytes_sent
    assert pair.local.push_shard(PEER, step, 0) == NBYTES
    pair.peer_store.verify_shard(step, 0)
    assert pair.local.budget.bytes_sent - sent == NBYTES
    assert (pair.job.booked(0) - mine, pair.job.booked(PEER) - theirs) == (NBYTES, 0)


def test_a_heal_read_is_paced_by_the_node_that_sends_it(pair, step):
    """A paced read (a replaced node rebuilding its own shard from its items) asks the holder
    to pace: the bytes are booked on the holder's budget, which sends them."""
    make_shard(pair.peer_store, step, PEER, NBYTES, seed=step)
    mine, theirs = pair.job.booked(0), pair.job.booked(PEER)
    sink = np.zeros(NBYTES, np.uint8)
    assert pair.local.read_items(PEER, step, PEER, [(0, NBYTES)], [sink], paced=True) == NBYTES
    assert sink.tobytes() == data_of(pair.peer_store, step, PEER)
    assert (pair.job.booked(0) - mine, pair.job.booked(PEER) - theirs) == (0, NBYTES)


def test_a_resumes_reads_are_not_paced(pair, step):
    """What a resume waits for (range reads, metadata) takes the full link: nothing is booked
    on the holder's budget, unless the request asks for pacing."""
    make_shard(pair.peer_store, step, PEER, NBYTES, seed=step)
    put_metadata(pair.peer_store, step)
    ranges = [(0, 3 * MiB), (4 * MiB, NBYTES - 4 * MiB)]
    before = pair.job.booked(PEER)
    assert pair.local.read_items(PEER, step, PEER, ranges,
                                 [np.zeros(n, np.uint8) for _, n in ranges]) == NBYTES - MiB
    pair.local.fetch_metadata(PEER, step)
    assert pair.job.booked(PEER) == before
    # The flag in the request is what decides:
    sinks = [np.zeros(n, np.uint8) for _, n in ranges]
    pair.local.read_items(PEER, step, PEER, ranges, sinks, paced=True)
    assert pair.job.booked(PEER) - before == NBYTES - MiB
    for (off, n), sink in zip(ranges, sinks, strict=True):
        assert sink.tobytes() == data_of(pair.peer_store, step, PEER)[off:off + n]


# --------------------------------------------------------------------------- timeout
def test_a_frozen_peer_times_out_and_the_pair_recovers(pair, step):
    """A peer that stops answering (SIGSTOP) fails the call after the transport's timeout,
    with a ReplicationError rather than a hang; once it runs again, the pair works."""
    os.kill(pair.job.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(ReplicationError):
            pair.local.fetch_metadata(PEER, step)
    finally:
        os.kill(pair.job.proc.pid, signal.SIGCONT)
    make_shard(pair.store, step, 0, 4096, seed=step)
    assert pair.local.push_shard(PEER, step, 0) == 4096
    pair.peer_store.verify_shard(step, 0)


def test_a_shard_retired_after_its_offer_still_ends_the_push_and_the_pair_works_on(pair, step,
                                                                                  monkeypatch):
    """Retention retires the shard between the peer's "ready" and the bytes. The process-group
    peer then waits in a recv that only our sends end: before, the sender failed there, the
    peer's recv timed out and the group's pair to it was closed, so every later push failed
    too. Now the push has the shard's mapping before it offers, so it completes (TCP: the
    file opened after the answer is gone, and the closed connection tells the peer at once);
    either way the next push lands."""
    from mlcheckpoint.replication.pg.transport import PgCall
    from mlcheckpoint.replication.tcp.transport import TcpCall

    m = make_shard(pair.store, step, 0, NBYTES, seed=step, nitems=3)
    original = {cls: cls.send_shard for cls in (PgCall, TcpCall)}

    def retired_first(call, shard, ranges, ready):
        pair.store.shards.retire(shard.step, shard.rank)  # (what a retention pass does)
        original[type(call)](call, shard, ranges, ready)

    for cls in original:
        monkeypatch.setattr(cls, "send_shard", retired_first)
    try:
        pushed = pair.local.push_shard(PEER, step, 0)
    except MLCheckpointError as e:
        assert pair.local.name.startswith("tcp"), f"{pair.local.name}: {e}"
    else:
        assert pushed == NBYTES and pair.peer_store.verify_shard(step, 0).save_id == m.save_id
    monkeypatch.undo()
    make_shard(pair.store, step + 100_000, 0, 4096, seed=step)
    assert pair.local.push_shard(PEER, step + 100_000, 0) == 4096
    pair.peer_store.verify_shard(step + 100_000, 0)


# --------------------------------------------------------------------------- one client
def failure(call: Callable[[], object]) -> tuple[str, str]:
    """(the class, the text) of the error ``call`` raises."""
    with pytest.raises(MLCheckpointError) as e:
        call()
    return type(e.value).__name__, str(e.value)


def test_every_transport_reports_a_failure_in_the_same_words(job, step):
    """Every transport asks through the one client code (``core/transport.py``): the same failure
    raises the same error with the same text over each of them (TCP with one stream and
    several, gloo, NCCL). A transport that read a reply itself again would differ here."""
    failures: dict[str, dict[str, tuple[str, str]]] = {}
    make_shard(job.peer_store, step, PEER, 4096, seed=step)
    make_shard(job.store, step, 0, NBYTES, seed=step, nitems=5)
    damage_shard(job.store, step, 0, item=2)
    absent = step + 500_000  # a step the peer holds nothing of
    for name, local in job.locals.items():
        failures[name] = {
            "a read of a shard the peer lacks": failure(lambda t=local: t.read_items(
                PEER, absent, PEER, [(0, 16)], [np.zeros(16, np.uint8)])),
            "metadata the peer lacks": failure(lambda t=local: t.fetch_metadata(PEER, absent)),
            "a read the peer refuses": failure(lambda t=local: t.read_items(
                PEER, step, PEER, [(4000, 200)], [np.zeros(200, np.uint8)])),
            "a corrupt push the peer refuses": failure(lambda t=local: t.push_shard(PEER, step, 0)),
        }
    first = next(iter(failures.values()))
    assert first["a read of a shard the peer lacks"] == (
        "ShardNotFoundError", f"rank {PEER} does not hold step {absent} rank {PEER}")
    assert first["metadata the peer lacks"] == (
        "ShardNotFoundError", f"rank {PEER} has no metadata of step {absent}")
    kind, text = first["a read the peer refuses"]
    assert (kind, text.split(":")[0]) == (
        "ReplicationError", f"rank {PEER} refused the read of step {step} rank {PEER}")
    kind, text = first["a corrupt push the peer refuses"]
    assert kind == "ReplicationError" and "checksum mismatch in 'item2'" in text
    for name, words in failures.items():
        assert words == first, f"{name} words a failure its own way"


def test_every_transport_refuses_a_strangers_reply_in_the_same_words(job, step, tmp_path):
    """A reply that is not a peer's (bytes from someone without the job's secret, in place of
    it) fails the call with the client's words on every wire, which then say what they saw:
    TCP a listener that is no replication endpoint, pg a reply not sealed for the request."""
    texts = {}
    # pg: the stranger writes its reply under the key our next request's reply will have, and
    # the next few (a request of the peer's may take a tag first: the counter is the job's)
    pg = job.locals["pg-gloo"]
    tag = job.rdzv.add("pg/tag", 0)
    keys = [f"pg/reply/0/{(tag + k) % MAX_TAG}/r" for k in range(1, 33)]
    for key in keys:
        job.rdzv.store.set(key, b"not a sealed reply")
    # The peer is frozen meanwhile: its real answer would overwrite the stranger's under the
    # same key if it came before our read (CI: a loaded machine delayed our read). It answers
    # once it runs again, under a tag no later request of ours reads.
    os.kill(job.proc.pid, signal.SIGSTOP)
    try:
        texts["pg-gloo"] = failure(lambda: pg.fetch_metadata(PEER, step))
    finally:
        os.kill(job.proc.pid, signal.SIGCONT)
        for key in keys:  # (the one read is gone already) no later request of ours reads them
            job.rdzv.store.delete_key(key)
    # TCP: the stranger's listener is where rank 1 said it listens (a rendezvous of its own)
    with socket.create_server(("127.0.0.1", 0)) as stranger:
        host, port = stranger.getsockname()[:2]
        c10d = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        rdzv = Rendezvous(c10d, job.job_id, 0, 2, timeout=TIMEOUT, secret=os.urandom(32))
        rdzv.store.set(f"tcp/{PEER}", f"{host}:{port}")
        store = LocalStore(str(tmp_path), job.job_id)
        tcp = TcpTransport(store, rdzv, ReplicationOptions(host="127.0.0.1", timeout=TIMEOUT,
                                                           bandwidth=0))

        def answer() -> None:
            conn, _ = stranger.accept()
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" * 2)

        answered = threading.Thread(target=answer, daemon=True)
        answered.start()
        try:
            texts["tcp"] = failure(lambda: tcp.fetch_metadata(PEER, step))
        finally:
            answered.join(TIMEOUT)
            tcp.close()
            store.close()
            del c10d
    for name, (kind, text) in texts.items():
        assert kind == "ReplicationError", name
        assert text.startswith(f"transfer with rank {PEER} failed (the fetch of the metadata of "
                               f"step {step}): "), text
    assert "not an mlcheckpoint replication endpoint" in texts["tcp"][1]
    assert "refused a reply" in texts["pg-gloo"][1]


# --------------------------------------------------------------------------- the factory
def test_factory_refuses_unknown_kinds(tmp_path):
    """make_transport refuses an unknown or 'none' mode (and NCCL without CUDA), naming the
    known kinds."""
    c10d = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    store = LocalStore(str(tmp_path), "contract-factory")
    rdzv = Rendezvous(c10d, store.job_id, 0, 1, secret=os.urandom(32))
    sink = ReceiveSink(store)
    with pytest.raises(ConfigError, match="'tcp', 'pg', 'nccl'"):
        ReplicationOptions(mode="udp")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'tcp', 'pg', 'nccl'"):
        make_transport(store, rdzv, sink, ReplicationOptions(mode="none"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="nccl"):
            make_transport(store, rdzv, sink, ReplicationOptions(mode="nccl"))
    store.close()


# --------------------------------------------------------------------------- last: a closed pair
# (It leaves the module's process-group pair with the peer closed: no test after it uses one.)
@pytest.mark.parametrize("setup", [_param(s) for s in SETUPS if s.kind != "tcp"])
def test_a_pair_the_group_closed_is_refused_at_once_and_said_once(job, setup, step, caplog):
    """A recv that timed out closes the group's pair to that peer for good (gloo does not open
    it again). The transport says so once, at ERROR, and refuses every later transfer with the
    peer before asking or promising anything: no offer leaves the peer waiting in a recv, and
    no later call waits out a timeout to fail."""
    import logging

    local = job.locals[setup.name]
    assert isinstance(local, PgTransport)
    with caplog.at_level(logging.ERROR, logger="mlcheckpoint.replication.pg.transport"):
        with pytest.raises(ReplicationError, match=f"receiving from rank {PEER} failed"):
            local._recv_bytes(np.zeros(16, dtype=np.uint8), PEER, tag=MAX_TAG - 1)  # nobody sends
        make_shard(job.store, step, 0, 4096, seed=step)
        for _ in range(2):
            with pytest.raises(ReplicationError, match=f"connection to rank {PEER} closed earlier"):
                local.push_shard(PEER, step, 0)
    said = [r for r in caplog.records if "stays off until the job restarts" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert not job.peer_store.inventory.step_state(step).committed_ranks  # nothing was offered
