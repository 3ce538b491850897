"""Copy a state dict straight into a tmpfs shard buffer (the AsyncStager half of the writer)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from ..store import copier
from ..store.local_store import align

Leaf = torch.Tensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def plain_cpu(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be copied raw from its address."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


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


def stage_into(obj: Any, buffer_tensor: torch.Tensor) -> tuple[Any, dict[int, tuple[int, int]]]:
    """Return a copy of ``obj`` whose tensors are views of ``buffer_tensor`` (uint8), and the
    checksums taken on the way: {offset in the buffer: (nbytes, checksum)}.

    Tensors keep dtype, shape and DTensor sharding; other leaves are deep-copied so that
    training may mutate the originals once this returns. Contiguous CPU tensors go through the
    copier (checksummed in the same pass, so the commit need not read them again). Others are
    copied by torch and hashed later: GPU tensors with non_blocking=True into the (page-locked)
    buffer, synchronised once at the end.
    """
    offset, base = 0, buffer_tensor.data_ptr()
    on_device = False
    spans: list[copier.Span] = []

    def stage(t: torch.Tensor) -> torch.Tensor:
        nonlocal offset, on_device
        local = _local(t).detach()
        n = local.numel() * local.element_size()
        dst = buffer_tensor[offset:offset + n].view(local.dtype).view(local.shape)
        if plain_cpu(local):
            spans.append(copier.Span(src=local.data_ptr(), nbytes=n, dst=base + offset))
        else:
            on_device |= local.device.type != "cpu"
            dst.copy_(local, non_blocking=local.device.type != "cpu")
        offset += align(n)
        if isinstance(t, DTensor):
            return DTensor(dst, t._spec, requires_grad=False)
        return dst

    staged = _walk(obj, stage)  # the sources stay alive: ``obj`` holds them
    digests = copier.process(spans)
    if on_device:
        torch.accelerator.synchronize()
    return staged, {s.dst - base: (s.nbytes, d) for s, d in zip(spans, digests)}


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
