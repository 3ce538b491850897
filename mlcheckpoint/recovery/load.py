"""The load itself: ``dcp.load`` on the checkpoint group, with DCP's error wrapping undone."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageReader

from .._gc import gc_paused
from ..dcp.errors import unwrap_checkpoint_exception


def load_step(state_dict: dict[str, Any], reader: StorageReader,
              group: dist.ProcessGroup | None) -> None:
    """Load into ``state_dict`` (in place) with ``dcp.load`` on ``group`` (the checkpoint
    group, never the training group). Our errors (e.g. CorruptShardError naming the bad copy)
    come out as themselves, whichever rank raised them."""
    try:
        with gc_paused():
            dcp.load(state_dict, storage_reader=reader, process_group=group)
    except CheckpointException as e:
        raise unwrap_checkpoint_exception(e, "load") from None
