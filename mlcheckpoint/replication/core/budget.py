"""The replication bandwidth budget: bytes per second that replication may send in the
background, for the whole node (its ranks share one NIC).

Which bytes: what replication sends without anyone waiting for it: pushes of shards and
metadata to the partner, and the shards a node serves to a replaced node rebuilding its own
(the heal after a resume). Not the bytes a resume waits for (its range reads and metadata):
those take the full link. The receiver of a fetch does not send its bytes, the holder does,
so a fetch request says whether it is paced (``paced`` in the request; see core/service.py).

How the ranks of a node share it. They are separate processes, so the budget's state is a
56-byte file in the job directory (``layout.JobPaths.bandwidth``): until when the node's link
is booked, how many bytes were booked in all, and the pacing's state (``Booking``). A sender books one chunk at a time, under an
flock held for a few microseconds: the chunk's turn comes once everything booked before it has
gone out at the budget's rate (at once when the link is idle), and the sender sleeps until
then. Every rank, thread and stripe of a node draws from that one schedule: N senders at once
get about 1/N of the budget each, with no rank holding the link for a whole shard (a heal
served by a node interleaves with its pushes), and in any t seconds the node sends at most
``rate * t + chunk`` bytes. (A token bucket one chunk deep: an idle link saves up no burst.)

Yielding to training, and taking what it leaves idle. The link also carries training's
collectives, and a fixed budget takes its share of the link whether they need it or not, and
no more when they leave it idle. So a paced TCP send reads its socket's queueing delay
(``delay_control.queueing_delay``, from TCP_INFO) after each chunk: replication alone, paced
below the link's rate, builds no queue. The setting ``adaptive_pacing`` says what to do:

- adaptive (``MLCHECKPOINT_ADAPTIVE_PACING=1``; experimental, see docs/performance.md): the node's rate, kept in the shared schedule, follows the
  delay-based controller ``delay_control.next_rate``: it grows into the link while the
  queueing delay stays under 1 ms and is cut within milliseconds when it rises. It moves
  between the ceiling, the budget (``replication_bandwidth``; "auto": the NIC's speed, or an
  assumed 10 Gbit/s), and ``FLOOR_SHARE`` of where it starts (the budget; "auto": the default
  share of the link). So replication takes the gaps between collectives, and gives them back.
- fixed (the default): an explicit budget is the rate; past ``YIELD_DELAY_S`` of delay the
  whole node's replication drops to ``YIELD_SHARE`` of it for ``YIELD_HOLD_S``, renewed while
  the queue stays. The default budget ("auto", issue 45) is derived from the job: once the
  replicator has told it the bytes the node sends per save (``need``) and the saves' cadence
  (``note_save``), the rate is ``delay_control.derived_rate``: HEADROOM x those bytes per save
  interval, at least the old default (``default_bandwidth``), at most MAX_SHARE of the link.
  It then no longer yields to a queue (a collective beside it is sharing, not harm); it backs
  off when the save interval, while it sends, grows past the interval's baseline
  (``delay_control.StepPacer``): training itself slowed down. A job that saves every step
  replicates in every interval, so one interval in ``QUIET_EVERY`` is quiet: the node's
  senders hold still until the next save (or a drain), and that interval is the baseline.
  Until both are known it paces as an explicit budget of ``default_bandwidth``.

A preemption notice lifts the pacing of the process it reaches while its flush runs
(``Budget.hurried``): the machines are about to go, no step is left to spare, and a replaced
node's flush may be waiting for a heal this node serves.

Pacing goes in chunks of about 4 ms of budget (64 KiB to 4 MiB), each still sent with
sendfile() straight from the tmpfs file: no extra copy. Each paced socket also gets
SO_MAX_PACING_RATE, so the kernel spreads even one chunk's packets over its slot instead of
sending them at line rate into the collectives' queue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ...errors import ProtocolError
from ...settings import BY_NAME
from .delay_control import (
    FLOOR_SHARE,
    HEADROOM,
    MAX_SHARE,
    NO_PACING,
    QUIET_LONGEST,
    Rate,
    StepPacer,
    derived_rate,
    net_of_ack_gap,
    next_rate,
    note_once,
    queueing_delay,
    set_pacing,
    use_low_priority,
)
from .network import link_speed

log = logging.getLogger(__name__)

# The default budget ("auto"), as a share of the speed of the NIC replication uses. The link
# also carries training's collectives: replication at a share s leaves training 1 - s of it,
# so a step whose collectives keep the link busy a fraction b of the time grows by about
# b * s / (1 - s). In issue 21's 1 Gbit/s job, DDP's all-reduce (134 MB of gradients at
# 0.94 Gbit/s in a 1.63 s step) kept the link ~70% busy and unbudgeted replication made steps
# 2.5-3x slower; at s = 0.05 the estimate is ~4% there, and about 1% where the link is busy
# a fifth of the time. A smaller share protects more but
# lets protection lag further behind (a 400 MB shard takes 64 s at 0.05 of 1 Gbit/s). This is
# the one knob of the default: set it from benchmarks/bench_network.py.
DEFAULT_BANDWIDTH_SHARE = 0.05
# The link speed the default assumes where the NIC reports none (virtual devices, most cloud
# NICs; see network.link_speed): a common datacenter floor. The default there is then
# DEFAULT_BANDWIDTH_SHARE of 10 Gbit/s (62.5 MB/s); set the budget where you know the link.
ASSUMED_LINK_BYTES_PER_S = 10 * 10**9 // 8

# Chunks of about 4 ms of budget: small enough for smooth pacing, large enough that booking
# one (a lock, two syscalls) costs nothing next to sending it.
CHUNK_SECONDS = 0.004
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 4 << 20

# Yielding (see the module docstring): a queue of more than YIELD_DELAY_S on the path means
# other traffic; replication then sends at YIELD_SHARE of its budget for YIELD_HOLD_S.
YIELD_DELAY_S = 0.001
YIELD_SHARE = 0.1
YIELD_HOLD_S = 0.1
QUIET_POLL_S = 0.05  # how soon a sender held by a quiet interval sees it end



RAISE_THE_BUDGET = ("or raise replication_bandwidth (MLCHECKPOINT_REPLICATION_BANDWIDTH) if the "
                    "link has room.")
HEADROOM_TEXT = f"derived from the job: {HEADROOM:g}x its checkpoint bytes per save interval"


def default_bandwidth(link_bytes_per_s: int | None) -> int:
    """The "auto" budget in bytes/s for a NIC of ``link_bytes_per_s`` (None: unknown)."""
    return int(DEFAULT_BANDWIDTH_SHARE * (link_bytes_per_s or ASSUMED_LINK_BYTES_PER_S))


def chunk_bytes(rate: int) -> int:
    """The pacing chunk at ``rate`` bytes/s: ~CHUNK_SECONDS of budget, within the bounds, and
    never more than a second of it (a tiny budget must not sleep past a peer's timeout)."""
    return max(1, min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, int(rate * CHUNK_SECONDS)), rate))


