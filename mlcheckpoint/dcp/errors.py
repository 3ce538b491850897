"""DCP's exception wrapping, undone: one home for the save and the load paths; the one
wording of a failed save, which every rank raises alike; and the one wording of a state dict
entry that cannot be saved."""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch.distributed.checkpoint.api import CheckpointException

from ..errors import MLCheckpointError, StateDictError


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


def save_failure(e: CheckpointException, what: str, node_of: Callable[[int], int]
                 ) -> BaseException:
    """The error every rank raises for a save that failed on some ranks. DCP hands every rank
    the same CheckpointException (every rank's failure, by rank), so this is the same on every
    rank: ours (e.g. CapacityError) as itself, with ``what`` and the rank and node that hit it
    (``node_of``) in front of its message; anything else as ``unwrap_checkpoint_exception``."""
    ranks = sorted(e.failures)
    for rank in ranks:
        failure = e.failures[rank]
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, MLCheckpointError):
            others = [r for r in ranks if r != rank]
            also = f" (and on {_ranks_text(others)})" if others else ""
            # Of the same type (a CapacityError is caught as one on every rank); our errors
            # copy through their __reduce__, as DCP pickles them.
            named = copy.copy(exc)
            named.args = (f"{what} failed on rank {rank} (node {node_of(rank)}){also}: {exc}",
                          *exc.args[1:])
            return named
    return unwrap_checkpoint_exception(e, what)


def _ranks_text(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


_UNKNOWN = object()


def entry_error(key: str, cause: BaseException, value: object = _UNKNOWN) -> StateDictError:
    """The error of a save that fails on one entry of the state dict (pickling or copying a
    value that is not a tensor): it names the entry's flattened key and its type."""
    kind = "value of unknown type"
    if value is not _UNKNOWN:
        cls = type(value)
        kind = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return StateDictError(
        f"cannot save state dict entry {key!r} ({kind}): {type(cause).__name__}: {cause}. "
        "Entries that are not tensors are pickled: remove this one from the state dict, or "
        "save something it can be rebuilt from (a name, its settings) instead",
        key=key, type_name=kind)
