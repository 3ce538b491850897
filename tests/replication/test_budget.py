"""The replication bandwidth budget (replication/core/budget.py): the pacing arithmetic on a
simulated clock, one schedule for every process of a node, and real pushes whose every byte
goes through it. No assertion here is about speed: rates are measured in benchmarks only.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

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
)
from mlcheckpoint.replication.core.delay_control import (
    CUT_EVERY_S,
    DECREASE,
    FLOOR_SHARE,
    GROW_S,
    HEADROOM,
    MAX_GROW_GAP_S,
    MAX_SHARE,
    PEAK_AFTER_OVERSHOOT,
    PEAK_MEMORY_S,
    QUIET_EVERY,
    QUIET_FIRST,
    SLOW_CUT,
    SLOWDOWN_TOLERANCE,
    TARGET_DELAY_S,
    YIELD_NOW_DELAY_S,
    Rate,
    StepPacer,
    derived_rate,
    net_of_ack_gap,
    next_rate,
    queueing_delay,
)
from mlcheckpoint.replication.core.network import link_speed
from mlcheckpoint.testing import netcluster
from mlcheckpoint.testing.netcluster import NetCluster

sys.path.insert(0, WORKERS)
from repl_peer import make_shard  # a worker module, found through WORKERS

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def test_a_preemption_flush_sends_the_rest_of_a_paced_range_at_once():
    """Inside ``hurried`` (a preemption flush runs), a paced send mid-way goes on unpaced: the
    rest of its range in one piece, with no sleep; pacing is back once the block ends."""
    time = SimulatedTime()
    b = budget(1000, time)
    sent = []
    chunks = b.chunks(0, 10_000)
    for _ in range(3):
        sent.append(next(chunks)[1])
    waited = b.seconds_waited
    assert waited > 0 and sent == [b.chunk] * 3
    with b.hurried():
        rest = list(chunks)
        assert [n for _, n in rest] == [10_000 - 3 * b.chunk]
        assert b.seconds_waited == waited and b.take(500) == 0
    assert b.take(b.chunk) > 0  # paced again, behind what was booked before


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


# --------------------------------------------------------------------------- adaptive pacing
FLOOR, CEILING = 1e6, 1e9


def decide(rate: float, delay: float, since_sample: float = 0.004, since_cut: float = 1.0,
           peak: float = 0.0) -> Rate:
    return next_rate(Rate(rate, peak), delay, since_sample, since_cut, floor=FLOOR, ceiling=CEILING)


def test_the_controller_grows_while_the_path_is_quiet_and_cuts_when_it_queues():
    """next_rate, the adaptive controller's whole decision, as a function of its samples."""
    quiet = TARGET_DELAY_S / 2
    # Past its peak, the rate grows by rate * dt / GROW_S...
    assert decide(1e8, quiet, since_sample=0.004).rate == pytest.approx(1e8 * (1 + 0.004 / GROW_S))
    # ...below it, by peak * dt / GROW_S (the peak a little forgotten): back to it within GROW_S.
    peak = 5e8 * math.exp(-0.004 / PEAK_MEMORY_S)
    assert decide(1e7, quiet, since_sample=0.004, peak=5e8).rate == pytest.approx(1e7 + peak * 0.004 / GROW_S)
    assert decide(9e8, 0.0, since_sample=1.0).rate == CEILING  # never past the ceiling
    # A long gap without samples says nothing about the path: it counts as MAX_GROW_GAP_S.
    assert decide(1e8, 0.0, since_sample=60.0) == decide(1e8, 0.0, since_sample=MAX_GROW_GAP_S)
    # The peak follows the rate up and is forgotten slowly.
    assert decide(1e8, quiet, peak=5e7).peak == 1e8
    assert decide(1e7, quiet, since_sample=0.01, peak=5e8).peak == pytest.approx(
        5e8 * math.exp(-0.01 / PEAK_MEMORY_S))
    # A queue past the target (our own overshoot) halves the rate, and the peak comes down to
    # just under the rate that built it.
    assert decide(1e8, TARGET_DELAY_S * 1.5, peak=2e8) == Rate(1e8 * DECREASE, 1e8 * PEAK_AFTER_OVERSHOOT)
    # One past YIELD_NOW_DELAY_S (someone else's burst) drops the rate to the floor; the peak
    # stays, to return to once the burst has passed.
    assert decide(1e8, YIELD_NOW_DELAY_S * 1.5, since_sample=0.0, peak=2e8) == Rate(FLOOR, 2e8)
    assert decide(1.5 * FLOOR, TARGET_DELAY_S * 1.5).rate == FLOOR  # never below the floor
    # One queue shows in several samples: answered once per CUT_EVERY_S.
    assert decide(1e8, YIELD_NOW_DELAY_S * 2, since_cut=CUT_EVERY_S / 2).rate == 1e8
    assert decide(1e8, YIELD_NOW_DELAY_S * 2, since_cut=CUT_EVERY_S).rate == FLOOR