def format_rate(bytes_per_s: float) -> str:
    """``62.5 MB/s (500 Mbit/s)``."""
    def si(value: float, unit: str) -> str:
        for prefix in ("", "K", "M", "G", "T"):
            if value < 1000 or prefix == "T":
                return f"{value:.3g} {prefix}{unit}"
            value /= 1000
        raise AssertionError("unreachable")
    return f"{si(bytes_per_s, 'B/s')} ({si(bytes_per_s * 8, 'bit/s')})"


@dataclass
class Booking:
    """The node's schedule: the link is booked until ``until`` (CLOCK_MONOTONIC seconds, the
    same clock in every process of the machine); ``total`` bytes were booked in all; other
    traffic was seen on the path (``yield_until``): send at ``YIELD_SHARE`` until then (fixed
    pacing). Adaptive pacing: the node's ``rate`` (0: not started), when it was last
    ``sampled`` and ``cut``."""

    until: float = 0.0
    total: int = 0
    yield_until: float = 0.0
    rate: float = 0.0
    peak: float = 0.0
    sampled: float = 0.0
    cut: float = 0.0


_STATE = struct.Struct("<dQddddd")


class NodeSchedule:
    """The booking of one node's link, in a file every rank's process opens (``path``; None:
    kept in this process only)."""

    def __init__(self, path: str | None):
        self.path = path
        # flock does not tell threads of one process apart (they share the file): this does.
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._local = Booking()

    @contextlib.contextmanager
    def locked(self) -> Iterator[Booking]:
        """The booking, to read and change; written back when the block ends without error."""
        with self._lock:
            if self.path is None:
                booking = dataclasses.replace(self._local)
                yield booking
                self._local = booking
                return
            fd = self._open()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(fd, _STATE.size, 0)
                booking = Booking(*_STATE.unpack(raw)) if len(raw) == _STATE.size else Booking()
                yield booking
                os.pwrite(fd, _STATE.pack(*dataclasses.astuple(booking)), 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _open(self) -> int:
        if self._fd is None:
            assert self.path is not None
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return self._fd

    def total_bytes(self) -> int:
        """Bytes booked on this node's link by every process, since the file was made."""
        with self.locked() as booking:
            return booking.total

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class Budget:
    """Paces what this process sends in the background, within the node's budget.

    Args:
        bytes_per_s: the node's budget (fixed pacing: the rate; adaptive: the ceiling); 0: no
            cap (nothing is paced or booked).
        path: the node's schedule file (``LocalStore.paths.bandwidth``); None: this process
            alone (tests).
        origin: where the rate came from, for the log.
        yielding: give way to other traffic on the path (see the module docstring).
        adaptive: with ``yielding``, the delay-based controller from ``start`` (bytes/s;
            default: the budget) instead of the fixed rate with its step down.
        clock, sleep: time.monotonic and time.sleep; tests pass simulated ones.

    Counters (this process): ``bytes_sent``, every byte that went through the budget (also
    when uncapped); ``seconds_waited``, the sleeps it imposed; ``yields``, the queues it saw
    and slowed the node down for. Node-wide: ``schedule.total_bytes()``, ``current_rate()``.
    """

    def __init__(self, bytes_per_s: int, path: str | None = None, *, origin: str = "",
                 yielding: bool = False, adaptive: bool = False, start: int | None = None,
                 ceiling: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if isinstance(bytes_per_s, bool) or not isinstance(bytes_per_s, int) or bytes_per_s < 0:
            raise ValueError(f"bytes_per_s must be an int >= 0, not {bytes_per_s!r}")
        self.rate = bytes_per_s
        self.origin = origin
        self.schedule = NodeSchedule(path if bytes_per_s else None)
        self._clock, self._sleep = clock, sleep
        self.yielding = yielding and bytes_per_s > 0  # give way to other traffic (see above)
        self.adaptive = self.yielding and adaptive
        self.start = float(min(bytes_per_s, start or bytes_per_s))
        self.floor = max(1.0, FLOOR_SHARE * self.start)
        self._rate_now = self.start if self.adaptive else float(bytes_per_s)  # the last booking's
        self.chunk = chunk_bytes(int(self._rate_now)) if bytes_per_s else MAX_CHUNK_BYTES
        # A booking further ahead than any set of senders could make (a schedule file left
        # by another boot, if local_dir is not tmpfs) is forgotten rather than slept on.
        slowest = self.floor if self.adaptive else bytes_per_s
        self._stale_after = max(60.0, 1024 * self.chunk / slowest) if bytes_per_s else 0.0
        self._counters = threading.Lock()
        self.bytes_sent = 0
        self.seconds_waited = 0.0
        self.seconds_sending = 0.0  # in sendfile()/sendall(): the kernel reads tmpfs and sends
        self.yields = 0  # times this process saw a queue and slowed the node down
        # The default derived from the job (fixed pacing, "auto": ``ceiling`` given): the rate
        # follows the bytes per save and the saves' cadence, within [floor, ceiling].
        self.derived = ceiling is not None and bytes_per_s > 0 and not self.adaptive
        self.ceiling = float(max(bytes_per_s, ceiling or 0))
        self.derived_floor = max(1.0, FLOOR_SHARE * bytes_per_s)
        self.pacer = StepPacer(least=self.derived_floor / self.ceiling) if self.derived else None
        self._need = 0  # bytes the node sends per save (``need``)
        self._last_save: tuple[float, int] | None = None  # (when, bytes_sent then)
        self._derived_rate: float | None = None  # None: not derived yet
        # A quiet interval (``StepPacer.quiet_next``): until then this process sends nothing;
        # 0.0: none. Set and cleared by the save path, read by the senders.
        self._quiet_until = 0.0
        self._quiet_set = False  # the interval since the last save was meant to be quiet
        self.seconds_quiet = 0.0
        self._hurried = False  # a preemption flush runs here: nothing is paced (``hurried``)
        if self.derived:  # a booking may be slept on for as long as the slowest rate takes
            self._stale_after = max(self._stale_after, 1024 * self.chunk / self.derived_floor)

    @property
    def capped(self) -> bool:
        return self.rate > 0

    def describe(self) -> str:
        if not self.capped:
            return "no bandwidth cap"
        if self.adaptive:
            return (f"adaptive: up to {format_rate(self.rate)} per node ({self.origin}), from "
                    f"{format_rate(self.start)}, yielding to other traffic on the link")
        if self.derived:
            return (f"{HEADROOM_TEXT} per node, within {format_rate(self.derived_floor)} to "
                    f"{format_rate(self.ceiling)}, from {format_rate(self.rate)} ({self.origin})")
        return f"at most {format_rate(self.rate)} per node ({self.origin})"

    def lag_advice(self) -> str:
        """What holds a push back and what to do, for the warning that replication lags
        (``schedule/status.LagWarning``)."""
        if not self.capped:
            return ("replication has no bandwidth cap here: the link or the receiving node "
                    "sets the pace.")
        pacer = self.pacer
        if self.derived and pacer is not None and pacer.factor < 1:
            return (f"the default budget backed off to {format_rate(self.current_rate())}, as "
                    "training's steps grew while it sent: it protects fewer saves rather than "
                    "slow training. Setting replication_bandwidth to a rate makes it send at "
                    "that rate, even if training slows.")
        if self.derived:
            return (f"the default budget sends at {format_rate(self.current_rate())}, at most "
                    f"{format_rate(self.ceiling)} (half the link): set replication_bandwidth "
                    "if the link has more room.")
        return RAISE_THE_BUDGET

    # ------------------------------------------------------------------ the derived default
    def need(self, nbytes: int) -> None:
        """The replicator's word: the node sends about ``nbytes`` per save (its ranks' pushes
        together). The derived default's rate follows it."""
        if self.derived and nbytes > 0:
            self._need = nbytes
            self._derive()

    def note_save(self) -> None:
        """A save was made here: one more interval for ``StepPacer`` (did replication send
        during it?), and the derived rate follows. Every few saves the interval that starts
        now is quiet (``StepPacer.quiet_next``): the senders hold still until the next save,
        so the pacer sees how long a step takes without replication."""
        pacer = self.pacer
        if not self.derived or pacer is None:
            return
        now = self._clock()
        with self._counters:
            sent = self.bytes_sent
        last, self._last_save = self._last_save, (now, sent)
        # A quiet interval that ran over, or that a drain ended, sent: it says nothing.
        was_quiet, cut_short = self._quiet_set, self._quiet_until < now
        self._quiet_until, self._quiet_set = 0.0, False
        if last is not None and not (was_quiet and cut_short):
            # A chunk booked just before the quiet began does not make it a sending interval.
            pacer.interval(now - last[0], sent > last[1] and not was_quiet)
            self._derive()
        if pacer.quiet_next():
            length = pacer.baseline or (now - last[0] if last is not None else None)
            if length:
                self._quiet_until, self._quiet_set = now + QUIET_LONGEST * length, True

    @property
    def quiet(self) -> bool:
        """Whether this process's senders hold still now (a quiet interval)."""
        return self._quiet_until > self._clock()

    def training_over(self) -> None:
        """The job is closing and waits for its last pushes (a drain): no step is left to slow
        down. A quiet interval holds nothing back, and the derived default drops the back-off
        it learnt from slowed steps, so the last push goes at the rate the job's bytes need
        rather than at the floor (its close waited 30-50 s for one 190 MiB push there). An
        explicit budget keeps its rate."""
        self._quiet_until = 0.0
        pacer = self.pacer
        if self.derived and pacer is not None and pacer.factor < 1.0:
            log.debug("replication budget: training is over, back-off %.2f lifted", pacer.factor)
            pacer.factor = 1.0
            self._derive()

    @contextlib.contextmanager
    def hurried(self) -> Iterator[None]:
        """While the block runs (a preemption flush), this process sends at the link's speed:
        the machines are about to go, and what still crosses (a shard served to a replaced
        node's heal, which that node's flush waits for) must beat the flush's deadline rather
        than spare training's steps. Sends already under way drop their pacing at the next
        chunk."""
        self._hurried = True
        try:
            yield
        finally:
            self._hurried = False

    def _hold_while_quiet(self) -> float:
        """Sleep while a quiet interval lasts; the seconds slept."""
        slept = 0.0
        while (left := self._quiet_until - self._clock()) > 0:
            nap = min(left, QUIET_POLL_S)
            self._sleep(nap)
            slept += nap
        if slept:
            with self._counters:
                self.seconds_quiet += slept
        return slept

    def _derive(self) -> None:
        """Publish the derived rate in the node's schedule (every rank of the node books at
        the last one written: their shards, and so their rates, are alike)."""
        pacer = self.pacer
        base = pacer.baseline if pacer is not None else None
        if pacer is None or base is None or not self._need:
            return
        rate = derived_rate(self._need, base, pacer.factor, start=self.rate,
                            floor=self.derived_floor, ceiling=self.ceiling)
        if self._derived_rate is None or abs(rate - self._derived_rate) > 0.05 * self._derived_rate:
            log.debug("replication budget derived: %s (%d bytes per save every %.3f s, "
                      "back-off %.2f)", format_rate(rate), self._need, base, pacer.factor)
        self._derived_rate = rate
        with self.schedule.locked() as booking:
            booking.rate = rate

    def _booking_rate(self, booking: Booking, start: float) -> float:
        if self.derived and booking.rate:
            return booking.rate
        if self.adaptive:
            if not booking.rate:
                booking.rate = self.start
            return booking.rate
        return self.rate * YIELD_SHARE if start < booking.yield_until else self.rate

    def take(self, nbytes: int) -> float:
        """Book ``nbytes`` on the node's link and sleep until their turn; return the seconds
        slept. Callers book a chunk at a time (``chunks``)."""
        quiet = self._hold_while_quiet() if self.derived and not self._hurried else 0.0
        wait = 0.0  # for this chunk's turn (start >= now)
        if self.capped and not self._hurried:
            with self.schedule.locked() as booking:
                now = self._clock()
                start = booking.until if now < booking.until < now + self._stale_after else now
                rate = self._booking_rate(booking, start)
                booking.until = start + nbytes / rate
                booking.total += nbytes
            self._rate_now = rate
            wait = start - now
        with self._counters:
            self.bytes_sent += nbytes
            self.seconds_waited += quiet + wait
        if wait > 0:
            self._sleep(wait)
        return quiet + wait

    def current_rate(self) -> float:
        """The node's rate now (bytes/s): the controller's, or the fixed one (0: no cap)."""
        if not self.capped:
            return 0.0
        with self.schedule.locked() as booking:
            return self._booking_rate(booking, self._clock())

    def chunks(self, offset: int, nbytes: int) -> Iterator[tuple[int, int]]:
        """(offset, length) of each chunk of the range, booked (and waited for) before it is
        yielded: the caller sends it at once. Adaptive chunks follow the rate (~4 ms of it)."""
        if not self.capped:  # one piece, as fast as the link goes
            self.take(nbytes)
            yield offset, nbytes
            return
        end = offset + nbytes
        start = offset
        while start < end:
            chunk = chunk_bytes(int(self._rate_now)) if self.adaptive or self.derived else self.chunk
            n = end - start if self._hurried else min(chunk, end - start)
            self.take(n)
            yield start, n
            start += n

    def sendfile(self, sock: socket.socket, fd: int, offset: int, nbytes: int) -> None:
        """Send ``nbytes`` of the file ``fd`` from ``offset``, paced (sendfile: no copy)."""
        with self.kernel_paced(sock) as pace:
            for start, n in self.chunks(offset, nbytes):
                pace()
                t0 = time.perf_counter()
                sendfile_all(sock, fd, start, n)
                self._sending(time.perf_counter() - t0)
                self.watch(sock)

    def _sending(self, seconds: float) -> None:
        with self._counters:
            self.seconds_sending += seconds

    def profile(self) -> dict[str, float]:
        """This process's sending so far: bytes, seconds in the kernel's send (which reads
        the tmpfs file: sendfile), seconds the budget held it back, queues it yielded to."""
        with self._counters:
            return {"sent_bytes": self.bytes_sent, "send_seconds": self.seconds_sending,
                    "budget_wait_seconds": self.seconds_waited, "budget_yields": self.yields,
                    "budget_quiet_seconds": self.seconds_quiet}

    def watch(self, sock: socket.socket) -> None:
        """After a chunk: act on the queue on the path to the peer (module docstring)."""
        if not self.yielding:
            return
        delay = queueing_delay(sock)
        if delay is None:
            note_once("tcp_info", "mlcheckpoint: no TCP_INFO on replication's sockets here: "
                       "replication cannot see training's traffic and keeps its rate")
        if self.adaptive:
            self.sample(delay)
        else:
            self.saw_queue(delay)

    def sample(self, delay: float | None) -> None:
        """Adaptive pacing: a socket's queueing delay was ``delay`` seconds (None: unknown);
        move the node's rate as ``next_rate`` decides."""
        if not self.adaptive or delay is None:
            return
        with self.schedule.locked() as booking:
            now = self._clock()
            rate = booking.rate or self.start
            state = next_rate(Rate(rate, booking.peak), net_of_ack_gap(delay, rate),
                              now - booking.sampled if booking.sampled else 0.0, now - booking.cut,
                              floor=self.floor, ceiling=self.rate)
            new = state.rate
            if new < rate:
                booking.cut = now
            booking.rate, booking.peak, booking.sampled = new, state.peak, now
        self._rate_now = new
        if new < rate:
            with self._counters:
                self.yields += 1

    def saw_queue(self, delay: float | None) -> None:
        """Fixed pacing: a socket's queueing delay was ``delay`` seconds (None: unknown): past
        ``YIELD_DELAY_S``, every sender of the node books at ``YIELD_SHARE`` of the budget for
        the next ``YIELD_HOLD_S``. Not once the default is derived from the job."""
        if not self.yielding or delay is None or delay <= YIELD_DELAY_S:
            return
        if self._derived_rate is not None:  # derived: a queue is sharing; StepPacer sees harm
            return
        with self.schedule.locked() as booking:
            booking.yield_until = max(booking.yield_until, self._clock() + YIELD_HOLD_S)
        with self._counters:
            self.yields += 1

    def sendall(self, sock: socket.socket, data: bytes) -> None:
        """Send ``data``, paced."""
        view = memoryview(data)
        with self.kernel_paced(sock) as pace:
            for start, n in self.chunks(0, len(view)):
                pace()
                t0 = time.perf_counter()
                sock.sendall(view[start:start + n])
                self._sending(time.perf_counter() - t0)

    @contextlib.contextmanager
    def kernel_paced(self, sock: socket.socket) -> Iterator[Callable[[], None]]:
        """Cap the socket at the rate while the block sends (best effort: a kernel without
        TCP pacing leaves the user-space schedule alone in charge). The block calls what it
        is given before each chunk: under adaptive pacing the cap follows the node's rate."""
        if self.yielding:
            use_low_priority(sock)
        paced = [0]  # the socket's cap now (0: none set)

        def pace() -> None:
            # A little above the rate: the kernel counts headers too, and the schedule, not
            # the kernel, is what holds the node to its budget.
            kernel_rate = min(NO_PACING - 1, int(self._rate_now * 17 / 16))
            if self._hurried and paced[0]:
                set_pacing(sock, NO_PACING)
                paced[0] = 0
            elif self.capped and not self._hurried and kernel_rate != paced[0]:
                if set_pacing(sock, kernel_rate):
                    paced[0] = kernel_rate
                else:
                    note_once("pacing", "mlcheckpoint: this kernel refuses SO_MAX_PACING_RATE: "
                               "replication paces per chunk only")

        try:
            yield pace
        finally:
            if paced[0]:  # a served connection may go on to serve unpaced requests
                set_pacing(sock, NO_PACING)

    def close(self) -> None:
        self.schedule.close()


def sendfile_all(sock: socket.socket, fd: int, offset: int, count: int) -> None:
    """os.sendfile until ``count`` bytes are sent (kernel timeouts end a stuck peer)."""
    end = offset + count
    while offset < end:
        try:
            sent = os.sendfile(sock.fileno(), fd, offset, end - offset)
        except BlockingIOError:
            raise ProtocolError("peer stopped reading (send timed out)") from None
        except OSError as e:
            if e.errno == errno.EINTR:
                continue
            raise
        if sent == 0:
            raise ProtocolError(f"sendfile stopped {end - offset} bytes short (file truncated?)")
        offset += sent


def node_budget(setting: int | str, interface: str | None, path: str | None, *,
                adaptive: bool | None = None) -> Budget:
    """The budget of a node from the ``replication_bandwidth`` setting (bytes/s, 0 for no cap,
    or "auto"), booked in the file ``path``, paced adaptively or not (``adaptive``; None: the
    setting ``adaptive_pacing``, $MLCHECKPOINT_ADAPTIVE_PACING). Fixed: the budget ("auto":
    ``default_bandwidth`` of the NIC ``interface``). Adaptive: up to the budget, from it
    ("auto": up to the NIC's speed or an assumed one, from ``default_bandwidth``)."""
    # Other traffic shares a NIC; on loopback (one machine) there is none worth yielding to.
    yielding = interface is not None and interface != "lo"
    if adaptive is None:
        adaptive = bool(BY_NAME["adaptive_pacing"].resolve())
    speed = link_speed(interface) if interface else None
    if setting != "auto":
        assert isinstance(setting, int)
        # What the user allows, the controller may start at (the pg transport, which takes no
        # samples, stays there).
        return Budget(setting, path, origin="replication_bandwidth", yielding=yielding,
                      adaptive=adaptive)
    link = (f"{interface}'s {format_rate(speed)}" if speed else
            f"an assumed {format_rate(ASSUMED_LINK_BYTES_PER_S)}, as {interface or 'the interface'} "
            "reports no speed; set MLCHECKPOINT_REPLICATION_BANDWIDTH to fit the link")
    if adaptive and yielding:
        return Budget(speed or ASSUMED_LINK_BYTES_PER_S, path, origin=f"default: {link}",
                      yielding=True, adaptive=True, start=default_bandwidth(speed))
    # Derived from the job where other traffic shares the link (see the module docstring);
    # on loopback the old default stays (nothing to share with, nothing to derive for).
    ceiling = int(MAX_SHARE * (speed or ASSUMED_LINK_BYTES_PER_S)) if yielding else None
    return Budget(default_bandwidth(speed), path, yielding=yielding, ceiling=ceiling,
                  origin=f"default: {DEFAULT_BANDWIDTH_SHARE:g} of {link}")
