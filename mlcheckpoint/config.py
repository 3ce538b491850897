"""Where a job's checkpoints live: job id and local directory resolution."""

from __future__ import annotations

import os
import re

from .errors import ConfigError

DEFAULT_LOCAL_DIR = "/dev/shm/mlcheckpoint"
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_job_id(job_id: str) -> str:
    """A job id becomes a directory name: allow only a safe, path-free alphabet."""
    if not isinstance(job_id, str) or not _JOB_ID_RE.match(job_id) or job_id in (".", ".."):
        raise ConfigError(
            f"invalid job id {job_id!r}: use 1-128 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    return job_id


def resolve_job_id(job_id: str | None = None) -> str:
    """Explicit argument, else MLCHECKPOINT_JOB_ID, TORCHELASTIC_RUN_ID, SLURM_JOB_ID."""
    if job_id is not None:
        return validate_job_id(str(job_id))
    for var in ("MLCHECKPOINT_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(var)
        # torchrun sets TORCHELASTIC_RUN_ID=none when --rdzv-id is not given.
        if value and not (var == "TORCHELASTIC_RUN_ID" and value == "none"):
            return validate_job_id(value)
    raise ConfigError(
        "no job id: pass CheckpointManager(job_id=...), set MLCHECKPOINT_JOB_ID, or launch with "
        "torchrun --rdzv-id=<id> (TORCHELASTIC_RUN_ID) or under SLURM (SLURM_JOB_ID). The id must "
        "stay the same across restarts of the job so the restarted job finds its checkpoints."
    )


def resolve_local_dir(local_dir: str | os.PathLike | None = None) -> str:
    """Explicit argument, else MLCHECKPOINT_LOCAL_DIR, else /dev/shm/mlcheckpoint."""
    if local_dir is None:
        local_dir = os.environ.get("MLCHECKPOINT_LOCAL_DIR") or DEFAULT_LOCAL_DIR
    return os.path.abspath(os.fspath(local_dir))
