"""The replication bandwidth budget (replication/core/budget.py): the pacing arithmetic on a
simulated clock, one schedule for every process of a node, and real pushes whose every byte
goes through it. No assertion here is about speed: rates are measured in benchmarks only.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest
from cluster import WORKERS
from helpers import wait_for

from mlcheckpoint.replication.core import budget as budget_module
from mlcheckpoint.replication.core.budget import (
    ASSUMED_LINK_BYTES_PER_S,
    DEFAULT_BANDWIDTH_SHARE,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    YIELD_DELAY_S,
    YIELD_HOLD_S,
    YIELD_SHARE,
    Budget,
    NodeSchedule,
    chunk_bytes,
    default_bandwidth,
    node_budget,
    queueing_delay,
)
from mlcheckpoint.replication.core.network import link_speed

sys.path.insert(0, WORKERS)
from repl_peer import make_shard  # a worker module, found through WORKERS

MiB = 1 << 20


class SimulatedTime:
    """A clock that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.now += seconds


def budget(rate: int, time: SimulatedTime, path: str | None = None, *,
           yielding: bool = False) -> Budget:
    return Budget(rate, path, yielding=yielding, clock=time.clock, sleep=time.sleep)


# --------------------------------------------------------------------------- the arithmetic
def test_bytes_go_out_at_the_rate_with_a_burst_of_one_chunk():
    time = SimulatedTime()
    rate = 10_000_000
    b = budget(rate, time)
    start, released = time.now, []  # (simulated time a chunk was released, its bytes)
    for _, n in b.chunks(0, 50_000_001):
        released.append((time.now, n))
    assert sum(n for _, n in released) == 50_000_001 == b.bytes_sent
    assert max(n for _, n in released) == b.chunk == chunk_bytes(rate) < 50_000_001
    sent = 0
    for t, n in released:
        # Each chunk goes out when the bytes before it have had their time at the rate...
        assert t - start == pytest.approx(sent / rate)
        sent += n
        # ...so by any moment the node has sent at most rate * elapsed + one chunk.
        assert sent <= rate * (t - start) + b.chunk + 1  # (+1: float rounding)
    assert b.seconds_waited == pytest.approx((50_000_001 - released[-1][1]) / rate)


def test_an_idle_link_saves_up_no_burst():
    time = SimulatedTime()
    b = budget(1_000_000, time)
    assert b.take(b.chunk) == 0  # the first chunk goes at once
    time.now += 3600  # an hour idle
    assert b.take(b.chunk) == 0
    assert b.take(b.chunk) == pytest.approx(b.chunk / 1_000_000)  # the next waits its turn


def test_two_processes_of_a_node_share_one_rate(tmp_path):
    """Two Budgets on one schedule file, as two ranks' processes hold it (each its own file
    descriptor and flock): together they send at the node's rate, not each at it."""
    time = SimulatedTime()
    path = str(tmp_path / "locks" / "bandwidth")
    rate = 4_000_000
    a, b = budget(rate, time, path), budget(rate, time, path)
    start = time.now
    for _ in range(20):
        a.take(a.chunk)
        b.take(b.chunk)
    total = 40 * a.chunk
    assert a.bytes_sent == b.bytes_sent == total // 2
    # The last chunk was released when the 39 before it had had their time at the node rate.
    assert time.now - start == pytest.approx((total - a.chunk) / rate)
    assert NodeSchedule(path).total_bytes() == total


