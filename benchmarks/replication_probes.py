"""Where bench_replication.py's per-push breakdown comes from: timers on the functions the
transfer really runs through, wrapped (never replaced) in the benchmark's own processes.

Receiving end (any transport): every replica lands through the receive sink
(``mlcheckpoint/replication/sink.py``): ``ReceiveSink.begin`` gives the buffer, the transport
fills it, ``Receipt.commit`` verifies and commits, ``ReceiveSink.received`` tells the manager.
The checksums are timed where they are computed, in the store's hashing primitives
(``StreamingChecksum`` while bytes arrive in order, ``copier.process`` for bytes that landed
out of order), so they count wherever the sink calls them from.

Sending end: the payload is the span from the first to the last payload write
(``protocol.sendfile_all`` for TCP, ``torch.distributed.send`` for the process group), over
all streams of a striped push.

A phase whose functions never ran is reported as missing (None), never as 0: a renamed
function then shows up as a gap in the report, not as a fast phase.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from benchmarks.common import Timers, proc_cpu
from mlcheckpoint.integrity import checksum as checksum_mod
from mlcheckpoint.integrity import copier as copier_mod
from mlcheckpoint.replication import protocol
from mlcheckpoint.replication import sink as sink_mod


def _patch(owner: Any, name: str, wrapper: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Replace ``owner.name`` by ``wrapper(original)``; returns the undo."""
    original = getattr(owner, name)
    setattr(owner, name, wrapper(original))
    return lambda: setattr(owner, name, original)


class ReceiveClock:
    """The receiving end of each replica, phase by phase (installed for the whole process):

    - rx_buffer_s: ``ReceiveSink.begin`` (a recycled or a fresh tmpfs buffer; ``recycled``
      says which, when the store's buffer pool can be observed, else None);
    - rx_recv_s: from the buffer to ``Receipt.commit``, less the hashing done meanwhile;
    - rx_checksum_s: every checksum computed, while bytes arrived or at the commit;
    - rx_commit_s: ``Receipt.commit`` less its hashing;
    - rx_cpu_s: this process's CPU seconds from ``begin`` to ``received``.
    """

    def __init__(self) -> None:
        self.timers = Timers()
        self._local = threading.local()
        self._undo: list[Callable[[], None]] = []
        self.hash_calls = 0
        self._install()

    def _install(self) -> None:
        clock = self
        self._undo.append(_patch(sink_mod.ReceiveSink, "begin", self._timed_begin))
        self._undo.append(_patch(sink_mod.Receipt, "commit", self._timed_commit))
        for name in ("update", "digest"):
            self._undo.append(_patch(checksum_mod.StreamingChecksum, name, self._timed_hash))
        self._undo.append(_patch(copier_mod, "process", self._timed_hash))
        take = _pool_take()
        if take is not None:
            owner, name = take

            def observe(fn: Callable) -> Callable:
                def observed(*a: Any, **k: Any) -> Any:
                    got = fn(*a, **k)
                    clock.timers.flags["recycled"] = got is not None
                    return got
                return observed
            self._undo.append(_patch(owner, name, observe))

    def _timed_begin(self, fn: Callable) -> Callable:
        clock = self

        def begin(*a: Any, **k: Any) -> Any:
            clock.timers.take()  # a new receipt: forget what came before it (metadata pushes)
            clock.hash_calls = 0
            flags = clock.timers.flags
            flags["rx_cpu0"], t0 = proc_cpu(), time.perf_counter()
            receipt = fn(*a, **k)
            flags["rx_buffer_s"] = time.perf_counter() - t0
            flags["rx_buffer_ready_at"] = time.perf_counter()
            return receipt
        return begin

    def _timed_commit(self, fn: Callable) -> Callable:
        clock = self

        def commit(*a: Any, **k: Any) -> Any:
            flags = clock.timers.flags
            flags["rx_commit_at"] = t0 = time.perf_counter()
            clock._local.in_commit = True
            try:
                return fn(*a, **k)
            finally:
                clock._local.in_commit = False
                flags["rx_commit_wall_s"] = time.perf_counter() - t0
        return commit

    def _timed_hash(self, fn: Callable) -> Callable:
        clock = self

        def hashed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                clock.hash_calls += 1
                clock.timers.add("hash_s", dt)
                if getattr(clock._local, "in_commit", False):
                    clock.timers.add("hash_at_commit_s", dt)
        return hashed

    def take(self) -> dict[str, Any]:
        """The phases of the receipt that just ended (call from a ``ReplicaReceived`` subscriber)."""
        raw, calls = self.timers.take(), self.hash_calls
        out: dict[str, Any] = {"recycled": raw.get("recycled"), "rx_buffer_s": raw.get("rx_buffer_s"),
                               "rx_cpu_s": proc_cpu() - raw["rx_cpu0"] if "rx_cpu0" in raw else None}
        hash_s, at_commit = raw.get("hash_s", 0.0), raw.get("hash_at_commit_s", 0.0)
        out["rx_checksum_s"] = hash_s if calls else None  # no hash call seen: the path changed
        if "rx_commit_at" in raw and "rx_buffer_ready_at" in raw:
            out["rx_recv_s"] = raw["rx_commit_at"] - raw["rx_buffer_ready_at"] - (hash_s - at_commit)
            out["rx_commit_s"] = raw["rx_commit_wall_s"] - at_commit
        return out

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def _pool_take() -> tuple[Any, str] | None:
    """Where the store takes a recycled buffer (returns None when it has none to give)."""
    try:
        from mlcheckpoint.store.pool import BufferPool
        return BufferPool, "take"
    except ImportError:
        from mlcheckpoint.store.local_store import LocalStore
        return (LocalStore, "_take_from_pool") if hasattr(LocalStore, "_take_from_pool") else None


