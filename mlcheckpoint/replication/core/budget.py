"""The replication bandwidth budget: bytes per second that replication may send in the
background, for the whole node (its ranks share one NIC).

Which bytes: what replication sends without anyone waiting for it: pushes of shards and
metadata to the partner, and the shards a node serves to a replaced node rebuilding its own
(the heal after a resume). Not the bytes a resume waits for (its range reads and metadata):
those take the full link. The receiver of a fetch does not send its bytes, the holder does,
so a fetch request says whether it is paced (``paced`` in the request; see core/service.py).

How the ranks of a node share it. They are separate processes, so the budget's state is a
16-byte file in the job directory (``layout.JobPaths.bandwidth``): until when the node's link
is booked, and how many bytes were booked in all. A sender books one chunk at a time, under an
flock held for a few microseconds: the chunk's turn comes once everything booked before it has
gone out at the budget's rate (at once when the link is idle), and the sender sleeps until
then. Every rank, thread and stripe of a node draws from that one schedule: N senders at once
get about 1/N of the budget each, with no rank holding the link for a whole shard (a heal
served by a node interleaves with its pushes), and in any t seconds the node sends at most
``rate * t + chunk`` bytes. (A token bucket one chunk deep: an idle link saves up no burst.)

Yielding to training. The link also carries training's collectives, and a fixed budget takes
its share of the link whether they need it or not. So a paced TCP send reads its socket's
TCP_INFO after each chunk: when the smoothed round-trip time stands above the connection's
minimum by more than ``YIELD_DELAY_S``, a queue is building on the path (replication alone,
paced below the link's rate, builds none: something else is filling the link), and the whole
node's replication drops to ``YIELD_SHARE`` of its budget for ``YIELD_HOLD_S``, renewed while
the queue stays. In the gaps between collectives it sends at the full budget. A scavenger in
the spirit of LEDBAT (RFC 6817), which these kernels do not ship as a congestion control.

Pacing goes in chunks of about 4 ms of budget (64 KiB to 4 MiB), each still sent with
sendfile() straight from the tmpfs file: no extra copy. Each paced socket also gets
SO_MAX_PACING_RATE, so the kernel spreads even one chunk's packets over its slot instead of
sending them at line rate into the collectives' queue.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ...errors import ProtocolError
from .network import link_speed

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
_TCP_INFO_BYTES = 152  # up to tcpi_min_rtt (struct tcp_info, linux/tcp.h)
_TCPI_RTT, _TCPI_MIN_RTT = 68, 148  # byte offsets of the u32 fields, microseconds

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # linux/asm-generic/socket.h
_NO_PACING = 0xFFFFFFFF  # ~0U: the kernel's "no limit"


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
    traffic was seen on the path (``yield_until``): send at ``YIELD_SHARE`` until then."""

    until: float = 0.0
    total: int = 0
    yield_until: float = 0.0