def test_a_queue_on_the_path_slows_every_sender_of_the_node_for_a_while(tmp_path):
    """One rank's socket sees a queue (other traffic fills the link): every sender of the node
    books at YIELD_SHARE of the budget until YIELD_HOLD_S has passed, then at the full rate."""
    time = SimulatedTime()
    path = str(tmp_path / "locks" / "bandwidth")
    rate = 10_000_000
    a, b = budget(rate, time, path, yielding=True), budget(rate, time, path, yielding=True)
    a.saw_queue(YIELD_DELAY_S / 2)  # a queue this short is our own pacing's jitter: ignored
    b.take(b.chunk)
    t0 = time.now
    b.take(b.chunk)
    assert time.now - t0 == pytest.approx(b.chunk / rate)  # full rate
    a.saw_queue(YIELD_DELAY_S * 3)  # a's socket sees other traffic
    assert a.yields == 1
    t1 = time.now
    b.take(b.chunk)  # b's booking is slowed too: one schedule for the node
    b.take(b.chunk)
    assert time.now - t1 == pytest.approx(b.chunk / rate + b.chunk / (rate * YIELD_SHARE))
    time.now += YIELD_HOLD_S  # the queue is gone and the hold has passed
    b.take(b.chunk)
    t2 = time.now
    b.take(b.chunk)
    assert time.now - t2 == pytest.approx(b.chunk / rate)
    # unknown delay (no TCP_INFO), or a budget that does not yield: nothing changes
    a.saw_queue(None)
    c = budget(rate, time, path)
    c.saw_queue(1.0)
    assert a.yields == 1 and c.yields == 0


def test_queueing_delay_reads_a_real_sockets_tcp_info():
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        with client, conn:
            client.sendall(b"x" * 100_000)
            conn.recv(1 << 20)
            delay = queueing_delay(client)
    assert delay is not None and 0 <= delay < 1.0


def test_a_stale_booking_is_forgotten(tmp_path):
    """A schedule booked impossibly far ahead (another boot's clock) is not slept on."""
    time = SimulatedTime()
    path = str(tmp_path / "bandwidth")
    schedule = NodeSchedule(path)
    with schedule.locked() as booking:
        booking.until = time.now + 10**7
    b = budget(1_000_000, time, path)
    assert b.take(1000) == 0
    assert b.take(1000) == pytest.approx(1000 / 1_000_000)


def test_no_cap_neither_books_nor_sleeps(tmp_path):
    path = str(tmp_path / "bandwidth")
    b = Budget(0, path, sleep=lambda s: pytest.fail("slept"))
    assert not b.capped and b.describe() == "no bandwidth cap"
    assert list(b.chunks(10, 100 * MiB)) == [(10, 100 * MiB)]  # one piece, as before
    assert b.bytes_sent == 100 * MiB
    assert not os.path.exists(path)


@pytest.mark.parametrize("rate, chunk", [
    (10**10, MAX_CHUNK_BYTES), (250 * 10**6, 10**6), (62_500_000, 250_000),
    (10**6, MIN_CHUNK_BYTES), (1000, 1000), (1, 1)])
def test_chunks_are_a_few_milliseconds_of_budget(rate, chunk):
    assert chunk_bytes(rate) == chunk


# --------------------------------------------------------------------------- the default
def test_the_default_is_a_share_of_the_link_or_of_an_assumed_one():
    gbit = 10**9 // 8
    assert default_bandwidth(gbit) == int(DEFAULT_BANDWIDTH_SHARE * gbit)
    assert default_bandwidth(None) == int(DEFAULT_BANDWIDTH_SHARE * ASSUMED_LINK_BYTES_PER_S)
    assert node_budget("auto", "lo", None).rate == default_bandwidth(None)  # lo: no speed
    assert node_budget(0, "lo", None).capped is False
    assert node_budget(12345, None, None).rate == 12345


def test_the_docs_give_the_default_share():
    """DEFAULT_BANDWIDTH_SHARE is the one knob of the default: the docs that quote it follow."""
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs")
    for name in ("configuration.md", "operations.md"):
        with open(os.path.join(docs, name)) as f:
            assert f"{DEFAULT_BANDWIDTH_SHARE:.0%}" in f.read(), name


