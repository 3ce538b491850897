"""Every setting of mlcheckpoint, declared once, and the only place that reads the environment.

A setting is declared once in ``SETTINGS``: its name, whether it is a ``CheckpointManager``
argument, its environment variable, its default, how a value is checked, and one line of
documentation. From that one declaration come:

- ``Options``: the manager's arguments, resolved (the argument, else the variable, else the
  default) and checked when the manager is built, kept as ``ckpt.options``;
- ``Tuning``: what tunes the whole process (copy threads, the native loop, the GC pause, the
  least stripe), which the process-wide parts it tunes (the copier's pool, the GC pause) ask
  for with ``tuning()``: read at each call, four lookups, so a process may change it between
  saves; a test or benchmark installs one with ``tuned``;
- ``Timeouts``: how long the parts wait and how often they look (replication, rendezvous,
  handshake, close, polls), handed down by the manager;
- ``Launcher``: what the launcher (torchrun, env:// init) says about this process, read once by
  the manager and handed to ``Topology`` and the rendezvous;
- the tables of docs/configuration.md (``scripts/configuration_doc.py`` rewrites them; a test
  checks they are current), and the framework configs' defaults (tested against it).

No other library module reads ``os.environ`` (a test keeps it so). The crash and pause points
of ``_faults.py`` read their variables at each check through ``variable_text``: they are test
hooks, which a test's worker sets in its own environment between steps, not settings a part is
handed. A bad value of any setting raises ConfigError naming it when the manager is built
(``check_environment``), before anything is written.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import logging
import math
import operator
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_LOCAL_DIR = "/dev/shm/mlcheckpoint"
REPLICATION_MODES = ("tcp", "pg", "nccl", "none")  # replication/factory.py's TRANSPORTS + "none"
MAX_STREAMS = 16
MAX_REPLICAS = 8  # partners per node: each costs one more copy of every shard in memory
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FLAGS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


# ---------------------------------------------------------------- checks of one value
# Each takes the value and where it came from (the argument's or the variable's name, for the
# error) and returns the checked value. ``_text_*`` turn a variable's text into a value first.

def _as_is(value: Any, source: str) -> Any:
    return value


def _whole(minimum: int, maximum: int | None = None) -> Callable[[Any, str], int]:
    def check(value: Any, source: str) -> int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok or value < minimum or (maximum is not None and value > maximum):
            bounds = f"in {minimum}..{maximum}" if maximum is not None else f">= {minimum}"
            raise ConfigError(f"{source}={value!r}: expected a whole number {bounds}")
        return value
    return check


def _text_whole(text: str, source: str) -> int | str:
    return int(text) if text.isdecimal() else text  # not a number: the check names it


def _text_flag(text: str, source: str) -> bool:
    if text.lower() not in _FLAGS:
        raise ConfigError(f"{source}={text!r}: expected 1 (on) or 0 (off)")
    return _FLAGS[text.lower()]


def _seconds(value: Any, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{source}={value!r}: expected a number of seconds > 0")
    return value


def _replication_mode(value: Any, source: str) -> str:
    if value not in REPLICATION_MODES:
        raise ConfigError(f"{source}={value!r}: expected one of "
                          f"{', '.join(map(repr, REPLICATION_MODES))}")
    return value


def _host(value: Any, source: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"{source}={value!r}: give an address or host name, or leave it unset")
    return value


def _interface(value: Any, source: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"{source}={value!r}: give a network interface name such as 'eth1' "
                          "or 'ib0', or leave it unset")
    return value


def _failure_domain(value: Any, source: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()
                              or not value.isprintable() or len(value) > 256):
        raise ConfigError(f"{source}={value!r}: give a name such as 'rack-12' (printable, at "
                          "most 256 characters), or leave it unset")
    return value


def _memory_limit(value: Any, source: str) -> int | None:
    return None if value is None else parse_bytes(value, source)


def _job_id(value: Any, source: str) -> str:
    return validate_job_id(value, source if source.isupper() else None)


def _keep(value: Any, source: str) -> int:
    return validate_keep(value)


def _keep_persistent(value: Any, source: str) -> int:
    return validate_keep(value, source)


def _local_dir(value: Any, source: str) -> str:
    return resolve_local_dir(value)


# ---------------------------------------------------------------- the declaration

@dataclass(frozen=True)
class Setting:
    """One setting. ``name``: the field of its group's dataclass (for a manager argument, the
    keyword; for a variable no dataclass holds, the variable's own name)."""

    name: str
    group: str  # "manager", "tuning", "timeouts", "launcher", "job", "secret", "test hooks"
    doc: str
    default: Any = None  # when neither the argument nor the variable gives a value
    env: str | None = None
    keyword: bool = False  # a CheckpointManager(...) argument
    check: Callable[[Any, str], Any] = _as_is  # a given value -> the checked value
    from_text: Callable[[str, str], Any] = _as_is  # the variable's text -> a value to check
    shown: str | None = None  # the default as the docs show it, where it is worked out
    env_doc: str = ""  # what the variable's text may say, beyond the value's own doc

    def argument_cell(self) -> str:
        """The default as docs/configuration.md's table of arguments shows it."""
        return f"`${self.env}` or {_code(self.default)}" if self.env else _code(self.default)

    def variable_cell(self) -> str:
        """The default as docs/configuration.md's table of variables shows it."""
        if self.shown is not None:
            return self.shown
        return "unset" if self.default is None else f"`{self.default}`"

    def text(self) -> str | None:
        """The variable's text as given (stripped), unchecked; None when unset or empty."""
        return variable_text(self.env) if self.env else None

    def from_env(self) -> Any:
        """The variable's value, checked; None when it is unset or empty."""
        text = self.text()
        if text is None or self.env is None:
            return None
        value = self.from_text(text, self.env)
        try:
            return self.check(value, self.env)
        except ConfigError as e:  # name the variable's text as it was given, not the number
            raise ConfigError(str(e).replace(f"={value!r}", f"={text!r}", 1)) from None

    def resolve(self, argument: Any = None) -> Any:
        """The argument, else the variable, else the default; checked."""
        if argument is not None:
            return self.check(argument, self.name)
        value = self.from_env()
        return self.default if value is None else value


