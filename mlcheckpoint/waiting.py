"""Waiting for a condition that nothing signals: look, sleep ``poll`` seconds, look again.

The one polling loop of the library. Where a thread can be woken (an Event, a Condition),
wait on that instead; this is for facts that live in files, in another process or in a c10d
store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(done: Callable[[], T], deadline: float, poll: float,
               between: Callable[[], object] | None = None) -> T | None:
    """Call ``done()`` until it returns something true, and return that; None once
    ``time.monotonic()`` has passed ``deadline`` first (``done`` is always called at least
    once). ``between``: called before each sleep (e.g. to nudge the thread that does the
    work)."""
    while True:
        result = done()
        if result:
            return result
        if time.monotonic() >= deadline:
            return None
        if between is not None:
            between()
        time.sleep(max(0.0, min(poll, deadline - time.monotonic())))


def deadline_in(seconds: float) -> float:
    """The ``time.monotonic()`` deadline ``seconds`` from now."""
    return time.monotonic() + seconds
