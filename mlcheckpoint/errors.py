"""Exceptions users may catch."""

from __future__ import annotations

from typing import NamedTuple


class CopyId(NamedTuple):
    """One copy of a checkpoint's bytes: ``owner``'s shard of ``step`` (None: the step's
    metadata) on ``node``. An integrity error names it; recovery refuses a bad copy alone and
    reads another."""

    step: int
    owner: int | None
    node: int | None


class MLCheckpointError(RuntimeError):
    """Base class of every error raised by mlcheckpoint."""


class ConfigError(MLCheckpointError):
    """A missing or invalid setting (job id, directory, option)."""


class JobDirInUseError(ConfigError):
    """Another live run holds this job's directory on a node: two jobs launched with one job id
    and one ``local_dir``. Raised by ``CheckpointManager(...)`` on every rank of the second run,
    before anything in the directory is changed. The message names the other run (host, pids,
    when it started, its persistent_dir) and the settings that keep two jobs apart."""


class JobDirGoneError(MLCheckpointError):
    """The job's directory on this node was removed while a run used it (an operator's
    ``rm -r``, a cleanup of ``local_dir``, a restarted container): in-memory saves fail on
    every rank with this error until the job restarts; the persistent checkpoints asked for
    are still written."""


class CapacityError(MLCheckpointError):
    """A save does not fit into tmpfs or into ``memory_limit_bytes``.

    Raised before anything is written: every committed checkpoint is intact and training
    can catch it and carry on.
    """

    def __init__(self, message: str, *, needed: int, available: int):
        super().__init__(message)
        self.needed = needed
        self.available = available

    def __reduce__(self):  # survives DCP's gathering of exceptions across ranks
        return (_capacity_error, (type(self), str(self), self.needed, self.available))


class CorruptShardError(MLCheckpointError):
    """Bytes on tmpfs do not match the checksum recorded when they were committed.

    ``copy`` names the bad copy (``CopyId``: step, owner rank, node) when
    known, so recovery can refuse that copy alone and use another.
    """

    def __init__(self, message: str, copy: CopyId | None = None):
        super().__init__(message)
        self.copy = copy

    def __reduce__(self):  # survives DCP's gathering of exceptions across ranks
        return (type(self), (str(self), self.copy))


class StagingError(MLCheckpointError):
    """An overlapped save could not take its snapshot exactly (a tensor was resized or
    replaced before it was copied, or the manager closed while it was being taken). The step
    is not committed on any rank; the previous one stays resumable."""


class StateDictError(MLCheckpointError):
    """An entry of the state dict cannot be saved: a value that is not a tensor must pickle,
    and this one does not (a lambda, a lock, an open file...), or a tensor that is not a plain
    tensor (a subclass) which torch.save, as DCP uses it for such tensors, cannot serialize. ``key`` is the entry's flattened
    key, as DCP names it (``"optim.param_groups.0.fn"``), ``type_name`` the type of its value.
    The step is not committed on any rank; the steps committed before it are untouched."""

    def __init__(self, message: str, key: str = "", type_name: str = ""):
        super().__init__(message)
        self.key = key
        self.type_name = type_name

    def __reduce__(self):  # survives DCP's gathering of exceptions across ranks
        return (type(self), (str(self), self.key, self.type_name))


class ShardNotFoundError(MLCheckpointError):
    """A shard or the global metadata of a step is not present (or not committed)."""


class ReplicationError(MLCheckpointError):
    """A push or fetch failed (peer gone, timed out, refused, or bytes failed verification)."""


class ProtocolError(ReplicationError):
    """A peer broke the replication protocol, failed authentication or timed out."""


def _capacity_error(cls: type, message: str, needed: int, available: int) -> CapacityError:
    return cls(message, needed=needed, available=available)
