"""The settings resolved into the objects the parts are handed.

- ``Options`` (with ``ReplicationOptions``): a CheckpointManager's settings, grouped by
  concern. What a user gives (keywords, or the objects themselves) is checked when the object
  is made; ``resolved`` then fills each field left None from its variable, else its default,
  when the manager is built, and the manager keeps the result as ``ckpt.options``;
- ``Tuning``: what tunes the whole process (copy threads, the native loop, the GC pause, the
  least stripe), which the process-wide parts it tunes ask for with ``tuning()``: read at each
  call, so a process may change it between saves; a test or benchmark installs one with
  ``tuned``;
- ``Timeouts``: how long the parts wait and how often they look, handed down by the manager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConfigError
from .declared import (
    BY_NAME,
    SETTINGS,
    check_environment,
    default,
    resolve_local_dir,
)
from .launcher import Launcher, resolve_job_id

_MANAGER = [s for s in SETTINGS if s.group == "manager"]
_REPLICATION = [s for s in SETTINGS if s.group == "replication"]
# The flat keywords of earlier releases (replication_streams=...), each a ReplicationOptions
# field now: accepted for one more release, with a DeprecationWarning naming the new spelling.
DEPRECATED_KEYWORDS: dict[str, str] = {s.name: s.attribute for s in _REPLICATION
                                       if s.name != "replication" and s.flat}


# ---------------------------------------------------------------- a manager's options

@dataclass(frozen=True)
class ReplicationOptions:
    """How this job's shards reach partner nodes: ``CheckpointManager(replication=
    ReplicationOptions(mode="tcp", streams=8))``; ``replication="none"`` is short for
    ``ReplicationOptions(mode="none")``.

    A field left None takes its environment variable, else its default, when the manager is
    built (docs/configuration.md, "ReplicationOptions"); a value given is checked here.

    Args:
        mode: "tcp", "pg" (gloo), "nccl" (GPU buffers over NCCL) or "none". Off by itself on
            a single node.
        host: address the TCP listener binds and advertises (default: that of ``interface``,
            else the one routing to MASTER_ADDR; ``$MLCHECKPOINT_REPLICATION_HOST``).
        interface: network interface (e.g. "eth1", "ib0") whose IPv4 address the TCP
            listener binds and advertises (``$MLCHECKPOINT_REPLICATION_IFNAME``; with
            ``host``, both must agree).
        timeout: seconds any single replication socket operation may block.
        streams: TCP connections one large shard is pushed over (``$MLCHECKPOINT_TCP_STREAMS``
            or 4; each stream carries at least 64 MiB).
        bandwidth: bytes per second replication may send in the background, for the whole
            node (its ranks share it): an int or a string such as "100MB/s" or "1Gbit"; 0 or
            "none" for no cap (``$MLCHECKPOINT_REPLICATION_BANDWIDTH`` or "auto": a share of
            the interface's speed, see docs/operations.md). A resume's own reads are never
            capped.
        replicas: partner nodes that keep a replica of each shard, 1-8
            (``$MLCHECKPOINT_REPLICAS`` or 1), in distinct failure domains where possible:
            losing any ``replicas`` nodes resumes from memory. Rank 0's value holds for the job.
        failure_domain: what fails together with this node: a rack, a switch, a power feed
            (``$MLCHECKPOINT_FAILURE_DOMAIN``, else the leaf switch SLURM's topology plugin
            names). Partners are then chosen in other domains (docs/operations.md).
        copies: "auto" (``$MLCHECKPOINT_DP_COPIES`` or the default): where data parallelism
            holds an item on several nodes, each keeps a copy of it and replication sends only
            the items that lack their places; "off": every shard is replicated whole.
    """

    mode: Literal["tcp", "pg", "nccl", "none"] = default("replication")
    host: str | None = None
    interface: str | None = None
    timeout: float = default("replication_timeout")
    streams: int | None = None
    bandwidth: int | str | None = None
    replicas: int | None = None
    failure_domain: str | None = None
    copies: Literal["auto", "off"] | None = None

    def __post_init__(self) -> None:
        for s in _REPLICATION:
            value = getattr(self, s.attribute)
            if value is not None:
                object.__setattr__(self, s.attribute,
                                   s.check(value, f"ReplicationOptions.{s.attribute}"))

    def resolved(self) -> ReplicationOptions:
        """Every field left None from its variable, else its default (``failure_domain``:
        else the leaf switch SLURM names)."""
        values = {s.attribute: s.resolve(getattr(self, s.attribute)) for s in _REPLICATION}
        if values["failure_domain"] is None:
            values["failure_domain"] = Launcher.from_env().slurm_failure_domain()
        return ReplicationOptions(**values)


@dataclass(frozen=True)
class Options:
    """Every setting of a CheckpointManager: those its keywords give, or one object for
    ``CheckpointManager(options=...)``. A field left None takes its variable, else its default,
    when the manager is built (``resolved``); ``ckpt.options`` is the resolved one. The fields
    mean what the manager's keywords of the same names mean."""

    job_id: str | None = None
    local_dir: str | None = None
    keep: int = default("keep")
    keep_persistent: int | None = None
    memory_limit_bytes: int | str | None = None
    replication: ReplicationOptions = ReplicationOptions()

    def __post_init__(self) -> None:
        for s in _MANAGER:
            value = getattr(self, s.name)
            if value is not None or s.env is None:  # no variable to stand in: None is refused
                object.__setattr__(self, s.name, s.check(value, s.name))
        if not isinstance(self.replication, ReplicationOptions):
            raise ConfigError(f"replication={self.replication!r}: expected a "
                              "ReplicationOptions, or its mode as a string (in the manager)")

    def resolved(self, derive_job_id_from: str | None = None) -> Options:
        """This one with every field left None taken from the environment (``MLCHECKPOINT_*``,
        the launcher's job id) or its default; every variable is checked first, also those
        read later. ``derive_job_id_from``: the persistent folder, which names the job when
        nothing else does."""
        check_environment()
        return Options(
            job_id=resolve_job_id(self.job_id, derive_from=derive_job_id_from),
            local_dir=resolve_local_dir(self.local_dir), keep=self.keep,
            keep_persistent=BY_NAME["keep_persistent"].resolve(self.keep_persistent),
            memory_limit_bytes=resolve_memory_limit(self.memory_limit_bytes),
            replication=self.replication.resolved())

    @classmethod
    def of(cls, caller: str, options: Options | None = None, *,
           replication: ReplicationOptions | str | None = None, stacklevel: int = 3,
           deprecated: dict[str, Any] | None = None, **keywords: Any) -> Options:
        """The options a constructor's keywords give (``caller`` names it in errors): its
        ``options`` object, else its keywords (None: unset). ``replication`` may be just the
        mode; ``deprecated`` holds the flat keywords of earlier releases
        (``DEPRECATED_KEYWORDS``), each warned about and moved into ``replication``."""
        flat = dict(deprecated or {})
        unknown = sorted(set(flat) - set(DEPRECATED_KEYWORDS))
        if unknown:
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
        if options is not None:
            unset = Options()
            given = [k for k, v in keywords.items() if v != getattr(unset, k)]
            also = sorted({*given, *flat, *(["replication"] if replication is not None else [])})
            if also:
                raise TypeError(f"{caller}(options=...) takes no other setting: put "
                                f"{', '.join(also)} in the Options")
            return options
        repl = _replication_of(replication)
        for name, value in flat.items():
            field = DEPRECATED_KEYWORDS[name]
            warnings.warn(f"{caller}({name}=...) is deprecated and goes in the next release: "
                          f"pass replication=ReplicationOptions({field}=...)",
                          DeprecationWarning, stacklevel=stacklevel)
            if value is None:
                continue
            if getattr(repl, field) != getattr(ReplicationOptions(), field):
                raise TypeError(f"{caller}: {name}= and replication=ReplicationOptions("
                                f"{field}=...) both given; pass only the latter")
            repl = dataclasses.replace(repl, **{field: value})
        return cls(replication=repl, **keywords)


def _replication_of(value: ReplicationOptions | str | None) -> ReplicationOptions:
    if value is None:
        return ReplicationOptions()
    if isinstance(value, ReplicationOptions):
        return value
    return ReplicationOptions(mode=value)  # type: ignore[arg-type]  # checked there


def resolve_memory_limit(memory_limit_bytes: int | str | None = None) -> int | None:
    """The memory limit in bytes: the argument, else $MLCHECKPOINT_MEMORY_LIMIT, else None."""
    return BY_NAME["memory_limit_bytes"].resolve(memory_limit_bytes)


# ---------------------------------------------------------------- process-wide tuning

def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Tuning:
    """What tunes the whole process: its copier's thread pool, C loop and GC pause are
    process-wide, and so is the least stripe of a TCP push."""

    copy_threads: int
    native_loop: bool = default("native_loop")
    pause_gc: bool = default("pause_gc")
    min_stripe_bytes: int = default("min_stripe_bytes")

    @classmethod
    def from_env(cls) -> Tuning:
        values = {s.name: s.resolve() for s in SETTINGS if s.group == "tuning"}
        # Memory bandwidth, not cores, is the limit past a few threads; every rank of the node
        # saves at the same time.
        if values["copy_threads"] is None:
            values["copy_threads"] = max(1, min(4, _usable_cores()))
        return cls(**values)


_installed: Tuning | None = None


def tuning() -> Tuning:
    """This process's tuning: the one a test or benchmark installed (``tuned``), else the
    environment's. Read at each call (four lookups): a process may change it between saves,
    and the copier's pool follows."""
    return _installed if _installed is not None else Tuning.from_env()


def native_loop() -> bool:
    """Whether the copier's C loop is on, as the modules that bind it read it when they are
    imported. Only ``MLCHECKPOINT_NATIVE`` is read, and a malformed value counts as the default
    here: importing the package never fails on a setting, and the manager's construction
    refuses that one with the others (``ConfigError``)."""
    if _installed is not None:
        return _installed.native_loop
    try:
        return bool(BY_NAME["native_loop"].resolve())
    except ConfigError:
        return bool(default("native_loop"))


@contextlib.contextmanager
def tuned(**changes: Any) -> Iterator[Tuning]:
    """The process's tuning with ``changes`` for the block (tests, benchmarks)."""
    global _installed
    before = _installed
    _installed = dataclasses.replace(tuning(), **changes)
    try:
        yield _installed
    finally:
        _installed = before


# ---------------------------------------------------------------- timeouts

@dataclass(frozen=True)
class Timeouts:
    """How long the parts wait and how often they look, in seconds. The manager builds one
    (``replication`` from its ``ReplicationOptions.timeout``) and hands each part its own."""

    replication: float = default("replication_timeout")
    rendezvous: float = default("rendezvous")
    handshake: float = default("handshake")
    close: float = default("close")
    replicator_poll: float = default("replicator_poll")
    wait_poll: float = default("wait_poll")
    mailbox_poll: float = default("mailbox_poll")
