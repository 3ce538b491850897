"""What replication's pacing learns from the path, and what it decides from it (budget.py
paces; this module reads the kernel and holds the decision).

- ``queueing_delay``: how far a socket's smoothed round-trip time (TCP_INFO) stands above the
  connection's minimum: the queue on the path to the peer.
- ``next_rate``: the adaptive controller, a pure function of the samples: the node's rate grows
  exponentially (time constant ``GROW_S``) while the delay stays under ``TARGET_DELAY_S``, is
  halved when a sample exceeds it and dropped to the floor when one exceeds
  ``YIELD_NOW_DELAY_S``: a collective's burst fills the queue at once, our own overshoot past
  the link's rate fills it slowly. In the spirit of LEDBAT (RFC 6817), which these kernels do
  not ship as a congestion control; growth is multiplicative, so it reaches a link's idle
  capacity in a few tens of milliseconds whatever the link's speed.
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

log = logging.getLogger(__package__ + ".budget")

# The adaptive controller (``next_rate``). A queue of
# TARGET_DELAY_S is what replication may add to training's collectives; tbf and most switch
# buffers hold a few milliseconds, so one past YIELD_NOW_DELAY_S is someone else's burst.
TARGET_DELAY_S = 0.001
YIELD_NOW_DELAY_S = 0.002
GROW_S = 0.05  # e-folding time of the rate on an idle path: x2.7 per 50 ms
DECREASE = 0.5  # a sample past the target halves the rate...
CUT_EVERY_S = 0.004  # ...at most once per chunk's time (the queue shows in several samples)
MAX_GROW_GAP_S = 0.05  # a gap without samples says nothing about the path: grow at most this
FLOOR_SHARE = 0.005  # the least rate, as a share of the ceiling: protection never stops
_LOW_PRIORITY_CC = ("lp", "ledbat")  # kernel congestion controls that yield to other flows

_TCP_INFO_BYTES = 152  # up to tcpi_min_rtt (struct tcp_info, linux/tcp.h)
_TCPI_RTT, _TCPI_MIN_RTT = 68, 148  # byte offsets of the u32 fields, microseconds

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # linux/asm-generic/socket.h
NO_PACING = 0xFFFFFFFF  # ~0U: the kernel's "no limit"


def next_rate(rate: float, delay: float, since_sample: float, since_cut: float, *,
              floor: float, ceiling: float) -> float:
    """The adaptive controller's decision: the node's new rate (bytes/s) from its rate
    ``rate``, a socket's queueing delay ``delay`` (seconds), the seconds since the previous
    sample and since the last cut. Under the target the rate grows in proportion to how far
    under it the delay is, over the time since the previous sample; past the target it is
    halved, past ``YIELD_NOW_DELAY_S`` dropped to the floor (not twice within one
    ``CUT_EVERY_S``: one queue shows in several samples)."""
    if delay > TARGET_DELAY_S:
        if since_cut < CUT_EVERY_S:
            return rate
        return floor if delay > YIELD_NOW_DELAY_S else max(floor, rate * DECREASE)
    growth = (1 - delay / TARGET_DELAY_S) * min(max(0.0, since_sample), MAX_GROW_GAP_S) / GROW_S
    return min(ceiling, max(floor, rate * math.exp(growth)))


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