def _code(value: object) -> str:
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


SETTINGS: tuple[Setting, ...] = (
    # CheckpointManager(...) arguments, in the order of its signature. The persistent tier is
    # an argument but not an option: the manager opens it (persistent.py).
    Setting("persistent_dir", "persistent", "directory or fsspec URL for persistent DCP "
            "checkpoints (`<dir>/step-<step:012d>`), loadable with stock `dcp.load`; or a "
            '`PersistentStorage(dir, step_format="step-{step}")` for a framework\'s own folder '
            "layout (see integration.md). `save`/`async_save(..., persistent=True)` without it "
            "is a `ConfigError` at the call", keyword=True),
    Setting("job_id", "manager", "names `<local_dir>/<job_id>`; stable across restarts; else "
            "derived from `persistent_dir`", env="MLCHECKPOINT_JOB_ID", keyword=True,
            check=_job_id,
            env_doc="job id (before `TORCHELASTIC_RUN_ID` and `SLURM_JOB_ID`)"),
    # Where the job id comes from when neither the argument nor MLCHECKPOINT_JOB_ID gives it.
    Setting("TORCHELASTIC_RUN_ID", "job", "torchrun's `--rdzv-id`; the value `none` is ignored",
            env="TORCHELASTIC_RUN_ID"),
    Setting("SLURM_JOB_ID", "job", "used when nothing above is set; after it, an id derived "
            "from `persistent_dir`", env="SLURM_JOB_ID"),
    Setting("local_dir", "manager", "tmpfs root", DEFAULT_LOCAL_DIR,
            env="MLCHECKPOINT_LOCAL_DIR", keyword=True, check=_local_dir),
    Setting("keep", "manager", "complete in-memory steps kept per rank (own shards and "
            "replicas); an int >= 1", 2, keyword=True, check=_keep),
    Setting("keep_persistent", "manager", "complete persistent steps kept in `persistent_dir`: "
            "after each persistent write, rank 0 removes the oldest beyond this many, never the "
            "newest complete one, one being written or one without DCP's `.metadata`; an int "
            ">= 1, or unset to keep all", env="MLCHECKPOINT_KEEP_PERSISTENT", keyword=True,
            check=_keep_persistent, from_text=_text_whole),
    Setting("memory_limit_bytes", "manager", "cap on this job's tmpfs usage on this node: bytes "
            "as an int, or a string with a unit (see below); `None`: only the tmpfs free space",
            env="MLCHECKPOINT_MEMORY_LIMIT", keyword=True, check=_memory_limit,
            shown="unset (no limit)",
            env_doc="bytes, or a size with a unit (`8GiB`, `8G`, `8GB`, `512MiB`, `1.5T`)"),
    Setting("replication", "manager", '`"tcp"`, `"pg"` (torch.distributed send/recv on a '
            'dedicated gloo group), `"nccl"` (the same on a dedicated NCCL group, for GPU jobs) '
            'or `"none"`; off by itself on one node', "tcp", keyword=True,
            check=_replication_mode),
    Setting("replication_host", "manager", "the address the TCP listener binds and advertises "
            "to the other nodes; `None`: that of `replication_interface`, else the address "
            "routing to `MASTER_ADDR`", env="MLCHECKPOINT_REPLICATION_HOST", keyword=True,
            check=_host),
    Setting("replication_timeout", "manager", "seconds any single replication operation may "
            "block; a number > 0", 60.0, keyword=True, check=_seconds),
    Setting("replication_streams", "manager", "TCP connections one shard is pushed over "
            "(1-16); each carries at least 64 MiB, so smaller shards use fewer. One TCP stream "
            "often cannot fill a 100+ Gb/s link", 4, env="MLCHECKPOINT_TCP_STREAMS",
            keyword=True, check=_whole(1, MAX_STREAMS), from_text=_text_whole,
            env_doc="a whole number in 1-16"),
    Setting("replication_bandwidth", "manager", "bytes per second that replication may send in "
            "the background, for the whole node (all its ranks together); `0`/`\"none\"` for no "
            "cap; `\"auto\"`: 5% of the interface's speed (with `adaptive_pacing`: up to "
            "its speed, from 5%). See "
            "[Replication network](#replication-network)", "auto",
            env="MLCHECKPOINT_REPLICATION_BANDWIDTH", keyword=True,
            check=lambda v, s: parse_bandwidth(v, s),
            env_doc="bytes/s for the whole node (`125000000`, `100MB/s`, `1Gbit`, `800Mbit/s`, "
                    "`10Gbps`), `0`/`none`/`unlimited` for no cap, or `auto`"),
    Setting("adaptive_pacing", "pacing", "`1` lets replication (off loopback) grow into the "
            "link capacity training leaves idle, up to the budget (`auto`: the interface's speed), "
            "backing off within milliseconds when a queue builds (experimental: it still slows "
            "FSDP steps at 5 Gbit/s, see operations.md). By default replication sends at the "
            "budget (`auto`: 5% of the interface's speed), a tenth of it while training's "
            "traffic queues on the link", False,
            env="MLCHECKPOINT_ADAPTIVE_PACING", from_text=_text_flag, shown="`0`"),
    Setting("replication_interface", "manager", "the network interface (`\"eth1\"`, `\"ib0\"`) "
            "whose IPv4 address the TCP listener binds and advertises, as `NCCL_SOCKET_IFNAME` "
            "picks NCCL's; see [Replication network](#replication-network)",
            env="MLCHECKPOINT_REPLICATION_IFNAME", keyword=True, check=_interface,
            env_doc="the network interface replication listens on (e.g. `eth1`)"),
    Setting("failure_domain", "manager", "what fails together with this node (a rack, a switch, "
            "a power feed): partners are chosen in other domains; `None`: "
            "`$MLCHECKPOINT_FAILURE_DOMAIN`, else the leaf switch SLURM's topology plugin names "
            "(`SLURM_TOPOLOGY_ADDR`), else none; see operations.md",
            env="MLCHECKPOINT_FAILURE_DOMAIN", keyword=True, check=_failure_domain,
            env_doc="this node's failure domain (e.g. `rack-12`)"),
    Setting("replicas", "manager", "partner nodes that keep a replica of each shard (1-8), in "
            "distinct failure domains where possible: losing any `replicas` nodes resumes from "
            "memory; each node then keeps `replicas` other nodes' shards beside its own (see "
            "operations.md, More than one partner)", 1, env="MLCHECKPOINT_REPLICAS",
            keyword=True, check=_whole(1, MAX_REPLICAS), from_text=_text_whole,
            env_doc="a whole number in 1-8"),
    # Process-wide tuning (Tuning).
    Setting("min_stripe_bytes", "tuning", "bytes (64 MiB): the least one TCP stream carries; a "
            "shard gets min(streams, size / this) streams", 64 << 20,
            env="MLCHECKPOINT_TCP_MIN_STRIPE", check=_whole(1), from_text=_text_whole),
    Setting("copy_threads", "tuning", "threads that copy and hash shard bytes in a save or "
            "load, a whole number >= 1; lower it when many ranks share few cores",
            env="MLCHECKPOINT_COPY_THREADS", check=_whole(1), from_text=_text_whole,
            shown="min(4, usable cores)"),
    Setting("native_loop", "tuning", "`0` switches off the copier's C loop "
            "(`integrity/_hashcopy.c`) and uses its Python loop: same checksums, slower saves and "
            "loads. The C loop is built at install when a C compiler is present; without one "
            "the Python loop is used anyway", True, env="MLCHECKPOINT_NATIVE",
            from_text=_text_flag, shown="`1`"),
    Setting("pause_gc", "tuning", "`0` lets Python's cyclic garbage collector run during saves "
            "and loads; by default it is held off for their duration (at most 10 s each), see "
            "operations.md", True, env="MLCHECKPOINT_PAUSE_GC", from_text=_text_flag,
            shown="`1`"),
    # Test hooks, read at each check (see the module's docstring).
    Setting("MLCHECKPOINT_CRASH_AT", "test hooks", "tests only: `point@step#rank` SIGKILLs the "
            "process at a stage of a save (`before_data`, `mid_data`, `before_manifest`, "
            "`mid_commit`, `before_metadata`, `replica_mid_recv`, `replica_mid_send`)",
            env="MLCHECKPOINT_CRASH_AT"),
    Setting("MLCHECKPOINT_PAUSE_AT", "test hooks", "tests only: `point@step#rank=path` holds "
            "the calling thread at a point until the file `path` exists, so a test makes ranks "
            "meet in the order that exposes a race (`resume_agreed`)",
            env="MLCHECKPOINT_PAUSE_AT"),
    # The replication secret (replication/rendezvous.py reads and checks it).
    Setting("secret", "secret", "the replication secret in hex, see "
            "[Replication secret](#replication-secret)", env="MLCHECKPOINT_REPLICATION_SECRET"),
    Setting("secret_file", "secret", "a file holding the hex secret, see "
            "[Replication secret](#replication-secret)",
            env="MLCHECKPOINT_REPLICATION_SECRET_FILE"),
    # What the launcher says (Launcher).
    Setting("rank", "launcher", "set by the launcher; read when no process group is "
            "initialised", 0, env="RANK", check=_whole(0), from_text=_text_whole),
    Setting("world_size", "launcher", "set by the launcher; read when no process group is "
            "initialised", 1, env="WORLD_SIZE", check=_whole(1), from_text=_text_whole),
    Setting("local_rank", "launcher", "set by torchrun", env="LOCAL_RANK", check=_whole(0),
            from_text=_text_whole, shown="RANK % LOCAL_WORLD_SIZE"),
    Setting("local_world_size", "launcher", "set by torchrun; with `GROUP_RANK`, defines nodes "
            "and pairing", env="LOCAL_WORLD_SIZE", check=_whole(0), from_text=_text_whole,
            shown="WORLD_SIZE"),
    Setting("group_rank", "launcher", "set by torchrun: the node rank", env="GROUP_RANK",
            check=_whole(0), from_text=_text_whole, shown="RANK // LOCAL_WORLD_SIZE"),
    Setting("master_addr", "launcher", "set by the launcher; without "
            "`replication_interface`/`replication_host` the TCP listener binds the address that "
            "routes to it; a loopback one means every node runs on this machine (see "
            "[Replication network](#replication-network))", "127.0.0.1", env="MASTER_ADDR"),
    Setting("master_port", "launcher", "set by the launcher; used with `MASTER_ADDR` to find "
            "that interface (no packet is sent)", 29500, env="MASTER_PORT",
            check=_whole(1, 65535), from_text=_text_whole),
    Setting("restart_count", "launcher", "set by torchrun; keeps one attempt's rendezvous keys "
            "apart from the next", "0", env="TORCHELASTIC_RESTART_COUNT"),
    # How long the parts wait and how often they look (Timeouts); not variables.
    Setting("slurm_topology_addr", "launcher", "set by SLURM's topology plugin in each task: "
            "the switches above the node, then the node (`spine1.leaf7.node42`)",
            env="SLURM_TOPOLOGY_ADDR"),
    Setting("slurm_topology_pattern", "launcher", "set by SLURM with `SLURM_TOPOLOGY_ADDR`: "
            "what each of its parts is (`switch.switch.node`)",
            env="SLURM_TOPOLOGY_ADDR_PATTERN"),
    Setting("rendezvous", "timeouts", "seconds a rank waits for another's key in the c10d "
            "store (replication addresses, rounds)", 300.0, check=_seconds),
    Setting("handshake", "timeouts", "seconds a TCP connection may take to authenticate", 5.0,
            check=_seconds),
    Setting("close", "timeouts", "seconds `close()` waits for replication in flight and for "
            "the other ranks, and `wait_replicated()` by default", 60.0, check=_seconds),
    Setting("replicator_poll", "timeouts", "seconds between the replicator's looks for a new "
            "round when no save wakes it", 0.1, check=_seconds),
    Setting("wait_poll", "timeouts", "seconds between looks while waiting for a step to be "
            "replicated or drained", 0.02, check=_seconds),
    Setting("mailbox_poll", "timeouts", "seconds between the `pg` transport's looks for "
            "requests: the node's leader at its doorbell in the c10d store, every rank at the "
            "node's file of it", 0.01, check=_seconds),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS if s.env}