class SendClock:
    """The sending end's payload span: first payload write started -> last one ended, over
    every stream (``payload_min``: smaller writes are control messages)."""

    def __init__(self, payload_min: int = 1 << 20) -> None:
        self.payload_min = payload_min
        self.lock = threading.Lock()
        self.start: float | None = None
        self.end: float | None = None

    def _span(self, fn: Callable, size: Callable[..., int]) -> Callable:
        clock = self

        def timed(*a: Any, **k: Any) -> Any:
            if size(*a, **k) < clock.payload_min:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t1 = time.perf_counter()
                with clock.lock:
                    clock.start = t0 if clock.start is None else min(clock.start, t0)
                    clock.end = t1 if clock.end is None else max(clock.end, t1)
        return timed

    @contextmanager
    def installed(self) -> Iterator[SendClock]:
        undo = [_patch(protocol, "sendfile_all",
                       lambda fn: self._span(fn, lambda sock, fd, offset, nbytes, *a, **k: nbytes)),
                _patch(dist, "send", lambda fn: self._span(fn, lambda tensor, *a, **k: tensor.nbytes))]
        try:
            yield self
        finally:
            for u in reversed(undo):
                u()

    def take(self, t0: float, t_end: float) -> dict[str, float]:
        """The push started at ``t0`` and ended at ``t_end``: before / during / after the payload."""
        with self.lock:
            start, end, self.start, self.end = self.start, self.end, None, None
        if start is None or end is None:
            return {}
        return {"tx_before_payload_s": start - t0, "tx_payload_s": end - start,
                "tx_after_payload_s": t_end - end}


def public_methods(obj: Any) -> tuple[str, ...]:
    """The public methods of ``obj``: every way code outside it (the manager) can call in."""
    return tuple(n for n in dir(type(obj)) if not n.startswith("_") and callable(getattr(obj, n, None))
                 and not isinstance(getattr(type(obj), n, None), (type, property)))


def count_calls(obj: Any, names: tuple[str, ...], timers: Timers, key: str,
                when: Callable[[], bool]) -> None:
    """Add the time spent in ``obj``'s methods ``names`` to ``timers[key]`` while ``when()``;
    a call made from inside another counted call is not counted twice."""
    local = threading.local()

    def counting(fn: Callable) -> Callable:
        def counted(*a: Any, **k: Any) -> Any:
            if getattr(local, "busy", False) or not when():
                return fn(*a, **k)
            local.busy = True
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers.add(key, time.perf_counter() - t0)
                local.busy = False
        return counted

    for name in names:
        setattr(obj, name, counting(getattr(obj, name)))
