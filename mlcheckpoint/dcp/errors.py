"""DCP's exception wrapping, undone: one home for the save and the load paths."""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException

from ..errors import MLCheckpointError


def unwrap_checkpoint_exception(e: CheckpointException, what: str) -> BaseException:
    """DCP wraps per-rank errors in one CheckpointException; surface ours (e.g.
    CapacityError, CorruptShardError with the copy it names) as themselves, and anything else
    as an MLCheckpointError naming ``what`` and the failed ranks."""
    for _, failure in sorted(e.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, MLCheckpointError) or not isinstance(exc, Exception):
            return exc  # ours, or an interrupt (KeyboardInterrupt, SystemExit): as it was
    first = next(iter(e.failures.values()), None)
    cause = first[0] if isinstance(first, tuple) else first
    return MLCheckpointError(f"{what} failed on ranks {sorted(e.failures)}: {cause!r}")