_STATE = struct.Struct("<dQd")


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
                booking = Booking(self._local.until, self._local.total, self._local.yield_until)
                yield booking
                self._local = booking
                return
            fd = self._open()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(fd, _STATE.size, 0)
                booking = Booking(*_STATE.unpack(raw)) if len(raw) == _STATE.size else Booking()
                yield booking
                os.pwrite(fd, _STATE.pack(booking.until, booking.total, booking.yield_until), 0)
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
        bytes_per_s: the node's budget; 0: no cap (nothing is paced or booked).
        path: the node's schedule file (``LocalStore.paths.bandwidth``); None: this process
            alone (tests).
        origin: where the rate came from, for the log.
        clock, sleep: time.monotonic and time.sleep; tests pass simulated ones.

    Counters (this process): ``bytes_sent``, every byte that went through the budget (also
    when uncapped); ``seconds_waited``, the sleeps it imposed. Node-wide:
    ``schedule.total_bytes()``.
    """

    def __init__(self, bytes_per_s: int, path: str | None = None, *, origin: str = "",
                 yielding: bool = False, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if isinstance(bytes_per_s, bool) or not isinstance(bytes_per_s, int) or bytes_per_s < 0:
            raise ValueError(f"bytes_per_s must be an int >= 0, not {bytes_per_s!r}")
        self.rate = bytes_per_s
        self.chunk = chunk_bytes(bytes_per_s) if bytes_per_s else MAX_CHUNK_BYTES
        self.origin = origin
        self.schedule = NodeSchedule(path if bytes_per_s else None)
        self._clock, self._sleep = clock, sleep
        # A booking further ahead than any set of senders could make (a schedule file left
        # by another boot, if local_dir is not tmpfs) is forgotten rather than slept on.
        self._stale_after = max(60.0, 1024 * self.chunk / bytes_per_s) if bytes_per_s else 0.0
        self.yielding = yielding and bytes_per_s > 0  # give way to other traffic (see above)
        self._counters = threading.Lock()
        self.bytes_sent = 0
        self.seconds_waited = 0.0
        self.yields = 0  # times this process saw a queue and slowed the node down

    @property
    def capped(self) -> bool:
        return self.rate > 0

    def describe(self) -> str:
        if not self.capped:
            return "no bandwidth cap"
        return f"at most {format_rate(self.rate)} per node ({self.origin})"

    def take(self, nbytes: int) -> float:
        """Book ``nbytes`` on the node's link and sleep until their turn; return the seconds
        slept. Callers book a chunk at a time (``chunks``)."""
        delay = 0.0
        if self.capped:
            with self.schedule.locked() as booking:
                now = self._clock()
                start = booking.until if now < booking.until < now + self._stale_after else now
                rate = self.rate * YIELD_SHARE if start < booking.yield_until else self.rate
                booking.until = start + nbytes / rate
                booking.total += nbytes
            delay = start - now
        with self._counters:
            self.bytes_sent += nbytes
            self.seconds_waited += delay
        if delay > 0:
            self._sleep(delay)
        return delay

    def chunks(self, offset: int, nbytes: int) -> Iterator[tuple[int, int]]:
        """(offset, length) of each chunk of the range, booked (and waited for) before it is
        yielded: the caller sends it at once."""
        if not self.capped:  # one piece, as fast as the link goes
            self.take(nbytes)
            yield offset, nbytes
            return
        end = offset + nbytes
        for start in range(offset, end, self.chunk):
            n = min(self.chunk, end - start)
            self.take(n)
            yield start, n

    def sendfile(self, sock: socket.socket, fd: int, offset: int, nbytes: int) -> None:
        """Send ``nbytes`` of the file ``fd`` from ``offset``, paced (sendfile: no copy)."""
        with self.kernel_paced(sock):
            for start, n in self.chunks(offset, nbytes):
                sendfile_all(sock, fd, start, n)
                self.watch(sock)

    def watch(self, sock: socket.socket) -> None:
        """After a chunk: if the path to the peer is queueing, slow the node down a while."""
        if self.yielding:
            self.saw_queue(queueing_delay(sock))

    def saw_queue(self, delay: float | None) -> None:
        """A socket's queueing delay was ``delay`` seconds (None: unknown): past
        ``YIELD_DELAY_S``, every sender of the node books at ``YIELD_SHARE`` of the budget for
        the next ``YIELD_HOLD_S``."""
        if not self.yielding or delay is None or delay <= YIELD_DELAY_S:
            return
        with self.schedule.locked() as booking:
            booking.yield_until = max(booking.yield_until, self._clock() + YIELD_HOLD_S)
        with self._counters:
            self.yields += 1

    def sendall(self, sock: socket.socket, data: bytes) -> None:
        """Send ``data``, paced."""
        view = memoryview(data)
        with self.kernel_paced(sock):
            for start, n in self.chunks(0, len(view)):
                sock.sendall(view[start:start + n])

    @contextlib.contextmanager
    def kernel_paced(self, sock: socket.socket) -> Iterator[None]:
        """Cap the socket at the budget's rate while the block sends (best effort: a kernel
        without TCP pacing leaves the user-space schedule alone in charge)."""
        # A little above the budget: the kernel counts headers too, and the schedule, not
        # the kernel, is what holds the node to its budget.
        kernel_rate = self.rate + self.rate // 16
        capped = self.capped and kernel_rate < _NO_PACING and _set_pacing(sock, kernel_rate)
        try:
            yield
        finally:
            if capped:  # a served connection may go on to serve unpaced requests
                _set_pacing(sock, _NO_PACING)

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


def _set_pacing(sock: socket.socket, rate: int) -> bool:
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("I", rate))
    except OSError:
        return False
    return True


def node_budget(setting: int | str, interface: str | None, path: str | None) -> Budget:
    """The budget of a node from the ``replication_bandwidth`` setting (bytes/s, 0 for no cap,
    or "auto": ``default_bandwidth`` of the NIC ``interface``), booked in the file ``path``."""
    # Other traffic shares a NIC; on loopback (one machine) there is none worth yielding to.
    yielding = interface is not None and interface != "lo"
    if setting != "auto":
        assert isinstance(setting, int)
        return Budget(setting, path, origin="replication_bandwidth", yielding=yielding)
    speed = link_speed(interface) if interface else None
    if speed:
        origin = f"default: {DEFAULT_BANDWIDTH_SHARE:g} of {interface}'s {format_rate(speed)}"
    else:
        origin = (f"default: {DEFAULT_BANDWIDTH_SHARE:g} of an assumed "
                  f"{format_rate(ASSUMED_LINK_BYTES_PER_S)}, as {interface or 'the interface'} "
                  "reports no speed; set MLCHECKPOINT_REPLICATION_BANDWIDTH to fit the link")
    return Budget(default_bandwidth(speed), path, origin=origin, yielding=yielding)
