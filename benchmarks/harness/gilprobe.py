"""How long a save can keep the training thread's Python waiting (the longest GIL hold).

A probe thread sleeps ``interval_s`` in a loop and records how much later than asked it wakes.
A sleeping thread needs the GIL back to wake, so its lateness is bounded below by the longest
stretch during which some other thread held the GIL (plus OS scheduling noise: measure a
baseline without saves beside it). Used by the benchmarks:

    with GilProbe() as probe:
        ckpt.async_save(sd, step)
        ckpt.wait()
    print(probe.longest_s, probe.percentile(99))
"""

from __future__ import annotations

import threading
import time


class GilProbe:
    """Measures its own wake-up delays on a daemon thread while the block runs."""

    def __init__(self, interval_s: float = 0.0005) -> None:
        self.interval_s = interval_s
        self.delays_s: list[float] = []  # lateness of each wake-up, in seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GilProbe:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="mlckpt-gilprobe", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> GilProbe:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        delays = self.delays_s
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(self.interval_s)
            delays.append(time.perf_counter() - t0 - self.interval_s)

    @property
    def longest_s(self) -> float:
        """The longest wake-up delay seen (0.0 before any)."""
        return max(self.delays_s, default=0.0)

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the wake-up delays."""
        if not self.delays_s:
            return 0.0
        ordered = sorted(self.delays_s)
        return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]