def test_the_controller_finds_an_idle_link_and_leaves_it_at_once():
    """Samples every 4 ms: from the floor to the ceiling (three decades) within 0.2 s of a
    quiet path; the first sample of a full queue gives the link back; once it has passed, the
    rate is back at its peak within GROW_S."""
    state, samples = Rate(FLOOR, 0.0), 0
    while state.rate < CEILING:
        state = next_rate(state, 0.0, 0.004, 1.0, floor=FLOOR, ceiling=CEILING)
        samples += 1
    assert samples * 0.004 < 0.2
    state = next_rate(state, YIELD_NOW_DELAY_S * 2, 0.004, 1.0, floor=FLOOR, ceiling=CEILING)
    assert state.rate == FLOOR
    for _ in range(round(GROW_S / 0.004)):
        state = next_rate(state, 0.0, 0.004, 1.0, floor=FLOOR, ceiling=CEILING)
    assert state.rate > 0.95 * CEILING


def test_delayed_acks_at_a_low_rate_are_not_a_queue():
    assert net_of_ack_gap(0.0005, 1e9) == pytest.approx(0.0005 - 2 * 1448 / 1e9)
    assert net_of_ack_gap(0.0005, 1e6) == 0.0  # a 1.4 ms gap between segments


def test_adaptive_pacing_moves_every_sender_of_the_node(tmp_path):
    """Adaptive budgets of two processes of a node (one schedule file): both book at the
    node's controller rate, which starts at ``start`` and moves with either one's samples."""
    time = SimulatedTime()
    path = str(tmp_path / "locks" / "bandwidth")
    ceiling, start = 100_000_000, 5_000_000

    def adaptive() -> Budget:
        return Budget(ceiling, path, yielding=True, adaptive=True, start=start, clock=time.clock,
                      sleep=time.sleep)

    a, b = adaptive(), adaptive()
    assert a.current_rate() == start and a.chunk == chunk_bytes(start)

    def booked_rate(budget: Budget) -> float:  # the rate b's next chunk is booked at
        budget.take(1)
        t0 = time.now
        budget.take(100_000)
        budget.take(1)
        return 100_001 / (time.now - t0)  # the 100,000 bytes and the 1 after them

    assert booked_rate(b) == pytest.approx(start)
    for _ in range(100):  # a's socket: a quiet path, 4 ms apart
        time.now += 0.004
        a.sample(0.0)
    assert b.current_rate() == ceiling  # grown to the ceiling, for b as well
    assert booked_rate(b) == pytest.approx(ceiling)
    time.now += 0.004
    a.sample(0.01)  # a burst of other traffic
    assert b.current_rate() == a.floor == FLOOR_SHARE * start and a.yields == 1
    assert booked_rate(b) == pytest.approx(a.floor)
    a.sample(None)  # no TCP_INFO: no change
    assert b.current_rate() == a.floor


