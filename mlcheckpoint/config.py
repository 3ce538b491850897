"""Settings and their validation: the environment variables, job id, local directory,
retention, memory limit, replication bandwidth.

Every environment variable mlcheckpoint reads is listed in ``ENV_VARS`` and read only through
``env_str``/``env_int``/``env_flag`` here. Each setting is checked where it enters
(``options.Options`` for CheckpointManager, or LocalStore), and a bad one raises ConfigError
naming the setting and what to do, instead of a raw exception later.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import operator
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from .errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_LOCAL_DIR = "/dev/shm/mlcheckpoint"
MEMORY_LIMIT_ENV = "MLCHECKPOINT_MEMORY_LIMIT"
BANDWIDTH_ENV = "MLCHECKPOINT_REPLICATION_BANDWIDTH"
IFNAME_ENV = "MLCHECKPOINT_REPLICATION_IFNAME"
FAILURE_DOMAIN_ENV = "MLCHECKPOINT_FAILURE_DOMAIN"
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


# ---------------------------------------------------------------- environment variables

@dataclass(frozen=True)
class EnvVar:
    """One variable mlcheckpoint reads; ``default`` as docs/configuration.md shows it."""

    name: str
    default: str


ENV_VARS: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("MLCHECKPOINT_JOB_ID", "unset"),
    EnvVar("TORCHELASTIC_RUN_ID", "unset"),
    EnvVar("SLURM_JOB_ID", "unset"),
    EnvVar("MLCHECKPOINT_LOCAL_DIR", DEFAULT_LOCAL_DIR),
    EnvVar(MEMORY_LIMIT_ENV, "unset (no limit)"),
    EnvVar("MLCHECKPOINT_REPLICATION_HOST", "unset"),
    EnvVar(IFNAME_ENV, "unset"),
    EnvVar(BANDWIDTH_ENV, "auto"),
    EnvVar(FAILURE_DOMAIN_ENV, "unset"),
    EnvVar("MLCHECKPOINT_TCP_STREAMS", "4"),
    EnvVar("MLCHECKPOINT_TCP_MIN_STRIPE", "67108864"),
    EnvVar("MLCHECKPOINT_COPY_THREADS", "min(4, usable cores)"),
    EnvVar("MLCHECKPOINT_NATIVE", "1"),
    EnvVar("MLCHECKPOINT_PAUSE_GC", "1"),
    EnvVar("MLCHECKPOINT_CRASH_AT", "unset"),
    EnvVar("MLCHECKPOINT_PAUSE_AT", "unset"),
    EnvVar("MLCHECKPOINT_REPLICATION_SECRET", "unset"),
    EnvVar("MLCHECKPOINT_REPLICATION_SECRET_FILE", "unset"),
    # Set by the launcher (torchrun, or torch.distributed's env:// init).
    EnvVar("RANK", "0"),
    EnvVar("WORLD_SIZE", "1"),
    EnvVar("LOCAL_RANK", "RANK % LOCAL_WORLD_SIZE"),
    EnvVar("LOCAL_WORLD_SIZE", "WORLD_SIZE"),
    EnvVar("GROUP_RANK", "RANK // LOCAL_WORLD_SIZE"),
    EnvVar("MASTER_ADDR", "127.0.0.1"),
    EnvVar("MASTER_PORT", "29500"),
    EnvVar("TORCHELASTIC_RESTART_COUNT", "0"),
    # Set by SLURM's topology plugin in each task: the switches above the node, then the node.
    EnvVar("SLURM_TOPOLOGY_ADDR", "unset"),
    EnvVar("SLURM_TOPOLOGY_ADDR_PATTERN", "unset"),
)}
_FLAGS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def env_str(name: str) -> str | None:
    """The value of the variable ``name`` (one of ``ENV_VARS``), stripped; None when unset or
    empty. The only place mlcheckpoint reads its environment."""
    if name not in ENV_VARS:  # a new variable must be listed (and so documented) first
        raise KeyError(f"{name} is not in mlcheckpoint.config.ENV_VARS")
    return os.environ.get(name, "").strip() or None


def env_int(name: str, default: int, *, minimum: int = 1, maximum: int | None = None) -> int:
    """A whole number from the variable ``name``, ``default`` when unset or empty."""
    text = env_str(name)
    if text is None:
        return default
    value = int(text) if text.isdecimal() else None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        bounds = f"in {minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(f"{name}={text!r}: expected a whole number {bounds}")
    return value


def env_flag(name: str, default: bool) -> bool:
    """On or off from the variable ``name``: 1/0 (also true/false, yes/no, on/off)."""
    text = env_str(name)
    if text is None:
        return default
    if text.lower() not in _FLAGS:
        raise ConfigError(f"{name}={text!r}: expected 1 (on) or 0 (off)")
    return _FLAGS[text.lower()]


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
        value = env_str(var)
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
        local_dir = env_str("MLCHECKPOINT_LOCAL_DIR") or DEFAULT_LOCAL_DIR
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


def validate_keep(keep: object) -> int:
    """``keep``: how many complete checkpoints to keep, a whole number >= 1."""
    try:
        value = None if isinstance(keep, bool) else operator.index(keep)  # type: ignore[arg-type]
    except TypeError:
        value = None
    if value is None or value < 1:
        raise ConfigError(f"keep={keep!r}: keep is how many checkpoints to keep and must be a "
                          "whole number >= 1 (an int such as 1 or 2)")
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
    if memory_limit_bytes is not None:
        return parse_bytes(memory_limit_bytes, "memory_limit_bytes")
    env = env_str(MEMORY_LIMIT_ENV)
    return parse_bytes(env, MEMORY_LIMIT_ENV) if env else None


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
    if bandwidth is not None:
        return parse_bandwidth(bandwidth, "replication_bandwidth")
    env = env_str(BANDWIDTH_ENV)
    return parse_bandwidth(env, BANDWIDTH_ENV) if env else "auto"