# Every variable mlcheckpoint reads.
ENV_VARS: tuple[str, ...] = tuple(BY_ENV)


def default(name: str) -> Any:
    """The declared default of the setting ``name``."""
    return BY_NAME[name].default


def variable_text(name: str) -> str | None:
    """The value of the declared variable ``name``, stripped; None when unset or empty. The
    only place mlcheckpoint reads its environment."""
    if name not in BY_ENV:  # a new variable must be declared (and so documented) first
        raise KeyError(f"{name} is not declared in mlcheckpoint.settings.SETTINGS")
    return os.environ.get(name, "").strip() or None


# ---------------------------------------------------------------- the manager's settings

def _manager_settings() -> list[Setting]:
    return [s for s in SETTINGS if s.group == "manager"]


@dataclass(frozen=True)
class Options:
    """Every setting of a CheckpointManager, resolved (see ``resolve``) and checked; the
    fields, their defaults and their variables are those of ``SETTINGS`` (keyword=True)."""

    job_id: str
    local_dir: str
    keep: int = default("keep")
    keep_persistent: int | None = default("keep_persistent")
    memory_limit_bytes: int | None = default("memory_limit_bytes")
    replication: str = default("replication")
    replication_host: str | None = default("replication_host")
    replication_timeout: float = default("replication_timeout")
    replication_streams: int = default("replication_streams")
    replication_bandwidth: int | str = default("replication_bandwidth")
    replication_interface: str | None = default("replication_interface")
    failure_domain: str | None = default("failure_domain")
    replicas: int = default("replicas")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                object.__setattr__(self, f.name, BY_NAME[f.name].check(value, f.name))

    @classmethod
    def resolve(cls, derive_job_id_from: str | None = None, **arguments: Any) -> Options:
        """CheckpointManager's arguments (None: unset), with what is left unset taken from the
        environment (``MLCHECKPOINT_*``, the launcher's job id) or its default.
        ``derive_job_id_from``: the persistent folder, which names the job when nothing else
        does."""
        unknown = set(arguments) - {s.name for s in _manager_settings()}
        if unknown:
            raise TypeError(f"not a CheckpointManager setting: {', '.join(sorted(unknown))}")
        check_environment()
        values: dict[str, Any] = {}
        for s in _manager_settings():
            if s.name in ("job_id", "local_dir"):
                continue  # resolved below, with their own fallbacks
            if s.env is None:  # no variable: as given (None is refused), else the default
                values[s.name] = s.check(arguments.get(s.name, s.default), s.name)
            else:
                values[s.name] = s.resolve(arguments.get(s.name))
        if values["failure_domain"] is None:  # the launcher may name one
            values["failure_domain"] = Launcher.from_env().slurm_failure_domain()
        return cls(job_id=resolve_job_id(arguments.get("job_id"), derive_from=derive_job_id_from),
                   local_dir=resolve_local_dir(arguments.get("local_dir")), **values)


