"""The one collective of our own, outside DCP's: an all_gather of small Python objects, through
which ranks agree (the run's identity, the claim of the job directory, a save's outcome, a
resume's plan). It runs on the checkpoint group, never the training group, so it cannot
interleave with training's collectives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Comm:
    """``all_gather`` on ``group``; None: no process group, this process alone."""

    group: dist.ProcessGroup | None

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (collective on the group)."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out
