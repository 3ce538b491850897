"""Fault points for tests: SIGKILL this process, or hold it, at a named stage.

Crash: set MLCHECKPOINT_CRASH_AT="<point>" or "<point>@<step>" (optionally "...#<rank>") in a
test's environment; the process logs ``CRASH_MESSAGE`` and SIGKILLs itself. Points:
before_data, mid_data, before_manifest, mid_commit, before_metadata, replica_mid_recv, replica_mid_send (a push, once one of its streams has sent
half its bytes), serve_mid_read (a TCP holder serving a shard's bytes to a read or a fetch,
once it has answered "ok" and before the bytes; the step and rank named are the shard's).

Pause: MLCHECKPOINT_PAUSE_AT="<point>[@<step>][#<rank>]=<path>" holds the calling thread at
the point until the file <path> exists (and creates <path>.reached when it gets there, so the
test knows), so a test makes two ranks meet in the one order that
exposes a race, every run. Points: resume_load (a resume, before it loads the step it
chose), resume_agreed (right after resume's last collective),
retention_planned (a retention pass between its plan and carrying it out), persistent_write
(a background persistent write, before it starts), write_data (a shard's commit, once DCP
planned the save, before any item is placed), flush_part (a preemption flush, once this
rank's part of a step is written and before its marker says so), heal_rebuild (a replaced
node's rank, before it brings its own shard of the loaded step back).

Unset, each check costs one dict lookup. These two variables are read at each check, not
resolved once like the other settings (mlcheckpoint/settings.py): they are test hooks, and a
test's worker sets them in its own environment between steps (tests/workers/chaos_job.py).
"""

from __future__ import annotations

import logging
import os
import signal

from .settings import variable_text
from .waiting import deadline_in, wait_until

logger = logging.getLogger(__name__)
SIGKILLED_ITSELF = "this process SIGKILLs itself"  # how a process says so (testing.cluster too)
CRASH_MESSAGE = ("mlcheckpoint: crash point %s reached (MLCHECKPOINT_CRASH_AT): "
                 + SIGKILLED_ITSELF)
_ENV = "MLCHECKPOINT_CRASH_AT"
_PAUSE_ENV = "MLCHECKPOINT_PAUSE_AT"
PAUSE_LIMIT_S = 120.0  # a pause whose file never comes fails the run instead of hiding the race


def _matches(where: str, name: str, step: int | None, rank: int | None) -> bool:
    """Whether ``where`` ("<point>[@<step>][#<rank>]") names this point, step and rank."""
    head, _, want_rank = where.partition("#")
    point, _, want_step = head.partition("@")
    if point != name:
        return False
    if want_step and step is not None and int(want_step) != step:
        return False
    return not (want_rank and rank is not None and int(want_rank) != rank)


def crash_point(name: str, step: int | None = None, rank: int | None = None) -> None:
    spec = variable_text(_ENV)
    if spec and _matches(spec, name, step, rank):
        # Said first: a launcher that reports another rank's failure first leaves no trace of
        # this one's SIGKILL in the job's log (torchrun's forked ranks).
        logger.warning(CRASH_MESSAGE, name)
        os.kill(os.getpid(), signal.SIGKILL)


def pause_point(name: str, step: int | None = None, rank: int | None = None) -> None:
    spec = variable_text(_PAUSE_ENV)
    if not spec:
        return
    where, _, path = spec.partition("=")
    if not _matches(where, name, step, rank):
        return
    deadline = deadline_in(PAUSE_LIMIT_S)
    with open(f"{path}.reached", "a"):
        pass
    if not wait_until(lambda: os.path.exists(path), deadline, poll=0.01):
        raise TimeoutError(f"{_PAUSE_ENV}: {path} did not appear within {PAUSE_LIMIT_S:.0f} s")