def check_environment() -> None:
    """Parse every variable now (each group reads it the same way later), so a bad value is a
    ConfigError when the manager is built, not in the middle of a save."""
    for s in SETTINGS:
        if s.group != "test hooks":
            s.from_env()


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
    (``replication`` from its ``replication_timeout``) and hands each part its own."""

    replication: float = default("replication_timeout")
    rendezvous: float = default("rendezvous")
    handshake: float = default("handshake")
    close: float = default("close")
    replicator_poll: float = default("replicator_poll")
    wait_poll: float = default("wait_poll")
    mailbox_poll: float = default("mailbox_poll")


# ---------------------------------------------------------------- the launcher

@dataclass(frozen=True)
class Launcher:
    """What the launcher (torchrun, SLURM, env:// init) says about this process. ``None``:
    the variable is unset; ``topology.Topology.detect`` works out the rest."""

    rank: int = default("rank")
    world_size: int = default("world_size")
    local_rank: int | None = None
    local_world_size: int | None = None
    group_rank: int | None = None
    master_addr: str = default("master_addr")
    master_port: int = default("master_port")
    restart_count: str = default("restart_count")
    slurm_topology_addr: str | None = None
    slurm_topology_pattern: str | None = None

    def slurm_failure_domain(self) -> str | None:
        """The leaf switch above this node, from SLURM's topology plugin: the address names
        the switches from the top down and ends with the node (``spine1.leaf7.node42``,
        pattern ``switch.switch.node``). None without switches (pattern ``node``) or outside
        SLURM."""
        addr, pattern = self.slurm_topology_addr, self.slurm_topology_pattern
        if addr is None or pattern is None:
            return None
        parts, kinds = addr.split("."), pattern.split(".")
        if (len(parts) != len(kinds) or len(kinds) < 2 or kinds[-1] != "node"
                or kinds[-2] != "switch"):
            return None
        return ".".join(parts[:-1])  # the whole path: two spines' leaf switches may share a name

    @classmethod
    def from_env(cls) -> Launcher:
        return cls(**{s.name: s.resolve() for s in SETTINGS if s.group == "launcher"})


def secret_sources() -> tuple[str | None, str | None]:
    """(``$MLCHECKPOINT_REPLICATION_SECRET``, ``$MLCHECKPOINT_REPLICATION_SECRET_FILE``), as
    given; replication/rendezvous.py parses and checks them."""
    return BY_NAME["secret"].from_env(), BY_NAME["secret_file"].from_env()


# ---------------------------------------------------------------- job id, directory, sizes

def validate_job_id(job_id: str, variable: str | None = None) -> str:
    """A job id becomes a directory name: allow only a safe, path-free alphabet. ``variable``:
    the environment variable it came from, named in the error."""
    if not isinstance(job_id, str) or not _JOB_ID_RE.match(job_id) or job_id in (".", ".."):
        given = f"{variable}={job_id!r}" if variable else repr(job_id)
        raise ConfigError(
            f"invalid job id {given}: use 1-128 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    return job_id


def resolve_job_id(job_id: str | None = None, *, derive_from: str | None = None) -> str:
    """Explicit argument, else MLCHECKPOINT_JOB_ID, TORCHELASTIC_RUN_ID, SLURM_JOB_ID, else an
    id derived from ``derive_from`` (the persistent folder: it survives a restart)."""
    if job_id is not None:
        return validate_job_id(str(job_id))
    for var in ("MLCHECKPOINT_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = variable_text(var)
        # torchrun sets TORCHELASTIC_RUN_ID=none when --rdzv-id is not given.
        if value and not (var == "TORCHELASTIC_RUN_ID" and value == "none"):
            return validate_job_id(value, var)
    if derive_from:
        return derived_job_id(derive_from)
    raise ConfigError(
        "no job id: pass CheckpointManager(job_id=...), set MLCHECKPOINT_JOB_ID, or launch with "
        "torchrun --rdzv-id=<id> (TORCHELASTIC_RUN_ID) or under SLURM (SLURM_JOB_ID), or give a "
        "persistent_dir to derive one from. The id must stay the same across restarts of the job "
        "so the restarted job finds its checkpoints."
    )


def derived_job_id(location: str) -> str:
    """A job id from the persistent folder's absolute path (or URL): the same on every rank and
    after every restart of the job, as long as the folder stays the same."""
    if "://" not in location:
        location = os.path.abspath(location)
    job_id = "dir-" + hashlib.sha256(location.encode()).hexdigest()[:16]
    log.info("mlcheckpoint: no job id set (MLCHECKPOINT_JOB_ID, torchrun --rdzv-id, SLURM_JOB_ID): "
             "using %s, derived from the persistent folder %s", job_id, location)
    return job_id


def resolve_local_dir(local_dir: str | os.PathLike | None = None) -> str:
    """Explicit argument, else MLCHECKPOINT_LOCAL_DIR, else /dev/shm/mlcheckpoint."""
    if local_dir is None:
        local_dir = variable_text("MLCHECKPOINT_LOCAL_DIR") or DEFAULT_LOCAL_DIR
    path = os.fspath(local_dir)
    if not isinstance(path, str) or path == "":
        # "" would resolve to the current directory: checkpoints on disk, wherever the job ran.
        raise ConfigError(
            f"local_dir={local_dir!r} names no directory: pass a tmpfs directory such as "
            f"{DEFAULT_LOCAL_DIR!r} (or leave local_dir unset for that default, or set "
            "MLCHECKPOINT_LOCAL_DIR)")
    return os.path.abspath(path)


@contextlib.contextmanager
def local_dir_errors(local_dir: str) -> Iterator[None]:
    """Turn what the OS says while creating the store's directories into a ConfigError that
    names ``local_dir`` and the fix (a regular file in the way, a read-only or foreign dir)."""
    fix = "pass local_dir= (or set MLCHECKPOINT_LOCAL_DIR to) a writable directory on tmpfs"
    try:
        yield
    except (FileExistsError, NotADirectoryError) as e:
        what = repr(e.filename) if isinstance(e, FileExistsError) else f"a part of {e.filename!r}"
        raise ConfigError(f"local_dir {local_dir!r} cannot hold checkpoints: {what} is a file, "
                          f"not a directory; {fix}") from e
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        why = "is on a read-only filesystem" if e.errno == errno.EROFS else "is not writable by this user"
        raise ConfigError(f"local_dir {local_dir!r} {why} ({e.strerror}: {e.filename!r}); "
                          f"{fix}") from e


# statfs f_type of the filesystems that keep their files in memory, and names of a few others
# for the warning's wording.
_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs", 0x958458F6: "hugetlbfs"}
_OTHER_FS = {0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x794C7630: "overlayfs",
            0x6969: "nfs", 0xFF534D42: "cifs", 0x65735546: "fuse", 0x2FC12FC1: "zfs"}
_warned_not_memory: set[str] = set()


def filesystem_type(path: str) -> int | None:
    """statfs(2)'s f_type of the filesystem holding ``path``; None where it cannot be read."""
    try:
        statfs = ctypes.CDLL(None, use_errno=True).statfs
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes; f_type comes first
    if statfs(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def warn_if_not_memory(local_dir: str) -> None:
    """Warn (once per directory and process) when ``local_dir`` is not on tmpfs/ramfs."""
    fs = filesystem_type(local_dir)
    if fs is None or fs in _MEMORY_FS or local_dir in _warned_not_memory:
        return
    _warned_not_memory.add(local_dir)
    log.warning(
        "mlcheckpoint: local_dir %s is on %s, not tmpfs: in-memory checkpoints go to that "
        "filesystem instead, so saves and resumes run at its speed, not at memory speed, and "
        "take its space. Point local_dir= or MLCHECKPOINT_LOCAL_DIR at a tmpfs directory such "
        "as %s.", local_dir, _OTHER_FS.get(fs, f"a filesystem of type {fs:#x}"), DEFAULT_LOCAL_DIR)


def validate_keep(keep: object, setting: str = "keep") -> int:
    """``keep`` (or ``setting``): how many complete checkpoints to keep, a whole number >= 1."""
    try:
        value = None if isinstance(keep, bool) else operator.index(keep)  # type: ignore[arg-type]
    except TypeError:
        value = None
    if value is None or value < 1:
        raise ConfigError(f"{setting}={keep!r}: {setting} is how many checkpoints to keep and "
                          "must be a whole number >= 1 (an int such as 1 or 2)")
    return value


# Binary for the bare letters and the -iB forms (like mount's size=8g); SI for KB, MB, GB, TB.
_UNITS = {"": 1, "b": 1,
          "k": 1 << 10, "ki": 1 << 10, "kib": 1 << 10, "kb": 10**3,
          "m": 1 << 20, "mi": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gi": 1 << 30, "gib": 1 << 30, "gb": 10**9,
          "t": 1 << 40, "ti": 1 << 40, "tib": 1 << 40, "tb": 10**12}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: object, setting: str) -> int:
    """A positive byte count from an int or a string such as "8589934592", "8G", "8GiB",
    "8GB" or "1.5T" (K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024; KB/MB/GB/TB of 1000)."""
    number = _size_of(value)
    if number is None or not 1 <= number < float("inf"):
        raise ConfigError(
            f"{setting}={value!r} is not a size: give a positive number of bytes, optionally "
            "with a unit: K, M, G, T or KiB, MiB, GiB, TiB (powers of 1024), or KB, MB, GB, TB "
            "(powers of 1000), e.g. 8GiB")
    return int(number)


def _size_of(value: object) -> int | float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if m is None or m[2].lower() not in _UNITS:
        return None
    unit = _UNITS[m[2].lower()]
    return int(m[1]) * unit if m[1].isdigit() else float(m[1]) * unit


def resolve_memory_limit(memory_limit_bytes: int | str | None = None) -> int | None:
    """The memory limit in bytes: the argument, else $MLCHECKPOINT_MEMORY_LIMIT, else None."""
    return BY_NAME["memory_limit_bytes"].resolve(memory_limit_bytes)


# Rates: the byte units above, or bits (always powers of 1000, as networks count), each with
# an optional "/s" ("100MB/s", "1Gbit", "800Mbit/s", "10Gbps").
_BITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
         "bps": 1, "kbps": 10**3, "mbps": 10**6, "gbps": 10**9, "tbps": 10**12}
