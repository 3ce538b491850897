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
    """All events of a job on this node, oldest first (unparseable lines skipped)."""
    try:
        with open(os.path.join(job_dir, FILENAME)) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events
