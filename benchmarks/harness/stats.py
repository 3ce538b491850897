"""Sizes, statistics and timers: what every figure of every benchmark is computed with."""

from __future__ import annotations

import random
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


def ratio_interval(num: list[float], den: list[float], *, draws: int = 2000,
                   level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval of median(num) / median(den): both samples redrawn with replacement
    ``draws`` times. On a shared machine steps vary by several percent, so a ratio of two
    medians alone cannot say whether 1.06x differs from 1.03x; its interval can."""
    if not num or not den:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(num, k=len(num)))
                    / statistics.median(rng.choices(den, k=len(den))) for _ in range(draws))
    cut = int((1 - level) / 2 * draws)
    return ratios[cut], ratios[draws - 1 - cut]


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