_UNCAPPED = ("none", "unlimited", "off")


def parse_bandwidth(value: object, setting: str) -> int | str:
    """A replication bandwidth budget: bytes per second (an int, or a string such as
    "125000000", "100MB/s", "1Gbit", "800Mbit/s"), 0 (also "none", "unlimited") for no cap,
    or "auto" for the default derived from the link (replication/budget.py)."""
    word = value.strip().lower() if isinstance(value, str) else None
    if word == "auto":
        return "auto"
    if word in _UNCAPPED:
        return 0
    number = _size_of(value) if word is None else _rate_of(word.removesuffix("/s"))
    if number is None or not 0 <= number < float("inf") or 0 < number < 1:
        raise ConfigError(
            f"{setting}={value!r} is not a bandwidth: give bytes per second (e.g. 125000000), "
            "optionally with a unit: 100MB/s, 1.5GB/s (bytes; K/M/G/T and KiB/MiB/GiB are "
            "powers of 1024, KB/MB/GB of 1000) or 1Gbit, 800Mbit/s, 10Gbps (bits); 0, none or "
            "unlimited for no cap; auto for the default (a share of the interface's speed)")
    return int(number)


def _rate_of(text: str) -> int | float | None:
    m = _SIZE_RE.match(text)
    if m is not None and m[2] in _BITS:
        return float(m[1]) * _BITS[m[2]] / 8
    return _size_of(text)


