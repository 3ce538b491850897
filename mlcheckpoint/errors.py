"""Exceptions users may catch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .integrity.verify import CopyId


class MLCheckpointError(RuntimeError):
    """Base class of every error raised by mlcheckpoint."""


class ConfigError(MLCheckpointError):
    """A missing or invalid setting (job id, directory, option)."""


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

    ``copy`` names the bad copy (``integrity.verify.CopyId``: step, owner rank, node) when
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


class UnsupportedStateError(MLCheckpointError):
    """A state dict value that cannot be checkpointed as DCP checkpoints it (e.g. a tensor
    subclass that torch.save cannot serialize). The message names the key, the type and what
    to do. Raised before the step commits; committed steps are untouched."""


class ShardNotFoundError(MLCheckpointError):
    """A shard or the global metadata of a step is not present (or not committed)."""


class ReplicationError(MLCheckpointError):
    """A push or fetch failed (peer gone, timed out, refused, or bytes failed verification)."""


class ProtocolError(ReplicationError):
    """A peer broke the replication protocol, failed authentication or timed out."""


def _capacity_error(cls: type, message: str, needed: int, available: int) -> CapacityError:
    return cls(message, needed=needed, available=available)
