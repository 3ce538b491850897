"""One live run per job directory on a node: the claim, and the record that names its holder.

Two runs that open one ``<local_dir>/<job_id>`` at once (two jobs launched with the same job id)
would resume each other's steps and then write the same step numbers into one directory. So a
run claims the directory when its manager is built, and a second live run is refused:

- ``.claim.lock``: every rank of the run on this node holds a *shared* flock on it for its
  manager's lifetime. The kernel drops a flock with the last descriptor of its process, so a
  run that is SIGKILLed (or that torchrun restarts: the old workers are gone before the new
  ones start) never blocks its own restart. An exclusive try that fails means a run is live.
- ``claim.json``: who holds it (or held it last): the run id the ranks of one run agreed, the
  host, the pids of its ranks here, when it started, its persistent folder, the launcher's
  run id and restart count. Ranks of the run that holds the lock recognise it by the run id
  and join it; any other run is refused and told who holds the directory. Rewritten in place
  under an exclusive flock on itself, which also makes each rank's look-and-join one step.

A forked child (a data-loader worker) would inherit the descriptor and keep the claim alive
after its parent died; the child closes its copy at fork (``os.register_at_fork``), which
leaves the parent's lock held. Nothing here runs per save: the claim is taken once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal

from .layout import JobPaths

log = logging.getLogger(__name__)

_held: set[int] = set()  # descriptors of the claims this process holds


def _close_in_child() -> None:
    # Closing the child's copy leaves the flock with the parent's descriptor (same open file).
    for fd in _held:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _drop(fd: int, pid: int) -> None:
    if os.getpid() != pid:  # a forked child: its copy was closed at fork
        return
    _held.discard(fd)
    os.close(fd)


@dataclass(frozen=True)
class Claimant:
    """A run of the job as one node sees it: the holder a claim's record names.

    ``run_id``: the id the run's ranks agreed (``store.identity.Lineage.run_id``), which tells
    the ranks of one run from another run. ``persistent_dir``: the run's persistent folder
    (an absolute path or a URL; None without one). ``launcher_run_id`` and ``restart_count``:
    torchrun's ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT``, where set.
    """

    run_id: str
    host: str
    pids: tuple[int, ...]
    started: float  # time.time() when the run's first rank on this node claimed the directory
    persistent_dir: str | None
    launcher_run_id: str | None = None
    restart_count: str | None = None

    def describe(self, *, persistent: bool = True, now: float | None = None) -> str:
        """One line a person reads: "run 3f.. on host h (pids 10, 11), started ... ago,
        persistent_dir ..." (that last part only with ``persistent``)."""
        now = time.time() if now is None else now
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        age = max(0.0, now - self.started)
        ago = f"{age:.0f} s" if age < 120 else f"{age / 60:.0f} min" if age < 7200 else f"{age / 3600:.1f} h"
        pids = ", ".join(map(str, self.pids))
        text = (f"run {self.run_id} on host {self.host} (pid{'s' if len(self.pids) > 1 else ''} "
                f"{pids}), started {when} ({ago} ago)")
        if persistent:
            text += f", persistent_dir {self.persistent_dir or 'none'}"
        if not self.launcher_run_id:
            return text
        # torchrun's run id, unless it is the "none" of a launch without --rdzv-id.
        named = "" if self.launcher_run_id == "none" else f" run id {self.launcher_run_id},"
        return f"{text} (torchrun{named} restart {self.restart_count or 0})"

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "pids": list(self.pids)}

    @classmethod
    def from_json(cls, obj: Any) -> Claimant | None:
        """The claimant a record holds; None for anything else (a torn or foreign file)."""
        try:
            pids = tuple(int(p) for p in obj["pids"])
            persistent = obj.get("persistent_dir")
            opt = {k: None if obj.get(k) is None else str(obj[k])
                   for k in ("launcher_run_id", "restart_count")}
            return cls(str(obj["run_id"]), str(obj["host"]), pids, float(obj["started"]),
                       None if persistent is None else str(persistent), **opt)
        except (TypeError, KeyError, ValueError, AttributeError):
            return None


@dataclass(frozen=True)
class Refusal:
    """Why a run may not take the directory. ``live``: another live run holds it (``holder``;
    None when its record cannot be read). ``moved``: no run is live, but the steps here were
    saved by a run whose persistent folder was another one (``holder`` names it)."""

    reason: Literal["live", "moved"]
    job_dir: str
    holder: Claimant | None
    steps: tuple[int, ...] = ()


class _Record:
    """``claim.json`` open and flocked exclusively: read it, rewrite it in place."""

    def __init__(self, f: IO[str]):
        self._f = f

    def read(self) -> tuple[Claimant | None, Claimant | None]:
        """(the claimant it names, the one it replaced); None where absent or unreadable."""
        self._f.seek(0)
        try:
            text = self._f.read()  # (bytes that are no UTF-8 raise UnicodeDecodeError, a ValueError)
            obj = json.loads(text) if text.strip() else None
        except ValueError:
            return None, None
        if not isinstance(obj, dict):
            return None, None
        return Claimant.from_json(obj), Claimant.from_json(obj.get("previous"))

    def write(self, claimant: Claimant | None, previous: Claimant | None) -> None:
        self._f.seek(0)
        self._f.truncate()
        if claimant is not None:
            obj = claimant.to_json()
            obj["previous"] = None if previous is None else previous.to_json()
            self._f.write(json.dumps(obj, sort_keys=True) + "\n")
        self._f.flush()


