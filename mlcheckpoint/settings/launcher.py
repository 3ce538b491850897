"""What the launcher says about this process (``Launcher``: torchrun, SLURM, env:// init), and
the job id: given, named by the launcher, or derived from the persistent folder."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

from ..errors import ConfigError
from .declared import BY_NAME, SETTINGS, default, validate_job_id, variable_text

log = logging.getLogger(__name__)


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
    given; replication/core/rendezvous.py parses and checks them."""
    return BY_NAME["secret"].from_env(), BY_NAME["secret_file"].from_env()


# ---------------------------------------------------------------- the job id

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
