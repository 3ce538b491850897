"""A rank torchrun forked (``launch="fork"``): ``forked_rank.py SCRIPT ARGS...`` runs SCRIPT as a
rank that ``python SCRIPT ARGS...`` would have been, from the agent's imports.

torchrun's forked ranks inherit what a fresh interpreter would not have: the agent's signal
handlers (SIGTERM, SIGINT, SIGHUP and SIGQUIT raise torch's ``SignalException``) and a parent-death
signal (SIGINT when the agent dies), the agent's session and its logging setup. A test means
what an exec'd rank does, so these are undone here (torchrun starts an exec'd rank in a session
of its own), and ``sys.argv`` and ``sys.path[0]`` are the script's.
"""

from __future__ import annotations

import ctypes
import logging
import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _refuse_exit(code: int) -> None:
    # torchrun waits for a forked rank's return value: a rank that leaves through os._exit
    # hangs its agent instead of ending it, so it fails here, saying why. (A process the rank
    # forks in turn, a data loader's worker, ends through os._exit as usual.)
    if os.getpid() != _rank_pid[0]:
        _real_exit(code)
    print(f"forked_rank: {sys.argv[0]} called os._exit({code}): torchrun cannot see a forked "
          "rank end that way; launch it with launch='exec'", file=sys.stderr, flush=True)
    _real_exit(70)


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
    os._exit = _refuse_exit  # type: ignore[assignment]
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        os._exit = _real_exit  # how multiprocessing ends the rank once torchrun has its result


if __name__ == "__main__":
    run(*sys.argv[1:])
