"""Which tensors a stage copies: the ones DCP's plan will give this rank.

DCP decides which rank writes each item (and de-duplicates tensors that several ranks hold,
e.g. DDP's replicated model) only inside ``dcp.save``, while planning; an overlapped stage
starts copying before that. So a stage predicts the plan: the items this rank wrote the last
time it saved a state dict of the same structure (every key, and each tensor's shape, dtype,
device type and DTensor placements). DCP's de-duplication is a deterministic function of
every rank's structure, so in a steady loop the prediction holds step after step.

``MemoryStorageWriter.write_data`` checks the prediction against the final plan: a planned
tensor that was not staged is copied there (correct, not overlapped), a staged one that is
not planned is dropped from the shard (``Placement.keep_planned``), and the final plan is
learnt for the next save (``PlanCache.learn``). The first save of a structure has no
prediction: it stages everything, and ``keep_planned`` trims what the plan left out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

# Structures remembered per manager: a loop alternating between a few (e.g. with and without
# an extra entry at some steps) keeps each one's plan.
CACHED_STRUCTURES = 4


@dataclass(frozen=True)
class Prediction:
    """The stage's guess at this rank's plan for one state dict.

    ``key`` names the state dict's structure; ``planned`` holds the ids of the tensor objects
    (leaves of that state dict) predicted to be written by this rank, or is None when there
    is no prediction (every tensor counts as planned).
    """

    key: Hashable
    planned: frozenset[int] | None

    def wanted(self, leaf: torch.Tensor) -> bool:
        """Whether ``leaf`` (a tensor object of the state dict) is predicted planned."""
        return self.planned is None or id(leaf) in self.planned


NO_PREDICTION = Prediction(key=None, planned=None)


def structure(flat: dict[str, Any]) -> Hashable:
    """The parts of a flattened state dict that DCP's plan depends on."""
    out: list[tuple] = []
    for fqn, v in flat.items():
        if isinstance(v, torch.Tensor):
            placements = str(v.placements) if isinstance(v, DTensor) else ""
            out.append((fqn, tuple(v.shape), str(v.dtype), v.device.type, placements))
        else:
            out.append((fqn, type(v).__name__))
    return tuple(out)


class PlanCache:
    """The tensor items this rank wrote, per state-dict structure (one per manager: its
    ``Snapshotter`` holds it). Thread-safe: stages run on the training thread, ``learn`` on
    the save thread."""

    def __init__(self, predicting: bool = True) -> None:
        # False for a rank that saves alone: DCP's plan gives it every item, so there is
        # nothing to predict, and none of the prediction's cost on the training thread
        # (flattening and keying the state dict: ~2 ms for 900 tensors).
        self.predicting = predicting
        self._lock = threading.Lock()
        self._planned: OrderedDict[Hashable, frozenset[str]] = OrderedDict()

    def predict(self, state_dict: dict[str, Any]) -> Prediction:
        """The prediction for ``state_dict`` (already free of Stateful objects)."""
        if not self.predicting:
            return NO_PREDICTION
        flat, _ = flatten_state_dict(state_dict)
        key = structure(flat)
        with self._lock:
            fqns = self._planned.get(key)
            if fqns is not None:
                self._planned.move_to_end(key)
        if fqns is None:
            return Prediction(key, None)
        # A tensor object may sit under several keys (tied weights): planned if any one is.
        return Prediction(key, frozenset(id(v) for fqn, v in flat.items()
                                         if fqn in fqns and isinstance(v, torch.Tensor)))

    def learn(self, key: Hashable, plan: SavePlan, kept: Iterable[WriteItem] = ()) -> None:
        """Remember the tensor items of ``plan`` (this rank's final plan) and of the copies it
        ``kept`` (``copies.py``) for ``key``."""
        if key is None:
            return
        fqns = frozenset(item.index.fqn for item in (*plan.items, *kept)
                         if item.type != WriteItemType.BYTE_IO)
        with self._lock:
            self._planned[key] = fqns
            self._planned.move_to_end(key)
            while len(self._planned) > CACHED_STRUCTURES:
                self._planned.popitem(last=False)
