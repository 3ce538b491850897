"""The kinds of state the DCP contract table round-trips (tests/dcp/test_tensor_kinds.py, and
tests/workers/subclass_fsdp.py on several ranks): each row builds a small state dict, and a
template of the same structure to load it into; ``contents`` turns a loaded state dict into
plain values to compare, inner tensors of a subclass and a quantized tensor's scales included.

Rows that need a library not installed, or a torchao config this CPU build cannot run, are
skipped with the reason (``Unavailable``), never passed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map_only


class Unavailable(Exception):
    """A row this machine cannot build: the reason is the skip's."""


# ---------------------------------------------------------------- our own wrapper subclass

class ScaledTensor(torch.Tensor):
    """A small wrapper subclass, as quantized weights are: no storage of its own, its value is
    ``_data * _scale`` (two inner tensors, ``__tensor_flatten__``). Ops that keep its structure
    (detach, copy_, narrow/split for sharding, ...) are applied to ``_data`` and return a
    ScaledTensor sharing ``_scale``; ``copy_`` copies both; others see the plain value."""

    _data: torch.Tensor
    _scale: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, tag: str = "scaled"):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=torch.float32, device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, tag: str = "scaled"):
        self._data, self._scale, self._tag = data, scale, tag

    def __tensor_flatten__(self):
        return ["_data", "_scale"], {"tag": self._tag}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return ScaledTensor(inner["_data"], inner["_scale"], ctx["tag"])

    def __repr__(self) -> str:
        return f"ScaledTensor({self._data}, scale={self._scale})"

    _KEEP: frozenset = frozenset()  # filled below, once torch.ops is importable

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(src, ScaledTensor):
                dst._data.copy_(src._data)
                dst._scale.copy_(src._scale)
            else:  # a plain value: store it with scale 1
                dst._data.copy_(src)
                dst._scale.fill_(1)
            return dst
        scaled = [a for a in args if isinstance(a, ScaledTensor)]
        if func in cls._KEEP:
            first = scaled[0]
            out = func(*tree_map_only(ScaledTensor, lambda t: t._data, args),
                       **tree_map_only(ScaledTensor, lambda t: t._data, kwargs))
            return tree_map_only(torch.Tensor, lambda t: type(first)(t, first._scale, first._tag), out)
        return func(*tree_map_only(ScaledTensor, lambda t: t._data * t._scale, args),
                    **tree_map_only(ScaledTensor, lambda t: t._data * t._scale, kwargs))


_aten = torch.ops.aten
ScaledTensor._KEEP = frozenset({
    _aten.detach.default, _aten.alias.default, _aten.clone.default, _aten._to_copy.default,
    _aten.narrow.default, _aten.slice.Tensor, _aten.split.Tensor, _aten.split_with_sizes.default,
    _aten.chunk.default, _aten.view.default, _aten.new_zeros.default, _aten.new_empty.default,
    _aten.empty_like.default, _aten.zeros_like.default, _aten.as_strided.default,
    _aten._unsafe_view.default, _aten.t.default, _aten.transpose.int})
torch.serialization.add_safe_globals([ScaledTensor])  # DCP's reader loads with weights_only


def scaled(seed: int, rows: int = 8, cols: int = 6) -> ScaledTensor:
    g = torch.Generator().manual_seed(seed)
    return ScaledTensor(torch.randn(rows, cols, generator=g), torch.rand((), generator=g) + 0.5)


# ---------------------------------------------------------------- what a value is, to compare

def _raw(t: torch.Tensor) -> bytes:
    """A plain tensor's elements, in order, as bytes (any dtype, any strides)."""
    t = t.detach().cpu()
    try:
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    except (RuntimeError, NotImplementedError):  # dtypes torch cannot copy (uint1..7, int1..7)
        if t.is_contiguous():
            start = t.storage_offset() * t.element_size()
            return bytes(t.untyped_storage())[start:start + t.nbytes]
        return repr(("strided", t.shape, t.stride(), t.storage_offset(),
                     bytes(t.untyped_storage()))).encode()