def resolve_bandwidth(bandwidth: int | str | None = None) -> int | str:
    """The replication budget: the argument, else $MLCHECKPOINT_REPLICATION_BANDWIDTH, else
    "auto"."""
    return BY_NAME["replication_bandwidth"].resolve(bandwidth)


# ---------------------------------------------------------------- docs/configuration.md

def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def doc_tables() -> dict[str, str]:
    """The tables of docs/configuration.md that the declaration makes, by marker name."""
    arguments = [_row("argument", "default", "meaning"), "|---|---|---|"] + [
        _row(f"`{s.name}`", s.argument_cell(), s.doc) for s in SETTINGS if s.keyword]
    variables = [_row("variable", "default", "meaning"), "|---|---|---|"]
    for s in SETTINGS:
        if s.env:
            meaning = s.doc
            if s.keyword:
                meaning = f"default for `{s.name}`" + (f": {s.env_doc}" if s.env_doc else "")
            variables.append(_row(f"`{s.env}`", s.variable_cell(), meaning))
    timeouts = [_row("timeout", "default", "meaning"), "|---|---|---|"] + [
        _row(f"`{s.name}`", _code(s.default), s.doc) for s in SETTINGS if s.group == "timeouts"]
    return {"arguments": "\n".join(arguments), "variables": "\n".join(variables),
            "timeouts": "\n".join(timeouts)}


def render_doc(text: str) -> str:
    """``text`` (docs/configuration.md) with each generated table replaced by the current one:
    a table sits between ``<!-- settings:NAME -->`` and ``<!-- /settings:NAME -->``."""
    for name, table in doc_tables().items():
        begin, end = f"<!-- settings:{name} -->", f"<!-- /settings:{name} -->"
        head, found, rest = text.partition(begin)
        if not found:
            raise ValueError(f"no {begin} marker")
        _, _, tail = rest.partition(end)
        text = f"{head}{begin}\n{table}\n{end}{tail}"
    return text
