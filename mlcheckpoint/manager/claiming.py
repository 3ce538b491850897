"""One live run per job directory: the claim each rank takes when its manager is built, and
the verdict every rank reaches together.

Each rank joins its run's claim on its node's job directory (``store/claim.py``: a shared
flock and a record naming the run). A node where another run is live, or where the memory
was saved by a run with another persistent folder, refuses; one all_gather then tells every
rank of the job, so all of them raise the same error within the constructor, not only the
ranks of the node that saw it, and a rank that did get in withdraws. Nothing else in the
directory has been changed by then: the manager claims before it builds anything that reads,
writes or retires a file there.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from .._messages import plural
from ..errors import ConfigError, JobDirInUseError
from ..persistent import PersistentStorage
from ..settings import BY_NAME, Launcher
from ..store.claim import Claimant, JobClaim, Refusal
from ..store.layout import JobPaths

log = logging.getLogger(__name__)

_SEPARATE = ("give this job its own job id (job_id= or MLCHECKPOINT_JOB_ID; torchrun's "
             "--rdzv-id) or its own local_dir (local_dir= or MLCHECKPOINT_LOCAL_DIR)")


def persistent_location(persistent: PersistentStorage | None) -> str | None:
    """The persistent folder as a claim records it: a URL as given, a path made absolute."""
    if persistent is None:
        return None
    return persistent.location if persistent.is_url else os.path.abspath(persistent.location)


def claimant(run_id: str, persistent: PersistentStorage | None, launcher: Launcher) -> Claimant:
    """This process, as a rank of run ``run_id``; torchrun's run id and restart count where
    torchrun launched it."""
    torchrun = BY_NAME["TORCHELASTIC_RUN_ID"].resolve()
    return Claimant(run_id, socket.gethostname(), (os.getpid(),), time.time(),
                    persistent_location(persistent), launcher_run_id=torchrun,
                    restart_count=launcher.restart_count if torchrun else None)


def claim_job_dir(paths: JobPaths, me: Claimant, node: int,
                  all_gather: Callable[[Any], list[Any]]) -> JobClaim:
    """Take this rank's share of its run's claim on ``paths``; collective. Raises on every
    rank when any node refused: ``JobDirInUseError`` (another live run) or ``ConfigError``
    (the memory's run had another persistent folder; ``$MLCHECKPOINT_PERSISTENT_DIR_MOVED``
    accepts it)."""
    accept_moved = bool(BY_NAME["persistent_dir_moved"].resolve())
    taken: JobClaim | Refusal | None = None
    try:
        taken = JobClaim.take(paths, me, accept_moved=accept_moved)
        mine = refusal_text(taken, me, node) if isinstance(taken, Refusal) else None
    except OSError as e:  # said in the gather below: no other rank waits out a timeout for it
        mine = ("error", f"could not claim job directory {paths.job_dir} on node {node}: {e}")
    verdicts = all_gather(mine)
    refused = [(rank, v) for rank, v in enumerate(verdicts) if v is not None]
    if not refused:
        assert isinstance(taken, JobClaim)
        if taken.moved_from is not None:
            log.warning("mlcheckpoint: %s on node %d holds steps of %s, whose persistent_dir was "
                        "%s; this run's is %s: resuming them (MLCHECKPOINT_PERSISTENT_DIR_MOVED=1)",
                        paths.job_dir, node, taken.moved_from.describe(persistent=False),
                        taken.moved_from.persistent_dir or "none", me.persistent_dir or "none")
        return taken
    if isinstance(taken, JobClaim):
        taken.withdraw()
    rank, (reason, text) = refused[0]
    others = len(refused) - 1
    also = f" (rank {rank}; {plural(others, 'other rank')} too)" if others else f" (rank {rank})"
    error = JobDirInUseError if reason == "live" else ConfigError
    raise error(f"mlcheckpoint: {text}{also}")


def refusal_text(refusal: Refusal, me: Claimant, node: int) -> tuple[str, str]:
    """(reason, what the refused rank says): the other run, and the setting to change."""
    where = f"job directory {refusal.job_dir} on node {node}"
    held = refusal.holder
    if refusal.reason == "live":
        who = held.describe() if held is not None else "a run whose record cannot be read"
        return "live", (f"{where} is in use by another live run: {who}. Two runs in one "
                        f"directory would resume and overwrite each other's steps: {_SEPARATE}; "
                        "if that run is an earlier run of this job that is still going, stop it "
                        "first")
    assert held is not None
    return "moved", (f"{where} holds {_steps(refusal.steps)} saved by a run whose persistent_dir "
                     f"was {held.persistent_dir or 'none'} ({held.describe(persistent=False)}), "
                     f"and this run's persistent_dir is {me.persistent_dir or 'none'}. If this "
                     f"is another job, {_SEPARATE}, so it does not resume that job's steps; if "
                     "it is this job and its persistent folder moved, set "
                     "MLCHECKPOINT_PERSISTENT_DIR_MOVED=1 for this launch to resume from memory")


def _steps(steps: tuple[int, ...]) -> str:
    if len(steps) == 1:
        return f"step {steps[0]}"
    if len(steps) <= 4:
        return "steps " + ", ".join(map(str, steps))
    return f"{len(steps)} steps ({steps[0]} to {steps[-1]})"
