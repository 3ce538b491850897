"""Running one transfer's streams side by side: the TCP transport's striped pushes, a read over
several calls (``transport.py``) and recovery's reads of several holders at once share it (no wire
format of its own)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_streams(work: Callable[[T], None], jobs: list[T]) -> list[BaseException]:
    """Run ``work(job)`` for every job, the first on the calling thread and each other one on a
    thread of its own. Returns, once all have finished (so none still writes anywhere), what
    they raised."""
    errors: list[BaseException] = []

    def run(job: T) -> None:
        try:
            work(job)
        except BaseException as e:  # noqa: BLE001 (handed to the caller, which re-raises)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(job,), daemon=True, name="mlckpt-tcp-stream")
               for job in jobs[1:]]
    for t in threads:
        t.start()
    if jobs:
        run(jobs[0])
    for t in threads:
        t.join()
    return errors


def split_evenly(pieces: list[T], size: Callable[[T], int], parts: int) -> list[list[T]]:
    """Deal ``pieces`` (in order) into ``parts`` contiguous runs of about equal total size."""
    groups: list[list[T]] = [[] for _ in range(parts)]
    share, done = max(sum(map(size, pieces)), 1) / parts, 0
    for piece in pieces:
        groups[min(parts - 1, int(done // share))].append(piece)
        done += size(piece)
    return groups
