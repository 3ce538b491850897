"""The long-term fallback: ordinary DCP checkpoints in a directory or an fsspec URL.

Each step is a stock DCP checkpoint in ``<persistent_dir>/step-<step:012d>``; DCP writes its
``.metadata`` last, so a step counts only once that file exists. Any DCP user can load it
with plain ``dcp.load`` and FileSystemReader.
"""

from __future__ import annotations

import logging
import os
import re

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

log = logging.getLogger(__name__)
_STEP_RE = re.compile(r"^step-(\d{12})$")


def _is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


class PersistentStorage:
    """Lists, writes and reads DCP checkpoints under one directory or URL."""

    def __init__(self, location: str | os.PathLike):
        self.location = os.fspath(location)
        if self.location.startswith("file://"):
            self.location = self.location[len("file://"):]
        self.is_url = _is_url(self.location)

    def path(self, step: int) -> str:
        return f"{self.location.rstrip('/')}/step-{step:012d}"

    def writer(self, step: int) -> StorageWriter:
        if self.is_url:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
            return FsspecWriter(self.path(step))
        return FileSystemWriter(self.path(step))

    def reader(self, step: int) -> StorageReader:
        if self.is_url:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
            return FsspecReader(self.path(step))
        return FileSystemReader(self.path(step))

    def steps(self) -> list[int]:
        """Complete persistent steps (those with DCP's .metadata), oldest first."""
        try:
            if self.is_url:
                import fsspec
                fs, root = fsspec.core.url_to_fs(self.location)
                names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
                exists = lambda step: fs.exists(f"{root.rstrip('/')}/step-{step:012d}/.metadata")  # noqa: E731
            else:
                names = os.listdir(self.location)
                exists = lambda step: os.path.exists(os.path.join(self.path(step), ".metadata"))  # noqa: E731
        except FileNotFoundError:
            return []
        steps = [int(m.group(1)) for m in map(_STEP_RE.match, names) if m]
        return sorted(s for s in steps if exists(s))

    def size_bytes(self, step: int) -> int | None:
        if self.is_url:
            return None
        total = 0
        for root, _, files in os.walk(self.path(step)):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        return total
