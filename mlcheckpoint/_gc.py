"""Keeping Python's cyclic garbage collector out of a checkpoint's way.

A save of a few hundred tensors allocates tens of thousands of short-lived container objects
(DCP's plans and metadata, our manifest). Every 700 net allocations start a young collection,
and every few saves one of them escalates to a full collection, which walks every object of
the process while holding the GIL: ~110 ms here with only torch imported, more in a real
trainer. Nearly all of a save's garbage is freed by reference counting when the save is done,
so holding the collector off for the whole save removes those collections, not delays them.

CheckpointManager pauses it for each in-memory save and load; the writer's and reader's own
methods pause it too, for users who call ``dcp.save``/``dcp.load`` directly. A pause never
lasts more than ``MAX_PAUSE_S``: a save stuck waiting on a lost peer gives the collector back
to the rest of the process. ``MLCHECKPOINT_PAUSE_GC=0`` leaves the collector alone.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from . import settings

log = logging.getLogger(__name__)

MAX_PAUSE_S = 10.0

_lock = threading.Lock()
_depth = 0  # pauses in progress, over all threads
_reenable = False  # turn the collector back on when they end (it was on when they began)
_timer: threading.Timer | None = None

F = TypeVar("F", bound=Callable)


def enabled() -> bool:
    """Whether saves and loads pause the collector (``Tuning.pause_gc``)."""
    return settings.tuning().pause_gc


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off the cyclic collector for the block; nests, and overlaps across threads.

    The collector comes back when the last pause ends (or ``MAX_PAUSE_S`` after the first
    began), and only if it was on when the first began: a program that turned it off keeps
    it off.
    """
    global _depth, _reenable, _timer
    if not enabled():
        yield
        return
    with _lock:
        if _depth == 0:
            _reenable = gc.isenabled()
            if _reenable:
                gc.disable()
                _timer = threading.Timer(MAX_PAUSE_S, _give_back)
                _timer.daemon = True
                _timer.start()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _end_pause()


def _end_pause() -> None:
    global _reenable, _timer
    if _timer is not None:
        _timer.cancel()
        _timer = None
    if _reenable:
        gc.enable()
        _reenable = False


def _give_back() -> None:
    global _reenable
    with _lock:
        if _depth and _reenable:
            log.debug("a checkpoint held the garbage collector off for %.0f s; turned it back on",
                      MAX_PAUSE_S)
            gc.enable()
            _reenable = False  # the pauses still open must not turn it on again


def pausing_gc(fn: F) -> F:
    """``fn`` run under ``gc_paused()``."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        with gc_paused():
            return fn(*args, **kwargs)

    return paused  # type: ignore[return-value]


def _after_fork_in_child() -> None:
    # A child forked during a pause has none of the threads that paused: it starts afresh.
    global _depth, _reenable, _timer, _lock
    if _depth and _reenable:
        gc.enable()
    _depth, _reenable, _timer = 0, False, None
    _lock = threading.Lock()  # it may have been held by a thread the child does not have


os.register_at_fork(after_in_child=_after_fork_in_child)
