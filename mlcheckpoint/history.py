"""Checkpoint history: one JSON line per save, replication, persistent write and resume.

Kept beside the checkpoints in ``<local_dir>/<job_id>/history.jsonl`` (per node). Lines are
appended with O_APPEND and stay under PIPE_BUF, so ranks of a node can write concurrently.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from .store.layout import HISTORY

log = logging.getLogger(__name__)
FILENAME = HISTORY  # layout.py names every file of a job directory


def record(job_dir: str, event: str, **fields: Any) -> None:
    """Append one event; never raises (history must not break a save)."""
    nbytes, seconds = fields.get("bytes"), fields.get("seconds")
    if nbytes and seconds:
        fields["gbps"] = round(nbytes / seconds / 1e9, 3)
    line = json.dumps({"time": round(time.time(), 3), "event": event, **fields},
                      separators=(",", ":"), default=str)
    try:
        fd = os.open(os.path.join(job_dir, FILENAME), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (line[:4000] + "\n").encode())
        finally:
            os.close(fd)
    except OSError as e:
        log.debug("could not record history: %s", e)


def read(job_dir: str) -> list[dict]:
    """All events of a job on this node, oldest first. A line that is not an event as
    ``record`` writes it (damaged, cut, or written by something else) is skipped: the readers
    (``mlcheckpoint ls``, ``history``, ``retire``) then trust the fields they format."""
    try:
        with open(os.path.join(job_dir, FILENAME), errors="replace") as f:  # (a damaged line
            lines = f.readlines()  # then fails to parse, and is skipped)
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if _well_formed(event):
            events.append(event)
    return events


def _well_formed(event: object) -> bool:
    """An object with its time (a number) and its event's name, and numbers where the readers
    expect them."""
    def number(value: object, whole: bool = False) -> bool:
        return type(value) is int or (not whole and type(value) is float)

    return (isinstance(event, dict) and number(event.get("time")) and isinstance(event.get("event"), str)
            and all(event.get(k) is None or number(event[k], whole=k in ("step", "rank"))
                    for k in ("step", "rank", "bytes", "seconds")))
