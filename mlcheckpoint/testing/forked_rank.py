"""A rank torchrun forked (``launch="fork"``): ``forked_rank.py SCRIPT ARGS...`` runs SCRIPT as a
rank that ``python SCRIPT ARGS...`` would have been, from the agent's imports.

torchrun's forked ranks inherit what a fresh interpreter would not have: the agent's signal
handlers (SIGTERM, SIGINT, SIGHUP and SIGQUIT raise torch's ``SignalException``) and a parent-death
signal (SIGINT when the agent dies), the agent's session and its logging setup, and torchrun
waits for its return value where it would wait for an exec'd rank's exit. A test means what an
exec'd rank does, so these are undone here (torchrun starts an exec'd rank in a session of its
own), ``sys.argv`` and ``sys.path[0]`` are the script's, and ``os._exit`` works
(``_exit_rank``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import runpy
import signal
import sys
import traceback

from mlcheckpoint.testing.forkserver import exit_code

_PR_SET_PDEATHSIG = 1


def _exit_rank(code: int) -> None:
    """``os._exit`` in a forked rank: leave at once, as in an exec'd one, once torchrun has
    what it waits for. A forked rank hands torchrun its return value when its function returns
    (torch's ``_wrap``: ``ret_val_.put(ret)``, then ``queue_finished_reading_event.wait()``),
    and its agent waits for that value, not for the exit: a rank leaving through ``os._exit(0)``
    would hang it. So a clean exit hands over None first, from ``_wrap``'s own frame; a failed
    one needs nothing (torchrun sees the exit code). A process the rank forks in turn (a data
    loader's worker) ends as usual."""
    if os.getpid() != _rank_pid[0] or code != 0:
        _real_exit(code)
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "_wrap"
                                     and "queue_finished_reading_event" in frame.f_locals):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:  # another torch: say so rather than hang the agent
        print(f"forked_rank: {sys.argv[0]} called os._exit(0) where torchrun's _wrap is not "
              "on the stack; launch it with launch='exec'", file=sys.stderr, flush=True)
        _real_exit(70)
    frame.f_locals["ret_val_"].put(None)
    frame.f_locals["queue_finished_reading_event"].wait()
    _real_exit(0)


_real_exit = os._exit
_rank_pid = [0]


def run(script: str, *args: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
    os.setsid()
    for handler in logging.root.handlers[:]:  # a script's logging.basicConfig must take effect
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    _rank_pid[0] = os.getpid()
    os._exit = _exit_rank  # type: ignore[assignment]
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    agent = os.getppid()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        _end_if_orphaned(agent, exit_code(e))
        raise
    except BaseException:
        traceback.print_exc()  # as an exec'd rank's interpreter would; torchrun's wrapper does not
        _end_if_orphaned(agent, 1)
        raise
    else:
        _end_if_orphaned(agent, 0)
    finally:
        os._exit = _real_exit  # how multiprocessing ends the rank once torchrun has its result


def _end_if_orphaned(agent: int, code: int) -> None:
    # A rank whose agent was killed would wait for it forever to take its return value; an
    # exec'd one would just end.
    if os.getppid() != agent:
        sys.stdout.flush()
        sys.stderr.flush()
        _real_exit(code)


if __name__ == "__main__":
    run(*sys.argv[1:])