def test_the_pacing_setting_chooses_the_controller(monkeypatch):
    """MLCHECKPOINT_ADAPTIVE_PACING=1: off loopback, pace adaptively from the default share up
    to the link (assumed where the NIC reports none); by default, or =0, the fixed budget;
    loopback never yields, so it keeps the fixed budget."""
    iface = "dummy-nic"  # not in sysfs: no speed
    monkeypatch.delenv("MLCHECKPOINT_ADAPTIVE_PACING", raising=False)
    default = node_budget("auto", iface, None)
    assert not default.adaptive and default.yielding and default.rate == default_bandwidth(None)
    monkeypatch.setenv("MLCHECKPOINT_ADAPTIVE_PACING", "1")
    b = node_budget("auto", iface, None)
    assert b.adaptive and b.rate == ASSUMED_LINK_BYTES_PER_S
    assert b.current_rate() == default_bandwidth(None)
    explicit = node_budget(200_000_000, iface, None)  # the ceiling, and where it starts
    assert explicit.adaptive and explicit.rate == explicit.current_rate() == 200_000_000
    assert node_budget("auto", "lo", None).adaptive is False
    monkeypatch.setenv("MLCHECKPOINT_ADAPTIVE_PACING", "0")
    fixed = node_budget("auto", iface, None)
    assert not fixed.adaptive and fixed.yielding and fixed.rate == default_bandwidth(None)


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
    # The profile (issue 45): what was sent and how long the kernel took, on the sender; what
    # was received, hashed and committed, on the receiver.
    sending = sender.budget.profile()
    assert sending["sent_bytes"] == nbytes and sending["send_seconds"] > 0
    received = receiver.sink.profile()
    assert received["received_replicas"] == 1 and received["received_bytes"] == nbytes
    assert received["verify_seconds"] > 0 and received["commit_seconds"] > 0


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
        assert receiver.store.inventory.steps() == [] or not receiver.store.inventory.step_state(4).committed_ranks
    results = {r: job.status(f"{r}.result", proc) for r, proc in procs.items()}
    assert all(res["ok"] for res in results.values()), results
    for r, n in sizes.items():
        assert results[r]["bytes"] == n == results[r]["bytes_sent"]
        receiver.store.verify_shard(4, r)
    assert schedule.total_bytes() == sum(sizes.values())


# --------------------------------------------------------------------------- over a shaped link
PACED_SENDER = os.path.join(WORKERS, "paced_sender.py")


@pytest.mark.slow
@pytest.mark.quiet
@pytest.mark.skipif(netcluster.available() is not None, reason=f"no emulated network: {netcluster.available()}")
def test_adaptive_pacing_grows_into_an_idle_link_and_yields_to_a_competing_flow():
    """A real sender in an emulated node (1 Gbit/s tbf link) paces through an adaptive Budget
    that starts at a twentieth of the link: alone, its rate grows to most of the link; when an
    unpaced bulk flow (as training's collectives) fills the same link, it drops to a small
    share. The margins are wide: the rates only have to land on the right side of them."""
    link = 125_000_000  # bytes/s
    start = link // 20
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    with NetCluster(nodes=2, rate="1gbit") as c:
        ports = []
        for _ in range(2):  # one receiver for the paced sender, one for the competing flow
            recv = c.run_in(1, [sys.executable, "-I", netcluster._PEER, "recv", c.address(1)],
                            stdout=subprocess.PIPE, text=True)
            assert recv.stdout is not None
            ports.append(recv.stdout.readline().split()[1])
        sender = c.run_in(0, [sys.executable, PACED_SENDER, c.address(1), ports[0], "6",
                              str(2 * link), str(start)], stdout=subprocess.PIPE, text=True, env=env)
        assert sender.stdout is not None
        assert sender.stdout.readline().strip() == "ready"
        time.sleep(3)  # the sender has the link to itself
        competing_from = time.monotonic()
        competing = c.run_in(0, [sys.executable, "-I", netcluster._PEER, "send", c.address(1), ports[1],
                                 str(2 * link)])
        assert competing.wait(timeout=120) == 0
        competing_until = time.monotonic()
        out, _ = sender.communicate(timeout=120)
        assert sender.returncode == 0, out
    samples = json.loads(out)["samples"]
    alone = [r for t, r in samples if competing_from - 1.5 < t < competing_from]
    shared = [r for t, r in samples if competing_from + 0.3 < t < competing_until]
    span = (samples[0][0] - competing_from, samples[-1][0] - competing_from) if samples else None
    assert len(alone) > 20 and len(shared) > 20, (len(alone), len(shared), span)
    assert statistics.median(alone) > 0.4 * link > 4 * start, statistics.median(alone)
    assert statistics.median(shared) < 0.2 * link, statistics.median(shared)


