"""File locks shared by the processes of one node."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


@contextlib.contextmanager
def flocked(path: str) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if need be) for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
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
