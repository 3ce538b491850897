"""Every setting of mlcheckpoint, declared once (``SETTINGS``), with the checks of one value.

A setting is declared once: its name, where it belongs (a ``CheckpointManager`` argument, a
field of ``ReplicationOptions``, the process's tuning, the timeouts, the launcher), its
environment variable, its default, how a value is checked, and one line of documentation.
``resolved.py`` and ``launcher.py`` build the objects the parts are handed from it, and
``scripts/configuration_doc.py`` the tables of docs/configuration.md. ``variable_text`` here is
the only place mlcheckpoint reads its environment.
"""

from __future__ import annotations

import math
import operator
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .units import parse_bandwidth, parse_bytes

DEFAULT_LOCAL_DIR = "/dev/shm/mlcheckpoint"
REPLICATION_MODES = ("tcp", "pg", "nccl", "none")  # replication/factory.py's TRANSPORTS + "none"
MAX_STREAMS = 16
MAX_REPLICAS = 8  # partners per node: each costs one more copy of every shard in memory
COPIES_MODES = ("auto", "off")  # ReplicationOptions.copies: data parallelism's copies kept or not
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


def _seconds(value: Any, source: str, zero: bool = False) -> float:
    """A finite number of seconds, > 0 (``zero``: >= 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (0 <= value if zero else 0 < value) and value < math.inf):
        raise ConfigError(f"{source}={value!r}: expected a number of seconds "
                          f"{'>= 0' if zero else '> 0'}")
    return value


def _seconds_or_zero(value: Any, source: str) -> float:
    return _seconds(value, source, zero=True)


def _text_seconds(text: str, source: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text  # not a number: the check names it


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


def _copies(value: Any, source: str) -> str:
    if value not in COPIES_MODES:
        raise ConfigError(f"{source}={value!r}: expected one of {', '.join(map(repr, COPIES_MODES))}")
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
    group: str  # "manager", "replication", "tuning", "timeouts", "launcher", "job", "secret",
    # "persistent", "pacing", "preemption", "test hooks"
    doc: str
    default: Any = None  # when neither the argument nor the variable gives a value
    env: str | None = None
    keyword: bool = False  # a CheckpointManager(...) argument
    check: Callable[[Any, str], Any] = _as_is  # a given value -> the checked value
    from_text: Callable[[str, str], Any] = _as_is  # the variable's text -> a value to check
    shown: str | None = None  # the default as the docs show it, where it is worked out
    field: str | None = None  # its ReplicationOptions field, where not ``name``
    env_doc: str = ""  # what the variable's text may say, beyond the value's own doc
    # A replication field that was a flat CheckpointManager keyword in earlier releases (still
    # accepted, with a DeprecationWarning); False for fields added since.
    flat: bool = True

    @property
    def attribute(self) -> str:
        """Its name in the object that holds it (``Options``, ``ReplicationOptions``, ...)."""
        return self.field or self.name

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


SETTINGS: tuple[Setting, ...] = (
    # CheckpointManager(...) arguments, in the order of its signature. The persistent tier is
    # an argument but not an option: the manager opens it (persistent.py).
    Setting("persistent_dir", "persistent", "directory or fsspec URL for persistent DCP "
            "checkpoints (`<dir>/step-<step:012d>`), loadable with stock `dcp.load`; or a "
            '`mlcheckpoint.PersistentStorage(dir, step_format="step-{step}")` for a framework\'s '
            "own folder layout (see integration.md). `save`/`async_save(..., persistent=True)` "
            "without it is a `ConfigError` at the call", keyword=True),
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
    # Read once when the manager claims its job directory (store/claim.py); not an argument.
    Setting("persistent_dir_moved", "persistent", "`1` lets a run resume from memory that a "
            "run with another `persistent_dir` saved (the job's persistent folder moved); "
            "without it the manager refuses to start there, naming both folders (see "
            "operations.md, One live run per job directory)", False,
            env="MLCHECKPOINT_PERSISTENT_DIR_MOVED", from_text=_text_flag, shown="`0`"),
    # The preemption flush (manager/preemption.py, flush.py); read when the manager is built.
    Setting("preemption_flush", "preemption", "`0` turns the preemption flush off: on SIGTERM "
            "(or the notice file), each rank no longer writes its part of the newest step in "
            "memory to `persistent_dir` before the process ends (see operations.md, Preemption). "
            "`flush_to_persistent()` still works", True, env="MLCHECKPOINT_PREEMPTION_FLUSH",
            from_text=_text_flag, shown="`1`"),
    Setting("flush_deadline", "preemption", "seconds a preemption flush may hold the process "
            "after the notice; keep it below the launcher's grace period (torchrun's "
            "`--shutdown-timeout`, 30 s by default)", 25.0, env="MLCHECKPOINT_FLUSH_DEADLINE",
            check=_seconds, from_text=_text_seconds, shown="`25`"),
    Setting("flush_wait_for_parts", "preemption", "seconds after the notice (within "
            "`flush_deadline`) a rank whose part of the flushed step is written stays for the "
            "other ranks' parts: a notice that reaches another node later finds its ranks "
            "waiting in a collective, where this rank's exit would have failed them before "
            "they flushed; `0` leaves at once (see operations.md, Preemption)", 10.0,
            env="MLCHECKPOINT_FLUSH_WAIT_FOR_PARTS", check=_seconds_or_zero, from_text=_text_seconds,
            shown="`10`"),
    Setting("flush_notice_file", "preemption", "a path whose appearance is a preemption notice, "
            "for schedulers that announce one otherwise than by SIGTERM (looked for every "
            "0.5 s; the flush runs once per appearance, training goes on)",
            env="MLCHECKPOINT_FLUSH_NOTICE_FILE"),
    # ReplicationOptions(...) fields, in its order: ``name`` is the flat spelling (the
    # keyword of earlier releases, still accepted with a DeprecationWarning), ``field`` the
    # field's own name.
    Setting("replication", "replication", '`"tcp"`, `"pg"` (torch.distributed send/recv on a '
            'dedicated gloo group), `"nccl"` (the same on a dedicated NCCL group, for GPU jobs) '
            'or `"none"`; off by itself on one node', "tcp", field="mode",
            check=_replication_mode),
    Setting("replication_host", "replication", "the address the TCP listener binds and "
            "advertises to the other nodes; `None`: that of `interface`, else the address "
            "routing to `MASTER_ADDR`", env="MLCHECKPOINT_REPLICATION_HOST", field="host",
            check=_host),
    Setting("replication_interface", "replication", "the network interface (`\"eth1\"`, "
            "`\"ib0\"`) whose IPv4 address the TCP listener binds and advertises, as "
            "`NCCL_SOCKET_IFNAME` picks NCCL's; see [Replication network](#replication-network)",
            env="MLCHECKPOINT_REPLICATION_IFNAME", field="interface", check=_interface,
            env_doc="the network interface replication listens on (e.g. `eth1`)"),
    Setting("replication_timeout", "replication", "seconds any single replication operation "
            "may block; a number > 0", 60.0, field="timeout", check=_seconds),
    Setting("replication_streams", "replication", "TCP connections one shard is pushed over "
            "(1-16); each carries at least 64 MiB, so smaller shards use fewer. One TCP stream "
            "often cannot fill a 100+ Gb/s link", 4, env="MLCHECKPOINT_TCP_STREAMS",
            field="streams", check=_whole(1, MAX_STREAMS), from_text=_text_whole,
            env_doc="a whole number in 1-16"),
    Setting("replication_bandwidth", "replication", "bytes per second that replication may "
            "send in the background, for the whole node (all its ranks together); "
            "`0`/`\"none\"` for no cap; `\"auto\"`: derived from the job, twice its checkpoint "
            "bytes per save interval, from 5% of the interface's speed up to half of it (with "
            "`adaptive_pacing`: up to its speed, from 5%). See "
            "[Replication network](#replication-network)", "auto",
            env="MLCHECKPOINT_REPLICATION_BANDWIDTH", field="bandwidth",
            check=lambda v, s: parse_bandwidth(v, s),
            env_doc="bytes/s for the whole node (`125000000`, `100MB/s`, `1Gbit`, `800Mbit/s`, "
                    "`10Gbps`), `0`/`none`/`unlimited` for no cap, or `auto`"),
    Setting("adaptive_pacing", "pacing", "`1` lets replication (off loopback) grow into the "
            "link capacity training leaves idle, up to the budget (`auto`: the interface's speed), "
            "backing off within milliseconds when a queue builds (experimental: it still slows "
            "FSDP steps at 5 Gbit/s, see operations.md). By default replication sends at the "
            "budget (`auto`: derived from the job's checkpoint bytes and save cadence, backing "
            "off when its steps slow down; an explicit budget: a tenth of it while training's "
            "traffic queues on the link)", False,
            env="MLCHECKPOINT_ADAPTIVE_PACING", from_text=_text_flag, shown="`0`"),
    Setting("replicas", "replication", "partner nodes that keep a replica of each shard (1-8), "
            "in distinct failure domains where possible: losing any `replicas` nodes resumes "
            "from memory; each node then keeps `replicas` other nodes' shards beside its own "
            "(see operations.md, More than one partner)", 1, env="MLCHECKPOINT_REPLICAS",
            field="replicas", check=_whole(1, MAX_REPLICAS), from_text=_text_whole,
            env_doc="a whole number in 1-8"),
    Setting("failure_domain", "replication", "what fails together with this node (a rack, a "
            "switch, a power feed): partners are chosen in other domains; `None`: "
            "`$MLCHECKPOINT_FAILURE_DOMAIN`, else the leaf switch SLURM's topology plugin names "
            "(`SLURM_TOPOLOGY_ADDR`), else none; see operations.md",
            env="MLCHECKPOINT_FAILURE_DOMAIN", field="failure_domain", check=_failure_domain,
            env_doc="this node's failure domain (e.g. `rack-12`)"),
    Setting("copies", "replication", '`"auto"`: where data parallelism (DDP, HSDP\'s replica '
            "groups) holds an item on several nodes, each of them keeps one copy of it from the "
            "save, and replication sends only the items that lack their places (per-rank state "
            'such as an RNG state); `"off"`: no copies, every shard is replicated whole. Off '
            "on any rank, off for the job; see integration.md, Data parallelism's copies", "auto",
            env="MLCHECKPOINT_DP_COPIES", check=_copies, flat=False,
            env_doc="`auto` or `off`"),
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
            "`mid_commit`, `before_metadata`, `replica_mid_recv`, `replica_mid_send`) or of "
            "a resume's rebuild (`rebuild_before_commit`)",
            env="MLCHECKPOINT_CRASH_AT"),
    Setting("MLCHECKPOINT_PAUSE_AT", "test hooks", "tests only: `point@step#rank=path` holds "
            "the calling thread at a point until the file `path` exists, so a test makes ranks "
            "meet in the order that exposes a race (`resume_agreed`, `flush_part`, ...)",
            env="MLCHECKPOINT_PAUSE_AT"),
    # The replication secret (replication/core/rendezvous.py reads and checks it).
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
            "`ReplicationOptions.interface`/`host` the TCP listener binds the address that "
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


def check_environment() -> None:
    """Parse every variable now (each group reads it the same way later), so a bad value is a
    ConfigError when the manager is built, not in the middle of a save."""
    for s in SETTINGS:
        if s.group != "test hooks":
            s.from_env()


# ---------------------------------------------------------------- job id, directory, keep

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