def test_link_speed_is_read_for_physical_nics_only(tmp_path):
    def nic(name: str, speed: str, physical: bool = True) -> None:
        os.makedirs(tmp_path / name / ("device" if physical else "queues"))
        (tmp_path / name / "speed").write_text(speed + "\n")

    nic("eth1", "25000")
    nic("eth2", "-1")  # a virtio or cloud NIC that reports no speed
    nic("veth0", "10000", physical=False)  # veth's nominal speed, whatever tc shapes it to
    sysfs = str(tmp_path)
    assert link_speed("eth1", sysfs) == 25 * 10**9 // 8
    assert link_speed("eth2", sysfs) is None
    assert link_speed("veth0", sysfs) is None
    assert link_speed("missing", sysfs) is None
    assert link_speed("lo") is None  # the real sysfs: loopback is virtual


# --------------------------------------------------------------------------- real pushes
@pytest.mark.parametrize("streams", [1, 4])
def test_every_byte_of_a_push_goes_through_the_budget(make_job, monkeypatch, streams):
    """A real loopback push, whole and striped: each sendfile() of the shard's bytes is one
    chunk the budget booked first, and the bookings add up to the shard."""
    job = make_job()
    receiver = job.endpoint(0)
    rate = 256 * 10**6  # chunks of ~1 MB: several per stripe
    sender = job.endpoint(1, bandwidth=rate, streams=streams, min_stripe_bytes=MiB)
    nbytes = 6 * MiB + 5
    make_shard(sender.store, 3, 1, nbytes, seed=3)
    booked: list[int] = []
    sent: list[int] = []
    take, sendfile_all = sender.budget.take, budget_module.sendfile_all

    def recording_take(n: int) -> float:
        booked.append(n)
        return take(n)

    def recording_sendfile(sock, fd, offset, count):
        sent.append(count)
        sendfile_all(sock, fd, offset, count)

    monkeypatch.setattr(sender.budget, "take", recording_take)
    monkeypatch.setattr(budget_module, "sendfile_all", recording_sendfile)
    assert sender.push_shard(0, 3, 1) == nbytes
    receiver.store.verify_shard(3, 1)
    assert sum(booked) == nbytes == sum(sent)
    assert sorted(booked) == sorted(sent)  # each send is one booked chunk
    assert max(sent) <= sender.budget.chunk < nbytes
    assert NodeSchedule(sender.store.paths.bandwidth).total_bytes() == nbytes


def _flock_waiters(path: str) -> set[int]:
    """Pids blocked in flock() on the file at ``path`` (from /proc/locks)."""
    inode = os.stat(path).st_ino
    waiters = set()
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 5 and fields[1] == "->" and fields[2] == "FLOCK" \
                    and fields[6].rsplit(":", 1)[-1] == str(inode):
                waiters.add(int(fields[5]))
    return waiters


@pytest.mark.slow
def test_the_ranks_of_a_node_share_one_budget(make_job):
    """Two ranks of one node, each a process of its own, push at once: both wait on the
    node's schedule (held here while they start), and every byte of both is booked on it."""
    job = make_job(world=3)
    receiver = job.endpoint(0)
    node_dir = job.node_dir(1)  # ranks 1 and 2 share this node's directory
    schedule = NodeSchedule(os.path.join(node_dir, job.job_id, "locks", "bandwidth"))
    sizes = {1: 5 * MiB + 3, 2: 3 * MiB + 7}
    with schedule.locked():  # the node's link is "busy": nobody may book
        procs = {r: job.spawn(r, "push", dir=node_dir, step=4, nbytes=n, seed=r, peer=0,
                              bandwidth=64 * 10**6, streams=1 + r % 2, min_stripe_bytes=MiB)
                 for r, n in sizes.items()}
        waiting = wait_for(lambda: _flock_waiters(schedule.path) >= {p.pid for p in procs.values()},
                           "both ranks to wait for the node's schedule", diag=job.logs)
        assert waiting
        assert receiver.store.steps() == [] or not receiver.store.step_state(4).committed_ranks
    results = {r: job.status(f"{r}.result", proc) for r, proc in procs.items()}
    assert all(res["ok"] for res in results.values()), results
    for r, n in sizes.items():
        assert results[r]["bytes"] == n == results[r]["bytes_sent"]
        receiver.store.verify_shard(4, r)
    assert schedule.total_bytes() == sum(sizes.values())