# --------------------------------------------------------------------------- derived default
SHARD = 201 * 10**6  # issue 45's FSDP shard per rank (a 2-node job, one rank per node)
STEP_S = 2.1  # its step, a save every step
LINK = 5 * 10**9 // 8  # a 5 Gbit/s link


def derived_budget(time: SimulatedTime, path: str | None = None) -> Budget:
    """The default ("auto") of a node whose link reports ``LINK``: what ``node_budget`` makes."""
    return Budget(default_bandwidth(LINK), path, yielding=True, ceiling=int(MAX_SHARE * LINK),
                  clock=time.clock, sleep=time.sleep)


def saves(b: Budget, time: SimulatedTime, intervals: list[float], send: int = 0) -> None:
    """A save after each interval; ``send`` bytes go through the budget during each one."""
    for gap in intervals:
        start = time.now
        if send:
            for _ in b.chunks(0, send):
                pass
        time.now = max(time.now, start + gap)
        b.note_save()


def test_a_derived_default_carries_a_shard_per_step_where_the_link_has_room():
    """Told the bytes per save and the saves' cadence, the default sends a shard in well under
    a step (HEADROOM x what keeping up needs), where the old default (5% of the link, 31 MB/s
    here) took 6.4 s per 2.1 s step and lagged further every step."""
    time = SimulatedTime()
    b = derived_budget(time)
    assert b.derived and b.rate == default_bandwidth(LINK)
    b.need(SHARD)
    saves(b, time, [STEP_S] * 4)
    assert b.current_rate() == pytest.approx(HEADROOM * SHARD / STEP_S)
    t0 = time.now
    for _ in b.chunks(0, SHARD):
        pass
    pushed_in = time.now - t0
    assert pushed_in <= STEP_S / HEADROOM + 0.01, pushed_in
    assert SHARD / default_bandwidth(LINK) > 3 * STEP_S  # the old default could not keep up
    # ...and never more than MAX_SHARE of the link, however large the need.
    b.need(100 * SHARD)
    assert b.current_rate() == pytest.approx(MAX_SHARE * LINK)


def test_an_explicit_budget_wins_over_the_derived_default(monkeypatch):
    monkeypatch.delenv("MLCHECKPOINT_ADAPTIVE_PACING", raising=False)
    explicit = node_budget(40 * 10**6, "eth9", None)
    assert not explicit.derived
    explicit.need(SHARD)
    for _ in range(4):
        explicit.note_save()
    assert explicit.current_rate() == 40 * 10**6
    assert node_budget("auto", "eth9", None).derived  # the default is the derived one
    assert not node_budget("auto", "lo", None).derived  # loopback: nothing to share with
    monkeypatch.setenv("MLCHECKPOINT_ADAPTIVE_PACING", "1")
    assert not node_budget("auto", "eth9", None).derived  # the controller's own pacing


