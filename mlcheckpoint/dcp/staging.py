"""Copy a state dict straight into a tmpfs shard buffer (the AsyncStager half of the writer)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from ..store.local_store import align

Leaf = torch.Tensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor leaf (DTensor: its local shard) of a nested dict/list/tuple, in order
    (the same order ``stage_into`` lays them out). Copies nothing."""
    if isinstance(obj, torch.Tensor):
        return [_local(obj)]
    if isinstance(obj, dict):
        obj = obj.values()
    elif not isinstance(obj, (list, tuple)) or hasattr(obj, "_fields"):
        return []
    return [t for v in obj for t in tensors_of(v)]


def staged_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(align(t.numel() * t.element_size()) for t in tensors)


def stage_into(obj: Any, buffer_tensor: torch.Tensor) -> Any:
    """Return a copy of ``obj`` whose tensors are views of ``buffer_tensor`` (uint8).

    Tensors keep dtype, shape and DTensor sharding; other leaves are deep-copied so that
    training may mutate the originals once this returns. GPU tensors are copied with
    non_blocking=True into the (page-locked) buffer and synchronised once at the end.
    """
    offset = 0
    on_device = False

    def stage(t: torch.Tensor) -> torch.Tensor:
        nonlocal offset, on_device
        local = _local(t).detach()
        n = local.numel() * local.element_size()
        dst = buffer_tensor[offset:offset + n].view(local.dtype).view(local.shape)
        offset += align(n)
        on_device |= local.device.type != "cpu"
        dst.copy_(local, non_blocking=local.device.type != "cpu")
        if isinstance(t, DTensor):
            return DTensor(dst, t._spec, requires_grad=False)
        return dst

    staged = _walk(obj, stage)
    if on_device:
        torch.accelerator.synchronize()
    return staged


def _walk(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):  # a plain dict whatever the mapping type: DCP only needs Mapping
        return {k: _walk(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_walk(v, fn) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_walk(v, fn) for v in obj)
    return copy.deepcopy(obj)
