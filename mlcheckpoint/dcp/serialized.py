"""DCP's own route for a tensor whose bytes cannot be copied raw (``copier.raw_copyable``):
tensor subclasses (float8 FSDP weights, quantized weight tensors), quantized, sparse tensors.

Such an item is stored as the bytes DCP's FileSystemWriter writes for it (``torch.save`` of
the tensor the planner resolved, on the CPU, compacted), checksummed like every other item,
and loaded as FileSystemReader loads it: ``torch.load`` with ``weights_only=True``, narrowed
to the requested chunk, copied into the target with ``Tensor.copy_``. The subclass's own
``__reduce_ex__``/``__tensor_flatten__`` and ``copy_`` decide what its value is, as in DCP;
its metadata stays DCP's (ItemLocation.is_tensor is False: the bytes are not raw).
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ..errors import CorruptShardError, StateDictError


def _unsupported(key: str, t: torch.Tensor, e: BaseException) -> StateDictError:
    kind = f"{type(t).__module__}.{type(t).__qualname__}"
    return StateDictError(
        f"cannot checkpoint {key!r}: a {kind} (dtype {t.dtype}, layout {t.layout}) is not a "
        f"plain tensor, and torch.save, which DCP uses for such tensors, failed on it: {e!r}. "
        "Save a plain tensor in its place (e.g. the subclass's inner tensors), or make the "
        "subclass picklable (__reduce_ex__, or __tensor_flatten__ with its safe globals added); "
        "nothing was committed for this step", key=key, type_name=kind)


def serialize(t: torch.Tensor, key: str) -> bytes:
    """The bytes DCP's FileSystemWriter writes for ``t`` (already resolved by the planner)."""
    try:
        t = t.detach().cpu()
        if _storage_nbytes(t) != t.nbytes:  # as DCP: a view of a larger storage is compacted
            t = t.clone()
        out = io.BytesIO()
        torch.save(t, out)
    except Exception as e:
        raise _unsupported(key, t, e) from e
    return out.getvalue()


def _storage_nbytes(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # sparse tensors have no single storage
        return None


def snapshot(t: torch.Tensor, key: str) -> torch.Tensor:
    """A copy of ``t`` taken now, through DCP's serialization (exact at the call: the training
    may change ``t`` right after). It is what a stage hands to DCP for this item."""
    raw = serialize(t, key)
    # Our own bytes, made just now in this process: not a load of untrusted data.
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)


def load_into(planner: LoadPlanner, req: ReadItem, raw: Any) -> None:
    """Load a verified item stored by ``serialize`` into the planner's target, as
    FileSystemReader does."""
    tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise CorruptShardError(f"item {req.storage_index.fqn!r} holds {tuple(tensor.size())}, "
                                f"the load asks for {tuple(target.size())}")
    target.copy_(tensor)
    planner.commit_tensor(req, target)
