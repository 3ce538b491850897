"""The long-term fallback: ordinary DCP checkpoints in a directory or an fsspec URL.

Each step is a stock DCP checkpoint in ``<persistent_dir>/step-<step:012d>``; DCP writes its
``.metadata`` last, so a step counts only once that file exists. Any DCP user can load it
with plain ``dcp.load`` and FileSystemReader.

A framework that keeps its own folder names its steps its own way: ``step_format`` says how
(torchtitan: ``"step-{step}"``), so recovery weighs that folder's newest step against memory
and loads one of them, once. A folder whose checkpoints only the framework can read (e.g.
Lightning's, with its ``meta.pt``) subclasses ``PersistentStorage`` and overrides
``complete_steps``, ``path`` and ``restore`` (and, to take the preemption flush, ``flushable``,
``flush_path`` and ``flush_files``).

Retention (``keep_persistent``): ``prune`` removes the oldest complete steps beyond the newest
``keep``; ``to_prune`` is the plan, which never names the newest complete step, a step being
written, or a step without DCP's ``.metadata`` (a resume may still need the first two, and the
last may be a write in flight).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from .errors import ConfigError

log = logging.getLogger(__name__)
DEFAULT_STEP_FORMAT = "step-{step:012d}"
MAX_ORIGIN_BYTES = 64 << 10  # a larger record is not ours: it fails to parse
# Beside DCP's files in a step folder we wrote: the run that wrote it (``PersistentOrigin``).
ORIGIN_FILE = ".mlcheckpoint-origin.json"


@dataclass(frozen=True)
class PersistentOrigin:
    """Which run of the job wrote a persistent step, and when by that run's own clock.

    Recovery weighs a persistent step against memory by this record where it exists: whether
    the step belongs to the history the memory steps descend from, and if not, which history
    is the later one, compared on the job's clocks rather than a file server's. A step written
    by a framework (or before this record existed) has none; recovery then falls back to the
    folder's modification time.
    """

    run_id: str
    ancestors: tuple[tuple[str, int], ...]
    created: float  # when the write finished, by the clock of the rank that wrote this record

    def to_json(self) -> str:
        return json.dumps({"run_id": self.run_id, "ancestors": [list(a) for a in self.ancestors],
                           "created": self.created})

    @classmethod
    def from_json(cls, raw: str | bytes) -> PersistentOrigin:
        """Parse a record (a file anyone with access may have written): ValueError if malformed."""
        try:
            d = json.loads(raw)
            origin = cls(str(d["run_id"]), tuple((str(r), int(s)) for r, s in d["ancestors"]),
                         float(d["created"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed {ORIGIN_FILE}: {e}") from None
        if len(origin.run_id) > 64 or not origin.run_id.isascii():
            raise ValueError(f"malformed {ORIGIN_FILE}: run id {origin.run_id!r}")
        return origin


def _is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


class StepNames:
    """Folder names of steps, from a format such as ``"step-{step:012d}"`` or ``"step-{step}"``.

    A name counts only if formatting its number gives it back, so ``step-7`` is not a step of
    ``"step-{step:012d}"`` and ``step-0007`` not one of ``"step-{step}"``.
    """

    def __init__(self, step_format: str = DEFAULT_STEP_FORMAT):
        m = re.fullmatch(r"([^{}]*)\{step(?::[^{}]*)?\}([^{}]*)", step_format)
        if m is None or "/" in step_format:
            raise ConfigError(f"step_format={step_format!r}: give one folder name with a single "
                              "{step} field, e.g. 'step-{step}' or 'step-{step:012d}'")
        self.format = step_format
        self._pattern = re.compile(re.escape(m[1]) + r"(\d+)" + re.escape(m[2]))

    def name(self, step: int) -> str:
        return self.format.format(step=step)

    def parse(self, name: str) -> int | None:
        m = self._pattern.fullmatch(name)
        if m is None or self.name(int(m[1])) != name:
            return None
        return int(m[1])


class PersistentStorage:
    """Lists, writes and reads DCP checkpoints under one directory or URL."""

    def __init__(self, location: str | os.PathLike, *, step_format: str = DEFAULT_STEP_FORMAT):
        self.location = os.fspath(location)
        self.location = self.location.removeprefix("file://")
        self.is_url = _is_url(self.location)
        self.names = StepNames(step_format)

    def path(self, step: int) -> str:
        return f"{self.location.rstrip('/')}/{self.names.name(step)}"

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

    def restore(self, state_dict: dict[str, Any], step: int,
                load: Callable[[dict[str, Any], StorageReader], None]) -> None:
        """Load ``step`` into ``state_dict``; recovery calls this once it chose this folder.
        ``load`` is ``dcp.load`` on the checkpoint group (recovery/resume.py ``load_step``)."""
        load(state_dict, self.reader(step))

    def flush_refused(self) -> str | None:
        """Why a preemption flush (``manager/flush.py``) cannot write steps here, or None: it
        writes a plain DCP checkpoint into ``flush_path(step)`` on a file system, which only a
        folder that then counts and loads it takes (``flushable``)."""
        if self.is_url:
            return f"the persistent folder {self.location} is an fsspec URL"
        if not self.flushable:
            return f"{type(self).__name__} keeps a framework's own folder layout"
        return None

    @property
    def flushable(self) -> bool:
        """Whether a flushed step (a plain DCP checkpoint of the state dict memory holds, at
        ``flush_path``, completed by ``flush_files`` and then DCP's ``.metadata``) is
        one this folder counts and loads: so for plain DCP folders. A subclass with its own
        layout (its own ``complete_steps``, ``steps``, ``path`` or ``restore``) says so itself,
        overriding this."""
        ours = PersistentStorage
        return all(getattr(type(self), name) is getattr(ours, name)
                   for name in ("complete_steps", "steps", "path", "restore"))

    def flush_path(self, step: int) -> str:
        """The folder a preemption flush writes ``step`` into."""
        return self.path(step)

    def flush_files(self, read_item: Callable[[str], bytes]) -> dict[str, bytes]:
        """The files the layout needs in a flushed step's folder besides DCP's, by name: the
        flush's finisher writes them just before DCP's ``.metadata`` (which makes the step
        complete). ``read_item(fqn)``: the bytes DCP wrote for a non-tensor item of the step.
        None for a plain DCP folder."""
        return {}

    def record_origin(self, step: int, origin: PersistentOrigin, folder: str | None = None) -> None:
        """Write ``origin`` into ``step``'s folder (``folder``: the one a flush is finishing,
        which ``path`` may not name yet)."""
        self._write_text(f"{folder or self.path(step)}/{ORIGIN_FILE}", origin.to_json())

    def origin(self, step: int) -> PersistentOrigin | None:
        """The recorded origin of ``step``; None where there is none or it cannot be read (a
        damaged record counts as none: recovery then uses the folder's time)."""
        try:
            return PersistentOrigin.from_json(self._read_text(f"{self.path(step)}/{ORIGIN_FILE}"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("mlcheckpoint: ignoring the origin record of persistent step %d: %s", step, e)
            return None

    def _write_text(self, path: str, text: str) -> None:
        if self.is_url:
            import fsspec
            with fsspec.open(path, "w") as f:
                f.write(text)
            return
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    def _read_text(self, path: str) -> str:
        if self.is_url:
            import fsspec
            with fsspec.open(path, "r") as f:
                return f.read(MAX_ORIGIN_BYTES)
        with open(path) as f:
            return f.read(MAX_ORIGIN_BYTES)

    def steps(self) -> list[int]:
        """The steps a resume may load from here, oldest first: the complete ones."""
        return self.complete_steps()

    def complete_steps(self) -> list[int]:
        """Complete persistent steps (those with DCP's .metadata), oldest first."""
        try:
            if self.is_url:
                import fsspec
                fs, root = fsspec.core.url_to_fs(self.location)
                names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
                exists = lambda step: fs.exists(f"{root.rstrip('/')}/{self.names.name(step)}/.metadata")
            else:
                names = os.listdir(self.location)
                exists = lambda step: os.path.exists(os.path.join(self.path(step), ".metadata"))
        except FileNotFoundError:
            return []
        steps = [s for s in map(self.names.parse, names) if s is not None]
        return sorted(s for s in steps if exists(s))

    def remove(self, step: int) -> None:
        """Delete ``step``'s checkpoint folder."""
        if self.is_url:
            import fsspec
            fs, path = fsspec.core.url_to_fs(self.path(step))
            fs.rm(path, recursive=True)
        else:
            shutil.rmtree(self.path(step))

    def prune(self, keep: int, spare: Iterable[int] = ()) -> list[int]:
        """Remove the complete steps ``to_prune`` names (``spare``: steps being written);
        return them. A step that cannot be removed is logged and left."""
        removed = []
        for step in to_prune(self.complete_steps(), keep, spare):
            try:
                self.remove(step)
            except OSError as e:
                log.warning("mlcheckpoint: could not remove persistent step %d (%s): %s",
                            step, self.path(step), e)
                continue
            removed.append(step)
        if removed:
            log.info("mlcheckpoint: removed persistent steps %s from %s (keep_persistent=%d)",
                     removed, self.location, keep)
        return removed

    def size_bytes(self, step: int) -> int | None:
        if self.is_url:
            return None
        total = 0
        for root, _, files in os.walk(self.path(step)):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        return total


def to_prune(complete: Iterable[int], keep: int, spare: Iterable[int] = ()) -> list[int]:
    """The complete steps retention removes, oldest first: all but the newest ``keep``
    (>= 1, so never the newest complete step) and but ``spare`` (steps being written)."""
    ordered = sorted(set(complete))
    kept = set(ordered[-keep:]) | set(spare)
    return [s for s in ordered if s not in kept]


def open_persistent(persistent: str | os.PathLike | PersistentStorage | None) -> PersistentStorage | None:
    """``CheckpointManager(persistent_dir=...)`` takes a folder, a URL, or a PersistentStorage
    that speaks a framework's layout."""
    if persistent is None or isinstance(persistent, PersistentStorage):
        return persistent
    return PersistentStorage(persistent) if os.fspath(persistent) else None
