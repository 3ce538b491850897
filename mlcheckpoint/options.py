"""The settings of one CheckpointManager, resolved and checked in one place.

Each one comes from the argument, else its environment variable, else the default, and a bad
value is a ConfigError naming the setting, raised before anything is written. The variables
that tune a whole process (``MLCHECKPOINT_COPY_THREADS``, ``MLCHECKPOINT_NATIVE``,
``MLCHECKPOINT_PAUSE_GC``, ``MLCHECKPOINT_TCP_MIN_STRIPE``) are read where they act, through
``config.env_*``; ``Options.resolve`` checks them too, so a bad one fails at construction, not
in the middle of a save. docs/configuration.md lists the same settings (a test keeps them in
step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import _gc
from .config import (
    BANDWIDTH_ENV,
    FAILURE_DOMAIN_ENV,
    IFNAME_ENV,
    MEMORY_LIMIT_ENV,
    env_str,
    parse_bandwidth,
    resolve_bandwidth,
    resolve_job_id,
    resolve_local_dir,
    resolve_memory_limit,
    validate_job_id,
    validate_keep,
)
from .errors import ConfigError
from .replication import network
from .replication.factory import TRANSPORTS
from .replication.striping import (
    DEFAULT_STREAMS,
    MAX_STREAMS,
    default_min_stripe_bytes,
    default_streams,
)
from .store import checksum, copier
from .topology import slurm_failure_domain

REPLICATION_MODES = (*TRANSPORTS, "none")


@dataclass(frozen=True)
class Options:
    """Every setting of a CheckpointManager, resolved (see ``resolve``) and checked.

    Attributes:
        job_id: names ``<local_dir>/<job_id>``; the same across restarts of the job.
        local_dir: absolute tmpfs directory.
        keep: complete in-memory checkpoints kept per rank.
        memory_limit_bytes: cap on this job's tmpfs use on this node; None: free space only.
        replication: one of ``REPLICATION_MODES``.
        replication_host: address the TCP listener binds and advertises; None: see
            ``replication_interface``.
        replication_interface: network interface whose IPv4 address the TCP listener binds
            and advertises; None: ``replication_host``, else the address routing to
            MASTER_ADDR. Checked to exist; when both are given they must agree.
        replication_timeout: seconds any single replication operation may block.
        replication_streams: TCP connections one large shard is pushed over.
        replication_bandwidth: bytes/s replication may send in the background, for the whole
            node; 0: no cap; "auto": a share of the interface's speed (replication/budget.py).
        failure_domain: what fails together with this node (a rack, a switch, a power feed);
            partners are chosen in other domains. None: none named (nor by the launcher).
    """

    # metadata["env"]: the variable that gives the value when the argument is left unset.
    job_id: str = field(metadata={"env": "MLCHECKPOINT_JOB_ID"})
    local_dir: str = field(metadata={"env": "MLCHECKPOINT_LOCAL_DIR"})
    keep: int = 2
    memory_limit_bytes: int | None = field(default=None, metadata={"env": MEMORY_LIMIT_ENV})
    replication: str = "tcp"
    replication_host: str | None = field(default=None,
                                         metadata={"env": "MLCHECKPOINT_REPLICATION_HOST"})
    replication_timeout: float = 60.0
    replication_streams: int = field(default=DEFAULT_STREAMS,
                                     metadata={"env": "MLCHECKPOINT_TCP_STREAMS"})
    replication_interface: str | None = field(default=None, metadata={"env": IFNAME_ENV})
    replication_bandwidth: int | str = field(default="auto", metadata={"env": BANDWIDTH_ENV})
    failure_domain: str | None = field(default=None, metadata={"env": FAILURE_DOMAIN_ENV})

    def __post_init__(self) -> None:
        validate_job_id(self.job_id)
        object.__setattr__(self, "keep", validate_keep(self.keep))
        if self.memory_limit_bytes is not None:
            object.__setattr__(self, "memory_limit_bytes",
                               resolve_memory_limit(self.memory_limit_bytes))
        if self.replication not in REPLICATION_MODES:
            raise ConfigError(f"replication={self.replication!r}: expected one of "
                              f"{', '.join(map(repr, REPLICATION_MODES))}")
        if self.replication_host is not None and (not isinstance(self.replication_host, str)
                                                  or not self.replication_host.strip()):
            raise ConfigError(f"replication_host={self.replication_host!r}: give an address "
                              "or host name, or leave it unset")
        timeout = self.replication_timeout
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not 0 < timeout < math.inf):
            raise ConfigError(f"replication_timeout={timeout!r}: expected a number of seconds > 0")
        streams = self.replication_streams
        if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= MAX_STREAMS:
            raise ConfigError(f"replication_streams={streams!r}: expected a whole number in "
                              f"1..{MAX_STREAMS}")
        interface = self.replication_interface
        if interface is not None and (not isinstance(interface, str) or not interface.strip()):
            raise ConfigError(f"replication_interface={interface!r}: give a network interface "
                              "name such as 'eth1' or 'ib0', or leave it unset")
        object.__setattr__(self, "replication_bandwidth",
                           parse_bandwidth(self.replication_bandwidth, "replication_bandwidth"))
        domain = self.failure_domain
        if domain is not None and (not isinstance(domain, str) or not domain.strip()
                                   or not domain.isprintable() or len(domain) > 256):
            raise ConfigError(f"failure_domain={domain!r}: give a name such as 'rack-12' "
                              "(printable, at most 256 characters), or leave it unset")

    @classmethod
    def resolve(cls, *, job_id: str | None = None, local_dir: str | None = None, keep: int = 2,
                memory_limit_bytes: int | str | None = None, replication: str = "tcp",
                replication_host: str | None = None, replication_timeout: float = 60.0,
                replication_streams: int | None = None,
                replication_bandwidth: int | str | None = None,
                replication_interface: str | None = None,
                failure_domain: str | None = None,
                derive_job_id_from: str | None = None) -> Options:
        """CheckpointManager's arguments, with what is left unset taken from the environment
        (``MLCHECKPOINT_*``, the launcher's job id) or its default. ``derive_job_id_from``:
        the persistent folder, which names the job when nothing else does."""
        keep = validate_keep(keep)
        check_environment()
        host, host_from = _argument_or_env(replication_host, "replication_host",
                                           "MLCHECKPOINT_REPLICATION_HOST")
        interface, interface_from = _argument_or_env(replication_interface,
                                                     "replication_interface", IFNAME_ENV)
        _check_listen_settings(host, host_from, interface, interface_from)
        return cls(
            job_id=resolve_job_id(job_id, derive_from=derive_job_id_from),
            local_dir=resolve_local_dir(local_dir),
            keep=keep,
            memory_limit_bytes=resolve_memory_limit(memory_limit_bytes),
            replication=replication,
            replication_host=host,
            replication_timeout=replication_timeout,
            replication_streams=(replication_streams if replication_streams is not None
                                 else default_streams()),
            replication_interface=interface,
            replication_bandwidth=resolve_bandwidth(replication_bandwidth),
            failure_domain=(failure_domain if failure_domain is not None
                            else env_str(FAILURE_DOMAIN_ENV) or slurm_failure_domain()))


def _argument_or_env(value: str | None, argument: str, variable: str) -> tuple[str | None, str]:
    """The argument, else the variable; and the name to put in an error about it."""
    if value is not None:
        return value, argument
    return env_str(variable), variable


def _check_listen_settings(host: str | None, host_from: str, interface: str | None,
                           interface_from: str) -> None:
    """The interface must exist and have an IPv4 address; with a host as well, the two must
    name the same address (else which one the listener binds would be a guess)."""
    if not isinstance(interface, str) or not interface.strip():
        return  # nothing to look up (a malformed argument is refused by __post_init__)
    address = network.interface_address(interface, interface_from)
    if isinstance(host, str) and host.strip():
        host_address = network.resolve_host(host, host_from)
        if host_address != address:
            raise ConfigError(
                f"{host_from}={host!r} ({host_address}) and {interface_from}={interface!r} "
                f"({address}) name different addresses for the replication listener: give one "
                "of them (the interface is usually what you mean)")


def check_environment() -> None:
    """Parse every process-wide variable now (each where it acts reads it the same way), so a
    bad value is a ConfigError at construction."""
    resolve_memory_limit()
    default_streams()
    default_min_stripe_bytes()
    copier.default_threads()
    checksum.native_enabled()
    _gc.enabled()