def test_the_derived_default_backs_off_when_training_slows_not_when_it_shares():
    time = SimulatedTime()
    b = derived_budget(time)
    b.need(SHARD)
    saves(b, time, [STEP_S] * 3)  # replication idle: the baseline
    full = b.current_rate()
    # Sending beside training whose steps stay as long: a queue on the path is sharing.
    saves(b, time, [STEP_S] * 6, send=10**6)
    b.saw_queue(10 * YIELD_DELAY_S)
    assert b.current_rate() == pytest.approx(full)
    # One slow step is noise...
    saves(b, time, [1.5 * STEP_S], send=10**6)
    assert b.current_rate() == pytest.approx(full)
    # ...steps 10% longer while it sends: training slowed down; it backs off at each one...
    saves(b, time, [1.1 * STEP_S] * 2, send=10**6)
    assert b.pacer is not None and b.pacer.cuts == 2
    assert b.current_rate() == pytest.approx(SLOW_CUT ** 2 * full)
    # ...down to the floor at most, and back up once the steps are as long as before.
    saves(b, time, [2 * STEP_S] * 100, send=10**6)
    assert b.current_rate() >= b.derived_floor
    saves(b, time, [STEP_S] * 100, send=10**6)
    assert b.current_rate() == pytest.approx(full)


def test_a_drain_at_close_sends_at_the_rate_the_job_needs_not_at_the_learnt_back_off():
    """Backed off to the floor by slowed steps, the derived default would take minutes for
    the last push a closing job waits for; with training over (the drain) it goes at the full
    derived rate. An explicit budget is not derived and keeps its rate."""
    time = SimulatedTime()
    b = derived_budget(time)
    b.need(SHARD)
    saves(b, time, [STEP_S] * 3)
    full = b.current_rate()
    saves(b, time, [2 * STEP_S] * 100, send=10**6)
    assert b.current_rate() == pytest.approx(b.derived_floor) and b.derived_floor < full / 10
    b.training_over()
    assert b.current_rate() == pytest.approx(full)
    t0 = time.now
    for _ in b.chunks(0, SHARD):
        pass
    assert time.now - t0 <= STEP_S / HEADROOM + 0.01  # the last shard in under a step
    explicit = Budget(40 * 10**6, None, clock=time.clock, sleep=time.sleep)
    explicit.training_over()
    assert not explicit.derived and explicit.current_rate() == 40 * 10**6


def test_step_pacer_takes_the_baseline_from_intervals_without_replication():
    pacer = StepPacer()
    assert pacer.baseline is None
    for gap in (1.0, 1.2, 1.1):
        pacer.interval(gap, sending=True)
    assert pacer.baseline == 1.0  # none idle yet: the shortest
    for gap in (2.0, 2.2, 2.1):
        pacer.interval(gap, sending=False)
    assert pacer.baseline == 2.1
    assert derived_rate(10, 2.0, 1.0, start=1, floor=1, ceiling=100) == HEADROOM * 5
    assert derived_rate(10, 2.0, 1.0, start=20, floor=1, ceiling=100) == 20  # never below the start...
    assert derived_rate(10, 2.0, 0.5, start=20, floor=1, ceiling=100) == 10  # ...unless training slowed
    assert derived_rate(10, 2.0, 0.01, start=20, floor=1, ceiling=100) == 1
    assert derived_rate(10**6, 2.0, 1.0, start=20, floor=1, ceiling=100) == 100


def test_a_job_replicating_in_every_interval_still_learns_its_unslowed_step_and_backs_off():
    """A push every step keeps every interval busy, so none shows how long a step takes
    without replication; here replication at the full derived rate makes steps 25% longer
    (a link shared by training's collectives). The quiet intervals (every QUIET_EVERY-th, the
    senders held still) give the pacer the unslowed step, and it backs the rate off until the
    steps are within its tolerance. Without them the baseline is the shortest slowed step and
    the rate never moves."""
    time = SimulatedTime()
    b = derived_budget(time)
    b.need(SHARD)
    full = HEADROOM * SHARD / STEP_S

    def step_seconds(sending: bool) -> float:  # the job: slowed in proportion to the rate
        return STEP_S * (1 + 0.25 * min(1.0, b.current_rate() / full)) if sending else STEP_S

    quiet, lengths = [], []
    for save in range(1, 61):
        held = b.quiet
        quiet.append(held)
        gap = step_seconds(sending=not held and save > 1)
        lengths.append(gap)
        time.now += gap
        if not held and save > 1:
            b.take(MIN_CHUNK_BYTES)  # replication sent during the interval
        b.note_save()
    held_after = [i for i, q in enumerate(quiet) if q]  # quiet[i]: the interval after save i
    assert held_after == list(range(QUIET_FIRST, 60, QUIET_EVERY)), held_after
    assert b.pacer is not None and b.pacer.baseline == pytest.approx(STEP_S)
    assert b.pacer.cuts >= 3 and b.current_rate() < 0.5 * full
    assert b.current_rate() >= b.derived_floor
    assert max(lengths[-10:]) <= STEP_S * (1 + SLOWDOWN_TOLERANCE) / SLOW_CUT, lengths[-10:]


