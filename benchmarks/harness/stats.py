"""Sizes, statistics and timers: what every figure of every benchmark is computed with."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

GB = 1e9  # throughput is reported in decimal GB/s
MiB = 1 << 20
GiB = 1 << 30


# ---------------------------------------------------------------------------------- statistics
def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def p90(xs: list[float]) -> float:
    """The 90th percentile, nearest rank (no interpolation between two steps' times)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else float("nan")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of ``fn()``."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def proc_cpu() -> float:
    """CPU seconds (user + system) of this process, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def size_str(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"
