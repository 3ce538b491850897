"""wait_until: the library's one polling loop (mlcheckpoint/waiting.py)."""

from __future__ import annotations

import threading
import time

from mlcheckpoint.waiting import deadline_in, wait_until


def test_returns_what_done_returned_once_it_is_true():
    looks = iter([None, 0, "", "ready"])
    nudges = []
    assert wait_until(lambda: next(looks), deadline_in(5), poll=0.001,
                      between=lambda: nudges.append(1)) == "ready"
    assert len(nudges) == 3  # before each sleep, not after the last look


def test_none_once_the_deadline_passes_and_done_is_looked_at_at_least_once():
    looks = []
    start = time.monotonic()
    assert wait_until(lambda: looks.append(1), deadline_in(0.1), poll=0.02) is None
    assert 0.1 <= time.monotonic() - start < 2 and len(looks) >= 2
    looks.clear()
    assert wait_until(lambda: looks.append(1), deadline_in(-1), poll=10) is None
    assert looks == [1]  # an expired deadline still looks once, and does not sleep


def test_sees_a_fact_another_thread_makes_true():
    flag = threading.Event()
    threading.Timer(0.05, flag.set).start()
    assert wait_until(flag.is_set, deadline_in(5), poll=0.01) is True
