"""A preemption notice turned into a flush (``flush.py``) on a thread of its own.

The notice: SIGTERM (what torchrun forwards to its ranks when its agent is told to stop,
about 30 s before SIGKILL), a file appearing (``MLCHECKPOINT_FLUSH_NOTICE_FILE``, for a
scheduler that announces otherwise), or a call (``CheckpointManager.flush_to_persistent``).

Why a wakeup fd and a watcher thread, not only ``signal.signal``: Python runs a signal handler
on the main thread, between bytecodes. A torchrun worker's main thread is often inside a
collective (a gloo or NCCL wait, in C++ with the GIL released), and when a peer is dying that
wait may last until the collective's timeout: measured here, a Python SIGTERM handler ran only
when a gloo ``all_reduce`` returned, 6 s after the signal, while a thread reading the wakeup
fd woke at once. So the handler is installed with ``signal.signal`` (Python's C-level handler
then writes the signal's number to the wakeup fd, whichever thread the kernel chose), and
``mlckpt-notice`` reads that fd and starts the flush at once. Blocking SIGTERM and
``sigwait``-ing on a thread instead would need the signal blocked in every thread, those
torch started before us included, and would keep the user's own handler from ever running.

What then happens to the process, as without the flush: the handler, once on the main thread,
waits for the flush (at most until the deadline), then runs the handler that was installed
before ours (the user's), or, if there was none, ends the process by SIGTERM's default
action. If the main thread never gets there (stuck in a collective) and SIGTERM's
disposition before ours was the default, the watcher ends the process the same way once the
flush is over: without us it would have died at the signal. A user handler, or SIG_IGN, is
left to the main thread, as it would have been.

A notice during a resume (``handler_after``): the flush is to write the step the main thread
is loading, so it waits for the load (``Flusher.resuming``), and the handler, which would
otherwise wait for that flush on the very thread it waits for, only notes the signal and
returns; it runs in full once the resume is over.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ..waiting import deadline_in
from .flush import FlushResult

log = logging.getLogger(__name__)

# How long the watcher leaves the main thread to run the handler itself, once the flush is
# over, before it ends the process on the main thread's behalf.
MAIN_THREAD_GRACE_S = 0.5
NOTICE_FILE_POLL_S = 0.5
_live: weakref.WeakSet[Preemption] = weakref.WeakSet()  # installed in this process


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) inherits our handler and the wakeup fd, whose pipe
    the parent's watcher reads: a SIGTERM to the child would make the parent flush and end.
    The child gets SIGTERM's previous handling back, and no wakeup fd of ours."""
    for p in list(_live):
        p.forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Preemption:
    """Runs ``flush(deadline)`` on the ``mlckpt-flush`` thread on a notice, once at a time (a
    notice during a flush runs one more after it: newer steps may have been saved).

    Args:
        flush: writes this rank's part (``Flusher.flush``).
        deadline_s: how long after a notice the flush may hold the process.
        on_sigterm: install the SIGTERM route (only from the main thread).
        notice_file: a path whose appearance is a notice (None: none).
    """

    def __init__(self, flush: Callable[[float], FlushResult], *, deadline_s: float,
                 on_sigterm: bool, notice_file: str | None):
        self._flush = flush
        self.deadline_s = deadline_s
        self.notice_file = notice_file
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._requested = 0  # notices so far (under _lock)
        self._served = 0  # notices the flushes finished so far cover
        self._pending_deadline: float | None = None  # of the notices no flush has taken yet
        self._running = False  # a flush thread runs and will look for notices again
        self._sigterm_deadline: float | None = None  # the flush a SIGTERM asked for must end by
        self.last: FlushResult | None = None
        self._thread: threading.Thread | None = None
        self._previous: Any = None  # SIGTERM's handler before ours
        self._installed = False
        self._in_handler = threading.Event()  # the main thread reached our handler
        self._handling = False  # our handler runs on the main thread now (only it touches this)
        self._holding = False  # the main thread is in a ``handler_after`` block
        self._held: tuple[int, Any] | None = None  # the SIGTERM that came during it
        self._hold_lock = threading.Lock()  # the block's end and ``_release_held`` take _held
        self._closed = threading.Event()
        self._wake_r = self._wake_w = -1
        self._old_wakeup_fd = -1
        self._watcher: threading.Thread | None = None
        if on_sigterm:
            self._install()
        if self._installed or notice_file:
            self._watcher = threading.Thread(target=self._watch, name="mlckpt-notice", daemon=True)
            self._watcher.start()

    # ------------------------------------------------------------------ notices
    def notice(self, why: str) -> None:
        """Start a flush (or, while one runs, one more after it)."""
        with self._lock:
            self._requested += 1
            first = self._requested == 1
            if self._pending_deadline is None:
                self._pending_deadline = deadline_in(self.deadline_s)
            if not self._running:
                self._running = True
                # Not a daemon: a process leaving its main thread (a user's handler raising
                # SystemExit) waits for the flush, which stops at its deadline.
                self._thread = threading.Thread(target=self._run, name="mlckpt-flush")
                self._thread.start()
        if first:
            log.warning("mlcheckpoint: preemption notice (%s): writing this rank's part of the "
                        "newest step in memory to the persistent folder (deadline %.0fs)",
                        why, self.deadline_s)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._served >= self._requested:
                    self._running = False
                    self._done.notify_all()
                    return
                upto, deadline = self._requested, self._pending_deadline or deadline_in(0)
                self._pending_deadline = None
            try:
                result = self._flush(deadline)
            except Exception as e:  # a dying process: say it, do not raise
                log.exception("mlcheckpoint: preemption flush failed")
                result = FlushResult(reason=f"{type(e).__name__}: {e}")
            with self._lock:
                self.last = result
                self._served = upto
                self._done.notify_all()

    def wait(self, until: float | None = None) -> FlushResult | None:
        """Wait for the flushes asked so far (until ``until``, a ``time.monotonic()``
        deadline, at the latest); the last one's result."""
        with self._lock:
            while self._served < self._requested:
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._done.wait(left)
            return self.last

    def flush_now(self, why: str) -> FlushResult | None:
        """A notice, waited for (at most the deadline)."""
        self.notice(why)
        return self.wait(deadline_in(self.deadline_s))

    # ------------------------------------------------------------------ SIGTERM
    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.info("mlcheckpoint: the manager was made off the main thread: SIGTERM does not "
                     "start the preemption flush (MLCHECKPOINT_FLUSH_NOTICE_FILE or "
                     "flush_to_persistent() still do)")
            return
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self._installed = True
        _live.add(self)

    def forget_in_child(self) -> None:
        """In a forked child: undo what ``_install`` did to this process (the threads did not
        come along)."""
        self._closed.set()
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._previous
                              if self._previous is not None else signal.SIG_DFL)
            current = signal.set_wakeup_fd(-1)
            if current != self._wake_w:  # another's (set since ours): it stays
                signal.set_wakeup_fd(current)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    @contextlib.contextmanager
    def handler_after(self) -> Iterator[None]:
        """While the main thread runs the block (a resume: it loads the step the flush is to
        write, and the flush waits for it), a SIGTERM starts the flush at once but its handler
        returns at once too: what the handler does (wait for the flush, then what SIGTERM did
        before us) runs when the block ends, however it ends, or once the flush is over if
        the block is still running then (``_release_held``: the deadline passed)."""
        if threading.current_thread() is not threading.main_thread():
            yield  # SIGTERM's handler runs on the main thread only: nothing to hold back
            return
        self._holding = True
        try:
            yield
        finally:
            with self._hold_lock:
                self._holding = False
                held, self._held = self._held, None
            if held is not None:
                self._on_sigterm(*held)

    def _release_held(self, deadline: float) -> None:
        """Once the flush is over (or at ``deadline``), a SIGTERM still held by a block that
        has not ended is let go: the signal goes to the main thread again, whose handler now
        runs at once (a user's handler waits no longer than the flush may)."""
        self.wait(deadline)
        with self._hold_lock:
            if self._held is None:
                return  # the block ended and ran the handler
            self._holding, self._held = False, None
        with self._lock:  # the signal sent again is this one, not a new notice
            self._sigterm_deadline = max(self._sigterm_deadline or 0.0,
                                         deadline_in(MAIN_THREAD_GRACE_S))
        log.warning("mlcheckpoint: the resume did not end before the preemption flush did: "
                    "SIGTERM's handling goes on without it")
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """On the main thread: the flush first (bounded by the deadline), then what SIGTERM
        did before us. A second SIGTERM (a scheduler's and torchrun's copy) whose handler
        Python runs inside this one's, between its bytecodes, returns at once: this one does
        what both ask, and running on could only deadlock on the locks the outer call holds
        (it was seen: ``notice`` starting the flush thread under ``_lock``)."""
        if self._handling:
            return
        self._handling = True
        try:
            self._handle_sigterm(signum, frame)
        finally:
            self._handling = False

    def _handle_sigterm(self, signum: int, frame: Any) -> None:
        if self._holding and not self._closed.is_set():
            first = self._held is None
            self._held = (signum, frame)
            deadline = self._sigterm()  # the flush starts now (if the notice thread did not)
            if first:
                threading.Thread(target=self._release_held, args=(deadline,), daemon=True,
                                 name="mlckpt-notice-held").start()
            return
        self._in_handler.set()
        if not self._closed.is_set():
            self.wait(self._sigterm())
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # SIG_DFL, or a handler not set from Python
            end_by_signal(signal.SIGTERM)

    def _sigterm(self) -> float:
        """A SIGTERM's notice, once: the notice thread and the handler both see the same
        signal, and a scheduler and torchrun may each send one; SIGTERMs within one deadline
        ask for one flush. Returns that flush's deadline."""
        with self._lock:
            if self._sigterm_deadline is not None and time.monotonic() < self._sigterm_deadline:
                return self._sigterm_deadline
            deadline = self._sigterm_deadline = deadline_in(self.deadline_s)
        self.notice("SIGTERM")
        return deadline

    def _watch(self) -> None:
        """Wake on the signal's byte (at once, whatever the main thread is doing) or the
        notice file's appearance."""
        seen_file = False
        fds = [self._wake_r] if self._installed else []
        while not self._closed.is_set():
            timeout = NOTICE_FILE_POLL_S if self.notice_file else None
            try:
                ready, _, _ = select.select(fds, [], [], timeout) if fds else ([], [], [])
                if not fds:
                    self._closed.wait(timeout)
            except (OSError, ValueError):  # closed under us
                return
            if self._closed.is_set():
                return
            if ready:
                try:
                    got = os.read(self._wake_r, 512)
                except OSError:
                    return
                self._forward(got)
                if signal.SIGTERM in got and not self._closed.is_set():
                    deadline = self._sigterm()
                    threading.Thread(target=self._end_if_main_is_stuck, args=(deadline,),
                                     daemon=True, name="mlckpt-notice-end").start()
            if self.notice_file:
                present = os.path.exists(self.notice_file)
                if present and not seen_file:
                    self.notice(f"file {self.notice_file}")
                seen_file = present

    def _forward(self, got: bytes) -> None:
        """Hand the signals' bytes to the wakeup fd ours replaced (e.g. an event loop's), unless
        it is an earlier manager's (one not closed): that one hears of SIGTERM through the
        handlers' chain, if at all, not a second time through its notice thread."""
        if self._old_wakeup_fd >= 0 and all(p._wake_w != self._old_wakeup_fd for p in list(_live)):
            with contextlib.suppress(OSError):
                os.write(self._old_wakeup_fd, got)

    def _end_if_main_is_stuck(self, deadline: float) -> None:
        """Once the flush is over (or at ``deadline``): if SIGTERM would have ended the process
        by default and the main thread has not come to our handler, end it as SIGTERM does."""
        self.wait(deadline)
        if self._previous != signal.SIG_DFL or self._closed.is_set():
            return
        if self._in_handler.wait(MAIN_THREAD_GRACE_S):
            return
        log.warning("mlcheckpoint: the main thread did not take SIGTERM (it is blocked, e.g. in "
                    "a collective): ending the process as SIGTERM does")
        end_by_signal(signal.SIGTERM)

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Stop the watcher and, where ours is still SIGTERM's handler, put back the previous
        one and the previous wakeup fd; a flush in flight goes on. A handler that stays ours
        (closed off the main thread, or another handler installed over it) only passes SIGTERM
        on, as before."""
        self._closed.set()
        restored = False
        if self._installed and threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, self._previous
                                  if self._previous is not None else signal.SIG_DFL)
                current = signal.set_wakeup_fd(-1)
                if current == self._wake_w:
                    signal.set_wakeup_fd(self._old_wakeup_fd)
                    restored = True
                else:  # another was set since: it stays
                    signal.set_wakeup_fd(current)
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"\0")  # wake the watcher
        if self._watcher is not None:
            self._watcher.join(timeout=2)
        if restored:  # nothing writes to the pipe any more
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake_r = self._wake_w = -1


def end_by_signal(signum: int) -> None:
    """End this process as ``signum``'s default action does, from any thread."""
    try:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signum, signal.SIG_DFL)
        else:  # Python sets handlers only on the main thread; the C library does not care
            libc = ctypes.CDLL(None, use_errno=True)
            libc.signal.restype = ctypes.c_void_p
            libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
            libc.signal(signum, None)  # None: SIG_DFL (0)
        os.kill(os.getpid(), signum)
        time.sleep(5)  # delivery is at once; this only keeps the caller from going on
    finally:
        os._exit(128 + signum)