def contents(x: Any) -> Any:
    """Plain values that are equal exactly when two states are: a tensor's dtype, shape and
    bytes; a subclass's type, flatten context and inner tensors' contents; a quantized tensor's
    integer values, scheme and scales; a DTensor's local tensor and placement."""
    from torch.distributed.tensor import DTensor
    if isinstance(x, DTensor):
        return ("dtensor", tuple(x.shape), str(x.placements), contents(x._local_tensor))
    if isinstance(x, torch.Tensor):
        if type(x) not in (torch.Tensor, torch.nn.Parameter) and hasattr(x, "__tensor_flatten__"):
            names, ctx = x.__tensor_flatten__()
            return ("subclass", type(x).__qualname__, repr(ctx), tuple(x.shape),
                    {n: contents(getattr(x, n)) for n in names})
        if x.is_quantized:
            if x.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
                params: Any = (x.q_scale(), x.q_zero_point())
            else:
                params = (contents(x.q_per_channel_scales()),
                          contents(x.q_per_channel_zero_points()), x.q_per_channel_axis())
            return ("quantized", x.dtype, tuple(x.shape), str(x.qscheme()), params,
                    _raw(x.int_repr()))
        return ("tensor", x.dtype, tuple(x.shape), _raw(x))
    if isinstance(x, dict):
        return {k: contents(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(contents(v) for v in x)
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.shape, x.tobytes())
    return x


# ---------------------------------------------------------------- mutating, as training does

def mutate(x: Any) -> None:
    """Change every byte of every tensor in ``x`` in place (inner tensors of a subclass, the
    whole storage behind a view): what training does after a save returned."""
    if isinstance(x, dict):
        for v in x.values():
            mutate(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            mutate(v)
    elif isinstance(x, torch.Tensor):
        from torch.distributed.tensor import DTensor
        if isinstance(x, DTensor):
            mutate(x._local_tensor)
        elif type(x) not in (torch.Tensor, torch.nn.Parameter) and hasattr(x, "__tensor_flatten__"):
            for name in x.__tensor_flatten__()[0]:
                mutate(getattr(x, name))
        elif not x.is_quantized and x.numel():
            storage = x.untyped_storage()
            torch.empty(0, dtype=torch.uint8).set_(storage).bitwise_not_()


class Mutating(torch.optim.Optimizer):
    """An optimizer whose step changes every byte of its parameters: ``guard`` must have the
    snapshot taken before it runs."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        for group in self.param_groups:
            mutate(group["params"])


# ---------------------------------------------------------------- rows

Builder = Callable[[int, bool], dict]  # (seed, template) -> state dict


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _all_dtypes() -> list[torch.dtype]:
    found = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    quantized = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
    return sorted(found - quantized, key=str)  # quantized ones: the quantized rows


def _dtype_row(dtype: torch.dtype) -> Builder:
    def build(seed: int, template: bool) -> dict:
        raw = torch.randint(0, 256, (4 * 6 * dtype.itemsize,), dtype=torch.uint8, generator=_gen(seed))
        if dtype == torch.bool:
            raw &= 1  # a bool byte other than 0 or 1 is not a value (copies normalise it)
        return {"t": raw.view(dtype).reshape(4, 6), "scalar": raw[:dtype.itemsize].view(dtype).reshape(())}
    return build


def _views(seed: int, template: bool) -> dict:
    base = torch.randn(100, generator=_gen(seed))
    complex_base = torch.randn(6, 4, dtype=torch.complex64, generator=_gen(seed + 1))
    return {"offset": base[10:58].view(6, 8), "strided": base[1::3], "transposed": base[:48].view(6, 8).t(),
            "narrow": base.view(10, 10).narrow(1, 3, 4),
            "conj": complex_base.conj(), "empty": base[5:5]}


def _tied(seed: int, template: bool) -> dict:
    w = torch.randn(5, 4, generator=_gen(seed))
    base = torch.randn(12, generator=_gen(seed + 1))
    return {"embed": w, "head": w, "overlap_a": base[2:8], "overlap_b": base[4:]}


def _expanded(seed: int, template: bool) -> dict:
    row = torch.randn(1, 8, generator=_gen(seed))
    # DCP copies into the target: an expanded target would be written through one element
    return {"expanded": torch.zeros(4, 8) if template else row.expand(4, 8),
            "scalar_expanded": torch.zeros(3) if template else torch.tensor(2.5 + seed).expand(3)}


def _channels_last(seed: int, template: bool) -> dict:
    x = torch.randn(2, 3, 4, 5, generator=_gen(seed))
    return {"cl": x.to(memory_format=torch.channels_last),
            "cl3d": torch.randn(2, 3, 2, 4, 5, generator=_gen(seed + 1)).to(memory_format=torch.channels_last_3d)}


def _quantized(seed: int, template: bool) -> dict:
    g = _gen(seed)
    x = torch.randn(4, 6, generator=g)
    scales = torch.rand(4, generator=g, dtype=torch.float64) + 0.01
    zps = torch.randint(0, 10, (4,), generator=g)
    out = {f"per_tensor_{d}": torch.quantize_per_tensor(x, 0.05 + seed / 100, 3 + seed, d)
           for d in (torch.qint8, torch.quint8, torch.qint32)}
    out["per_channel_qint8"] = torch.quantize_per_channel(x, scales, zps * 0, 0, torch.qint8)
    out["per_channel_quint8"] = torch.quantize_per_channel(x, scales, zps, 0, torch.quint8)
    return out


def _quint4x2(seed: int, template: bool) -> dict:  # DCP's load cannot copy_ it
    x = torch.randn(4, 6, generator=_gen(seed))
    return {"q": torch.quantize_per_tensor(x, 0.1 + seed / 100, 1 + seed, torch.quint4x2)}


def _containers(seed: int, template: bool) -> dict:
    r = np.random.default_rng(seed)
    return {"cfg": {"none": None if not template else 0, "name": f"run-{seed}", "raw": bytes([seed, 255, 0]),
                    "array": r.standard_normal((3, 2)).astype(np.float32), "ints": np.arange(seed, seed + 4),
                    "np_scalar": np.float64(seed + 0.5), "nested": [seed, (seed + 1, "x"), {"k": [None, b"b"]}]},
            "w": torch.randn(3, generator=_gen(seed)), "lst": [torch.randn(2, generator=_gen(seed + 1)), "s"]}


def _scaled(seed: int, template: bool) -> dict:
    return {"w": scaled(seed), "plain": torch.randn(4, generator=_gen(seed))}


def _torchao(fn: Callable[[int], dict]) -> Builder:
    """A row built with torchao: Unavailable (its reason) when it is missing, or when this
    CPU build cannot run the config."""
    @functools.wraps(fn)
    def build(seed: int, template: bool) -> dict:
        try:
            import torchao  # noqa: F401
        except ImportError as e:
            raise Unavailable(f"torchao is not installed: {e}") from e
        try:
            return fn(seed)
        except Exception as e:
            raise Unavailable(f"torchao cannot build this row on this machine: {e!r}") from e
    return build


@_torchao
def _float8_fsdp_weight(seed: int) -> dict:
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    w = torch.randn(16, 8, generator=_gen(seed))
    param = torch.nn.Parameter(WeightWithDynamicFloat8CastTensor(w, LinearMMConfig(), torch.float8_e4m3fn))
    return {"layer.weight": param, "layer.bias": torch.randn(16, generator=_gen(seed + 1))}


def _quantized_linear(config: Callable[[], Any], dtype: torch.dtype = torch.float32) -> Callable[[int], dict]:
    def build(seed: int) -> dict:
        from torchao.quantization import quantize_
        torch.manual_seed(seed)
        lin = torch.nn.Linear(64, 16).to(dtype)
        quantize_(lin, config())
        return dict(lin.state_dict())
    return build


def _config(name: str, **kw: Any) -> Callable[[], Any]:
    def make():
        import torchao.quantization as q
        return getattr(q, name)(**kw)
    return make


@_torchao
def _nf4(seed: int) -> dict:
    from torchao.quantization import to_nf4
    return {"w": to_nf4(torch.randn(64, 256, generator=_gen(seed)).to(torch.bfloat16))}


ROWS: dict[str, Builder] = {
    "torchao_float8_fsdp_weight": _float8_fsdp_weight,
    "torchao_int8_weight_only": _torchao(_quantized_linear(_config("Int8WeightOnlyConfig"))),
    "torchao_int8_weight_only_bf16": _torchao(_quantized_linear(_config("Int8WeightOnlyConfig"), torch.bfloat16)),
    "torchao_int4_weight_only": _torchao(_quantized_linear(_config("Int4WeightOnlyConfig", group_size=32),
                                                           torch.bfloat16)),
    "torchao_float8_weight_only": _torchao(_quantized_linear(_config("Float8WeightOnlyConfig"))),
    "torchao_nf4": _nf4,
    "own_wrapper_subclass": _scaled,
    "views": _views,
    "tied": _tied,
    "expanded": _expanded,
    "channels_last": _channels_last,
    "quantized": _quantized,
    "quantized_quint4x2": _quint4x2,
    "containers": _containers,
    **{f"dtype_{str(d).removeprefix('torch.')}": _dtype_row(d) for d in _all_dtypes()},
}
SUBCLASS_ROWS = [name for name in ROWS if name.startswith(("torchao_", "own_"))]


def build(name: str, seed: int, template: bool = False) -> dict:
    """Row ``name``'s state dict (``template``: one to load into)."""
    return ROWS[name](seed, template)
