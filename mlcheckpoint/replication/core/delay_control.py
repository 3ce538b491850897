"""What replication's pacing learns from the path, and what it decides from it (budget.py
paces; this module reads the kernel and holds the decision).

- ``queueing_delay``: how far a socket's smoothed round-trip time (TCP_INFO) stands above the
  connection's minimum: the queue on the path to the peer.
- ``next_rate``: the adaptive controller, a pure function of the samples (``Rate``: the node's
  rate and its recent peak). While the delay stays under ``TARGET_DELAY_S`` the rate grows
  back to the peak within ``GROW_S`` and past it exponentially; a sample past the target halves
  it (our own overshoot past the link's rate fills the queue slowly), one past
  ``YIELD_NOW_DELAY_S`` drops it to the floor (a collective's burst fills it at once). In the
  spirit of LEDBAT (RFC 6817), which these kernels do not ship as a congestion control; the
  growth scales with the rate, so it finds a link's idle capacity in tens of milliseconds
  whatever the link's speed.
- ``set_pacing``: SO_MAX_PACING_RATE, so the kernel spreads a chunk's packets over its slot.
- ``use_low_priority``: the kernel's low-priority congestion control (TCP-LP) where it has one.

What a machine lacks (TCP_INFO, pacing, a low-priority congestion control) is logged once
(``note_once``) and the pacing goes on without it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import socket
import struct
from dataclasses import dataclass

log = logging.getLogger(__package__ + ".budget")

# The adaptive controller (``next_rate``). A queue of TARGET_DELAY_S is what replication may
# add to training's collectives; tbf and most switch buffers hold a few milliseconds, so one
# past YIELD_NOW_DELAY_S is someone else's burst. Tuned on benchmarks/bench_network.py's
# emulated links (tbf, a queue of 4 ms) and a bulk exchange every 100 ms (docs/performance.md).
TARGET_DELAY_S = 0.001
YIELD_NOW_DELAY_S = 0.0025
GROW_S = 0.02  # on a quiet path: back to the peak within 20 ms, past it x2.7 per 20 ms
PEAK_MEMORY_S = 2.0  # the peak is forgotten (e-folding) over this long
PEAK_AFTER_OVERSHOOT = 0.8  # our own queue: the peak is set to this share of the rate
DECREASE = 0.5  # a sample past the target halves the rate...
CUT_EVERY_S = 0.01  # ...at most once per 10 ms: the queue takes that long to drain and show it
# At a low rate the receiver's delayed ACKs wait for the next segment, which reads as delay:
# samples are taken net of ACK_GAP_SEGMENTS segment times at the rate.
ACK_GAP_SEGMENTS = 2
SEGMENT_BYTES = 1448  # a full segment's payload on a 1500-byte MTU
MAX_GROW_GAP_S = 0.05  # a gap without samples says nothing about the path: grow at most this
# The least rate, as a share of the start (the default share of the link): what the fixed
# pacing yields to (YIELD_SHARE), so protection never stops and never takes more than before.
FLOOR_SHARE = 0.1
_LOW_PRIORITY_CC = ("lp", "ledbat")  # kernel congestion controls that yield to other flows

_TCP_INFO_BYTES = 152  # up to tcpi_min_rtt (struct tcp_info, linux/tcp.h)
_TCPI_RTT, _TCPI_MIN_RTT = 68, 148  # byte offsets of the u32 fields, microseconds

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # linux/asm-generic/socket.h
NO_PACING = 0xFFFFFFFF  # ~0U: the kernel's "no limit"


def net_of_ack_gap(delay: float, rate: float) -> float:
    """A sample of queueing delay, less what delayed ACKs add at ``rate`` bytes/s."""
    return max(0.0, delay - ACK_GAP_SEGMENTS * SEGMENT_BYTES / max(rate, 1.0))


@dataclass(frozen=True)
class Rate:
    """The controller's state: the node's rate, and the highest rate the path carried lately
    without a queue (``peak``, forgotten over ``PEAK_MEMORY_S``), in bytes/s: after training's
    traffic has passed, replication returns to it within ``GROW_S``."""

    rate: float
    peak: float


def next_rate(state: Rate, delay: float, since_sample: float, since_cut: float, *,
              floor: float, ceiling: float) -> Rate:
    """The adaptive controller's decision, from its state, a socket's queueing delay ``delay``
    (seconds, net of ``net_of_ack_gap``), the seconds since the previous sample and since the
    last cut. Under the target the rate grows over the time since the previous sample: up to
    the peak by ``peak / GROW_S`` per second, past it exponentially (time constant
    ``GROW_S``), never past the ceiling. (Not in proportion to how far under the target the
    delay is, as LEDBAT grows: the smoothed RTT stays inflated for tens of milliseconds after
    a collective's queue has drained, and that would keep replication out of the gap.)
    Past the target it is halved, and the peak set just under the rate that built the queue
    (our own overshoot); past ``YIELD_NOW_DELAY_S`` (someone else's burst) it drops to the
    floor and the peak stays. Not twice within one ``CUT_EVERY_S``: one queue shows in several
    samples."""
    gap = min(max(0.0, since_sample), MAX_GROW_GAP_S)
    peak = max(state.rate, state.peak * math.exp(-gap / PEAK_MEMORY_S))
    if delay > TARGET_DELAY_S:
        if since_cut < CUT_EVERY_S:
            return Rate(state.rate, peak)
        if delay > YIELD_NOW_DELAY_S:
            return Rate(floor, peak)
        return Rate(max(floor, state.rate * DECREASE), max(floor, state.rate * PEAK_AFTER_OVERSHOOT))
    step = max(state.rate, peak) * gap / GROW_S
    return Rate(min(ceiling, max(floor, state.rate + step)), peak)


# The default budget of a job whose checkpoint crosses the link ("auto", fixed pacing:
# ``derived_rate`` and ``StepPacer``). Replication is given HEADROOM times what carrying the
# node's checkpoint bytes every save interval needs (so a push takes about half an interval and
# a round's fixed costs still fit), within MAX_SHARE of the link; it backs off only when the
# save interval, while it sends, grows past SLOWDOWN_TOLERANCE over the interval while it does
# not (training itself slowed down), not when a collective merely queues beside it.
HEADROOM = 2.0
MAX_SHARE = 0.5
SLOWDOWN_TOLERANCE = 0.03
SLOW_CUT = 0.7  # a slowed interval: the rate times this...
SLOW_GROW = 1.15  # ...and back up by this per interval that is not slowed
PACER_WINDOW = 20  # the intervals the shortest is taken from, while none held still
PACER_SAMPLES = 3  # the slowdown is the median of this many recent intervals that sent
# A job that saves every step replicates in every interval, so no interval shows the step
# unslowed. Every QUIET_EVERY-th interval (the one after save 2, 2 + QUIET_EVERY, ...: the
# same on every node, as saves are collective) replication holds still, for at most
# QUIET_LONGEST x the baseline; the baseline is the median of the last QUIET_MEMORY of them.
QUIET_EVERY = 10
QUIET_FIRST = 2
QUIET_LONGEST = 1.5
QUIET_MEMORY = 5


def derived_rate(need: int, interval: float, factor: float, *, start: float, floor: float,
                 ceiling: float) -> float:
    """The node's rate, bytes/s: HEADROOM x ``need`` (bytes the node's ranks send per save)
    per ``interval`` (seconds between saves, unslowed), never less than ``start`` (the old
    fixed default: a job that saves rarely keeps its protection as young as before), times
    ``factor`` (``StepPacer``'s back-off, <= 1), within [floor, ceiling]."""
    want = max(start, HEADROOM * need / max(interval, 1e-3))
    return min(ceiling, max(floor, factor * want))


class StepPacer:
    """Tells training slowed by replication from training sharing the link with it: the
    intervals between this rank's saves, each marked whether replication sent during it.
    The baseline is the median interval that sent nothing (none yet: the shortest seen);
    ``quiet_next`` names the intervals in which replication holds still to measure it. An
    interval that sent and is past it by more than ``SLOWDOWN_TOLERANCE``, while the median of
    the last ``PACER_SAMPLES`` that sent is too (one slow step is noise), cuts ``factor`` (to
    no less than ``least``): every such interval, as steps are seconds long and a job that
    slows for several of them has lost more than replication gains. An interval that sent and
    was not slowed lets it grow back to 1. A pure state machine: no clock, no I/O."""

    def __init__(self, least: float = 0.01):
        self.least = least
        self.factor = 1.0
        self.idle: list[float] = []
        self.every: list[float] = []
        self.busy: list[float] = []
        self.cuts = 0
        self.saves = 0

    def quiet_next(self) -> bool:
        """A save was made: whether replication holds still until the next one (a baseline
        sample; QUIET_EVERY). Counted from the run's first save, so every node agrees."""
        self.saves += 1
        return self.saves >= QUIET_FIRST and (self.saves - QUIET_FIRST) % QUIET_EVERY == 0

    @property
    def baseline(self) -> float | None:
        if self.idle:
            return sorted(self.idle)[len(self.idle) // 2]
        return min(self.every) if self.every else None

    def interval(self, seconds: float, sending: bool) -> None:
        """One interval between saves, and whether replication sent bytes during it."""
        self.every = [*self.every, seconds][-PACER_WINDOW:]
        if not sending:
            self.idle = [*self.idle, seconds][-QUIET_MEMORY:]
            return
        self.busy = [*self.busy, seconds][-PACER_SAMPLES:]
        base = self.baseline
        if base is None or len(self.busy) < PACER_SAMPLES:
            return
        bound = base * (1 + SLOWDOWN_TOLERANCE)
        if seconds > bound and sorted(self.busy)[len(self.busy) // 2] > bound:
            self.factor = max(self.least, self.factor * SLOW_CUT)
            self.cuts += 1
        elif seconds <= bound:
            self.factor = min(1.0, self.factor * SLOW_GROW)


_noted: set[str] = set()


def note_once(what: str, message: str) -> None:
    """Log ``message`` once per process: a mechanism this machine lacks."""
    if what not in _noted:
        _noted.add(what)
        log.info(message)


@functools.lru_cache(maxsize=1)
def available_congestion_controls(path: str = "/proc/sys/net/ipv4/tcp_available_congestion_control"
                                  ) -> tuple[str, ...]:
    try:
        with open(path) as f:
            return tuple(f.read().split())
    except OSError:
        return ()


def use_low_priority(sock: socket.socket) -> None:
    """Put a paced socket on the kernel's low-priority congestion control where there is one;
    else say once that the delay-based controller is on its own."""
    name = next((c for c in _LOW_PRIORITY_CC if c in available_congestion_controls()), None)
    if name is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
            return
    note_once("cc", "mlcheckpoint: the kernel offers no low-priority TCP congestion control "
               f"(available: {' '.join(available_congestion_controls()) or 'unknown'}; "
               "tcp_lp would be one): replication yields by its own delay-based pacing alone")


def queueing_delay(sock: socket.socket) -> float | None:
    """Seconds the socket's smoothed RTT stands above its minimum (None: no TCP_INFO)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except OSError:
        return None
    if len(info) < _TCP_INFO_BYTES:
        return None
    rtt, = struct.unpack_from("<I", info, _TCPI_RTT)
    min_rtt, = struct.unpack_from("<I", info, _TCPI_MIN_RTT)
    if min_rtt in (0, 0xFFFFFFFF):
        return None
    return max(0, rtt - min_rtt) / 1e6


def set_pacing(sock: socket.socket, rate: int) -> bool:
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("I", rate))
    except OSError:
        return False
    return True