def test_a_quiet_interval_holds_every_sender_until_the_next_save_or_a_drain():
    """Real threads and clock: in a quiet interval a sender's next chunk waits for the next
    save (not for the clock alone: the interval ends when the save comes), and a drain ends
    the quiet at once."""
    b = Budget(default_bandwidth(None), None, yielding=True, ceiling=10**9)
    b.need(MIN_CHUNK_BYTES)
    interval = 0.4
    b.note_save()
    time.sleep(interval)
    b.note_save()  # save 2 (QUIET_FIRST): quiet until save 3, at most 1.5 x the interval
    assert b.quiet
    sent_at: list[float] = []
    stop = threading.Event()

    def sender() -> None:
        while not stop.is_set():
            b.take(MIN_CHUNK_BYTES)
            sent_at.append(time.monotonic())

    thread = threading.Thread(target=sender)
    thread.start()
    try:
        time.sleep(interval / 2)
        assert not sent_at  # held
        save_3 = time.monotonic()
        b.note_save()  # the quiet interval ends with the save
        wait_for(lambda: sent_at, "the sender to go on after the save", timeout=5)
        assert sent_at[0] >= save_3
        assert not b.quiet
        assert b.profile()["budget_quiet_seconds"] >= interval / 2 - 0.05
        for _ in range(QUIET_EVERY - 1):  # ...to the next quiet interval
            time.sleep(0.05)
            b.note_save()
        assert b.quiet
        count = len(sent_at)
        time.sleep(0.2)
        assert len(sent_at) <= count + 1  # (one chunk may have been past the check)
        b.training_over()  # a drain: someone waits for the bytes
        wait_for(lambda: len(sent_at) > count + 1, "the sender to go on after the drain", timeout=5)
    finally:
        stop.set()
        b.training_over()
        thread.join(timeout=10)
        b.close()


def test_a_real_send_at_the_derived_default_is_held_back_less_than_a_save_interval(tmp_path):
    """One real transfer (TCP over loopback, sendfile from a file, the kernel's pacing): a
    derived budget told of 32 MiB per save every ~50 ms books it at its ceiling, and holds the
    sender back for no longer than the shard takes at that rate (the old default, 62.5 MB/s,
    held it ~0.5 s)."""
    nbytes, ceiling = 32 * MiB, 400 * 10**6
    b = Budget(default_bandwidth(None), str(tmp_path / "bw"), yielding=True, ceiling=ceiling)
    b.need(nbytes)
    for _ in range(4):
        b.note_save()
        time.sleep(0.05)
    assert b.current_rate() == ceiling
    data = tmp_path / "shard"
    data.write_bytes(os.urandom(nbytes))
    got = bytearray()
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()

        def read() -> None:
            while chunk := conn.recv(1 << 20):
                got.extend(chunk)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            with open(data, "rb") as f:
                b.sendfile(client, f.fileno(), 0, nbytes)
        finally:
            client.close()
            reader.join(timeout=30)
            conn.close()
            b.close()
    assert bytes(got) == data.read_bytes()
    profile = b.profile()
    assert profile["sent_bytes"] == nbytes
    assert profile["budget_wait_seconds"] <= nbytes / ceiling + 0.05, profile
    assert profile["send_seconds"] > 0
