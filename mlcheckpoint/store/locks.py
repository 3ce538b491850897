"""File locks shared by the processes of one node."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


@contextlib.contextmanager
def flocked(path: str, *, shared: bool = False) -> Iterator[None]:
    """Hold an exclusive (or ``shared``) flock on ``path`` (created if need be) for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class NodeLock:
    """The job-wide lock for step-level bookkeeping shared by the ranks of a node (capacity
    checks and reservations, step folders). A path only: picklable, opened per use."""

    def __init__(self, path: str):
        self.path = path

    def held(self) -> contextlib.AbstractContextManager[None]:
        return flocked(self.path)


class CommitLock:
    """Orders what can make a step whole on a node against retention passes: commits (a
    shard's manifest, a step's metadata) share it, any number at once, for the renames only; a
    retention pass holds it alone from its plan to the last file it retires. So no step
    becomes whole between a pass's look and its retirements, and the newest whole step the
    pass guards is the newest there is (the whole-step invariant). A path only: picklable."""

    def __init__(self, path: str):
        self.path = path

    def committing(self) -> contextlib.AbstractContextManager[None]:
        return flocked(self.path, shared=True)

    def retiring(self) -> contextlib.AbstractContextManager[None]:
        return flocked(self.path)