@contextlib.contextmanager
def _record(paths: JobPaths, *, read_only: bool = False) -> Iterator[_Record]:
    """``claim.json``, flocked exclusively for the block: the node's mutex for claims."""
    flags = os.O_RDONLY if read_only else os.O_RDWR | os.O_CREAT
    fd = os.open(paths.claim, flags, 0o600)
    with os.fdopen(fd, "r" if read_only else "r+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield _Record(f)


def _try_exclusive(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


class JobClaim:
    """This process's share of a run's claim on a job directory: a shared flock on
    ``.claim.lock``, held from ``take`` until ``release`` or the process's end."""

    def __init__(self, paths: JobPaths, fd: int, claimant: Claimant, moved_from: Claimant | None = None):
        self.paths = paths
        self.claimant = claimant  # as recorded when this process joined
        # The run whose steps are here, where its persistent folder was another one (accepted).
        self.moved_from = moved_from
        _held.add(fd)
        # Also dropped when this object is collected (a manager whose constructor failed later).
        self._drop = weakref.finalize(self, _drop, fd, os.getpid())

    @classmethod
    def take(cls, paths: JobPaths, me: Claimant, *, accept_moved: bool = False) -> JobClaim | Refusal:
        """Claim the directory for run ``me.run_id``, or join the claim of that run; else say
        why not. ``me.pids``: this process (a rank joining adds its pid to the record).

        Refused when another run is live here, or, unless ``accept_moved``, when no run is
        live, steps are here and the run recorded last had another ``persistent_dir`` (two
        jobs under one job id, or one job whose persistent folder moved). A refused take
        changes nothing in the directory.
        """
        fd = os.open(paths.claim_lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with _record(paths) as record:  # one look-and-join at a time on this node
                holder, previous = record.read()
                if not _try_exclusive(fd):  # a run is live: is it ours?
                    if holder is None or holder.run_id != me.run_id:
                        os.close(fd)
                        return Refusal("live", paths.job_dir, holder)
                    fcntl.flock(fd, fcntl.LOCK_SH)  # only shared holders: never waits long
                    joined = dataclasses.replace(holder, pids=(*holder.pids, *me.pids))
                    record.write(joined, previous)
                    return cls(paths, fd, joined)
                steps = tuple(paths.step_numbers())
                moved = holder is not None and bool(steps) and holder.persistent_dir != me.persistent_dir
                if moved and not accept_moved:
                    os.close(fd)
                    return Refusal("moved", paths.job_dir, holder, steps)
                # Nobody holds it and the mutex keeps others out: share the lock from here on.
                fcntl.flock(fd, fcntl.LOCK_SH)
                record.write(me, holder)
                with contextlib.suppress(FileNotFoundError):  # a run holds it: not finished
                    os.unlink(paths.finished)
                return cls(paths, fd, me, moved_from=holder if moved else None)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise

    @property
    def held(self) -> bool:
        return self._drop.alive

    def release(self) -> None:
        """Drop this process's share (the record stays: it names the run that held the
        directory last, for the next run's checks and for ``mlcheckpoint ls``). Idempotent."""
        self._drop()

    def withdraw(self) -> None:
        """Release a claim the run must not keep (it was refused on another node): once no
        rank of it holds the directory any more, the record names the run before it again, so
        the next run is checked against the run whose steps these are."""
        if not self.held:
            return
        with _record(self.paths) as record:
            self.release()
            holder, previous = record.read()
            if holder is None or holder.run_id != self.claimant.run_id:
                return
            probe = os.open(self.paths.claim_lock, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if _try_exclusive(probe):  # this was the run's last rank here
                    record.write(previous, None)
            finally:
                os.close(probe)


@contextlib.contextmanager
def _looked(paths: JobPaths) -> Iterator[tuple[Claimant | None, bool]]:
    """(the run the record names, whether a run holds the directory now): the one look at
    the lock that tells a live run, made under the node's claim mutex, so no run's take sees
    the look as a holder. When no run is live, the block runs with the lock held
    exclusively: no run can take the directory until it ends. Creates nothing."""
    with contextlib.ExitStack() as stack:
        try:
            record = stack.enter_context(_record(paths, read_only=True))
        except FileNotFoundError:  # no record: never claimed
            yield None, False
            return
        claimant, _ = record.read()
        try:
            probe = os.open(paths.claim_lock, os.O_RDONLY)
        except FileNotFoundError:
            yield claimant, False
            return
        stack.callback(os.close, probe)
        yield claimant, not _try_exclusive(probe)


def mark_finished(paths: JobPaths, run_id: str, step: int | None) -> None:
    """Note that run ``run_id`` closed cleanly (``CheckpointManager.close`` without an error)
    with ``step`` its newest here: until a run claims the directory again (``JobClaim.take``
    removes the note), this job's memory is a finished job's, the first that may be reclaimed
    (``docs/operations.md``, "A finished job's memory"), and another job's resume does not name
    it among the jobs it might have meant."""
    tmp = f"{paths.finished}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"run_id": run_id, "step": step, "time": time.time()}, f)
    os.replace(tmp, paths.finished)


def finished(paths: JobPaths) -> dict[str, Any] | None:
    """What ``mark_finished`` noted (run_id, step, time), or None: not finished, or a run holds
    the directory now."""
    try:
        with open(paths.finished) as f:
            note = json.load(f)
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None


def holder(paths: JobPaths) -> tuple[Claimant | None, bool]:
    """(the run the record names, whether it is live now), for listings; creates nothing."""
    with _looked(paths) as (claimant, live):
        return claimant, live


@contextlib.contextmanager
def unclaimed(paths: JobPaths) -> Iterator[Refusal | None]:
    """For a command that deletes files of the job directory (``mlcheckpoint gc``): yields
    the refusal naming the live run that holds the directory, or None, and then no run can
    take the directory until the block ends (the same look as ``holder``)."""
    with _looked(paths) as (claimant, live):
        yield Refusal("live", paths.job_dir, claimant) if live else None
