"""wsum64 (integrity/wsum.py): the device's tensor-op engine, run here on CPU tensors, gives the
host's C engine's value (and numpy's, and the definition's written out in Python) for every
dtype, size and layout; a flipped bit anywhere and chunks in another order change it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import peak_cpu_allocation

from mlcheckpoint.integrity import digests, wsum

CHUNK = wsum.CHUNK_BYTES
ROW = wsum.ROW_BYTES
MASK = (1 << 64) - 1
C_BUILT = wsum.native_wsum_copy is not None


@pytest.fixture(params=["c", "numpy"])
def host_engine(request, monkeypatch):
    """Run the test with the C engine, then with numpy's."""
    if request.param == "c":
        if not C_BUILT:
            pytest.skip("the C engine was not built here (no C compiler at install)")
    else:
        monkeypatch.setattr(wsum, "_native", None)
        monkeypatch.setattr(wsum, "native_wsum_copy", None)
    return request.param


def fmix(z: int) -> int:
    z ^= z >> 33
    z = (z * 0xFF51AFD7ED558CCD) & MASK
    z ^= z >> 33
    z = (z * 0xC4CEB9FE1A85EC53) & MASK
    return z ^ (z >> 33)


def definition(data: bytes) -> int:
    """The module docstring's formula, written out with Python integers (slow: small inputs)."""
    n = len(data)
    words = np.frombuffer(data + bytes(-n % 4), dtype=np.int32).tolist()
    w = [int(x) for x in wsum.COLUMN_WEIGHTS]
    u = [int(x) for x in wsum.ROW_WEIGHTS]
    total = 0
    for c in range(max(1, -(-n // CHUNK))):
        s = 0
        for r in range(wsum.ROWS_PER_CHUNK):
            row = words[c * wsum.CHUNK_WORDS + r * wsum.ROW_WORDS:][:wsum.ROW_WORDS]
            s += u[r] * sum(v * w[j] for j, v in enumerate(row))
        total += fmix((s + (c + 1) * wsum.K_CHUNK) & MASK)
    return fmix((total + fmix(n ^ wsum.K_LENGTH)) & MASK)


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def host(data: np.ndarray) -> int:
    return wsum.digest_at(data.ctypes.data, data.nbytes)


def device(*tensors: torch.Tensor) -> list[int]:
    """The tensor-op engine (what the GPU runs), here on CPU tensors."""
    return wsum.to_unsigned(wsum.tensor_digests(list(tensors)))


def stored_bytes(t: torch.Tensor) -> np.ndarray:
    """What a save stores of ``t``: its values, contiguous, row-major."""
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy()


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 1000, ROW - 1, ROW, ROW + 1, 3 * ROW + 2])
def test_both_engines_follow_the_definition(n, host_engine):
    data = random_bytes(n, n)
    want = definition(data.tobytes())
    assert host(data) == want
    assert device(torch.from_numpy(data.copy())) == [want]


SIZES = [0, 1, 3, ROW - 4, ROW + 4, wsum.PACK_BELOW - 1, wsum.PACK_BELOW, wsum.PACK_BELOW + 3,
         CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + ROW + 5]


@pytest.mark.parametrize("n", SIZES)
def test_device_engine_equals_host_engine_at_row_chunk_and_packing_boundaries(n, host_engine):
    data = random_bytes(n, n + 1)
    assert device(torch.from_numpy(data.copy())) == [host(data)]


def dtype_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "bool": torch.rand(1001, generator=g) > 0.5,
        "uint8": torch.randint(0, 256, (333,), dtype=torch.uint8, generator=g),
        "int8": torch.randint(-128, 128, (77, 3), dtype=torch.int8, generator=g),
        "int16": torch.randint(-1000, 1000, (513,), dtype=torch.int16, generator=g),
        "int32": torch.randint(-2**31, 2**31 - 1, (70000,), dtype=torch.int32, generator=g),
        "int64": torch.randint(-2**62, 2**62, (1025,), dtype=torch.int64, generator=g),
        "float16": torch.randn(301, 7, generator=g).half(),
        "bfloat16": torch.randn(1 << 20 | 1, generator=g).bfloat16(),
        "float32": torch.randn(600, 1000, generator=g),
        "float64": torch.randn(99, generator=g).double(),
        "complex64": torch.randn(257, dtype=torch.complex64, generator=g),
        "complex128": torch.randn(33, 2, dtype=torch.complex128, generator=g),
    }
    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            out[name] = torch.randint(0, 120, (4099,), dtype=torch.uint8, generator=g).view(torch.int8) \
                .to(torch.float32).to(dtype) if name.startswith("float8") else \
                torch.randint(0, 1 << 15, (515,), generator=g).to(dtype)
    return out


def test_every_dtype_gives_the_host_value_alone_and_in_one_batch(host_engine):
    tensors = dtype_tensors()
    assert {"float8_e4m3fn", "float8_e5m2"} <= set(tensors) or not hasattr(torch, "float8_e4m3fn")
    want = [host(stored_bytes(t)) for t in tensors.values()]
    assert [device(t)[0] for t in tensors.values()] == want
    assert device(*tensors.values()) == want  # one batch: packed and in-place rows, mixed


def test_non_contiguous_and_lazily_transformed_tensors_digest_as_stored():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(900, 700, generator=g)
    c = torch.randn(300, 40, dtype=torch.complex64, generator=g)
    views = {
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "column": base[:, 5],
        "expanded": torch.randn(1, 700, generator=g).expand(50, 700),
        "conjugated": c.conj(),
        "negated": c.conj().imag,  # a negative view
        "narrowed bytes": torch.from_numpy(random_bytes(CHUNK + 9))[3:],  # an odd offset
        "narrowed bf16": torch.randn(5000, generator=g).bfloat16()[1:],
    }
    want = [host(stored_bytes(t)) for t in views.values()]
    assert device(*views.values()) == want
    for t, w in zip(views.values(), want):
        assert device(t) == [w]


def test_strided_items_in_pieces_across_packing_buffers_and_groups(monkeypatch):
    """A strided item is copied into the packing buffer a piece at a time and its rows can
    straddle two fills of the buffer; items are digested in groups: none of it shows."""
    monkeypatch.setattr(wsum, "BLOCK_BYTES", 4 * ROW)
    monkeypatch.setattr(wsum, "PIECE_BYTES", ROW + 12)
    monkeypatch.setattr(wsum, "GROUP_BYTES", 3 * ROW)
    g = torch.Generator().manual_seed(2)
    items = [torch.randn(33, 301, generator=g).t(),  # rows of 132 bytes: pieces cut rows
             torch.from_numpy(random_bytes(5 * ROW + 3, 7)),
             torch.randn(4, 7, 250, dtype=torch.complex64, generator=g).transpose(0, 2).conj(),
             torch.randn(3, generator=g)[::2],
             torch.from_numpy(random_bytes(3 * ROW, 8))[1:],  # misaligned: packed
             torch.randn(2 * wsum.PACK_BELOW // 4 + 5, generator=g),  # read in place, then its tail
             *(torch.from_numpy(random_bytes(100 + k, k)) for k in range(9))]  # queued, copied together
    want = [host(stored_bytes(t)) for t in items]
    assert device(*items) == want
    assert [device(t)[0] for t in items] == want


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="no fp4 in this torch")
def test_a_strided_tensor_of_a_dtype_torch_cannot_copy_digests_as_stored():
    """fp4 (two values a byte) has no copy kernel: a strided one is copied as its bits."""
    raw = torch.from_numpy(random_bytes(40 * 3333, 9)).view(40, 3333)
    for pick in (lambda x: x.t(), lambda x: x[::3, 1::2]):
        want = pick(raw).contiguous().reshape(-1).numpy()
        assert device(pick(raw.view(torch.float4_e2m1fn_x2))) == [host(want)]


MiB = 1 << 20
# What docs/performance.md states: a state of items of at most 1 GiB each.
DIGEST_SCRATCH_BOUND = 72 * MiB


@pytest.mark.parametrize("case", ["one large", "many small", "transposed", "conjugated",
                                  "many small strided"])
def test_the_digest_adds_at_most_a_fixed_scratch_whatever_the_layout(case):
    """The extra memory the device checksum takes beside a state it digests (measured on the
    CPU, with torch's allocator's own accounting): a fixed scratch, not a copy of the state,
    nor two packing blocks at once (a job runs at 95% of its GPU's memory)."""
    g = torch.Generator().manual_seed(3)
    items = {
        "one large": lambda: [torch.randn(24 * MiB, generator=g)],
        "many small": lambda: [torch.randn(MiB // 4 - 1000, generator=g) for _ in range(150)],
        "transposed": lambda: [torch.randn(3072, 8192, generator=g).t()],
        "conjugated": lambda: [torch.randn(6 * MiB, dtype=torch.complex64, generator=g).conj()],
        "many small strided": lambda: [torch.randn(250, 1000, generator=g).t() for _ in range(100)],
    }[case]()
    extra = peak_cpu_allocation(lambda: wsum.tensor_digests(items))
    state = sum(t.numel() * t.element_size() for t in items)
    assert extra <= DIGEST_SCRATCH_BOUND, f"{case}: {extra / MiB:.1f} MiB beside {state / MiB:.0f} MiB"
    assert extra <= wsum.scratch_bytes(items) <= DIGEST_SCRATCH_BOUND


def test_streaming_in_any_pieces_equals_one_shot(host_engine):
    small, large = random_bytes(2 * ROW + 7, 4), random_bytes(2 * CHUNK + 4097, 5)
    for data, pieces in ((small, (1, 3, 4, 5, ROW - 1)), (large, (4093, 1 << 20, CHUNK + 1, large.size))):
        want = host(data)
        for piece in pieces:
            s = wsum.StreamingWsum()
            for i in range(0, data.size, piece):
                s.update(data[i:i + piece])
            assert s.digest() == want, piece
    empty = wsum.StreamingWsum()
    empty.update(b"")
    assert empty.digest() == host(np.empty(0, np.uint8))


@pytest.mark.parametrize("n", [1, 7, 300])
def test_every_single_bit_flip_changes_the_digest(n, host_engine):
    """Exhaustive over every bit of a small buffer (the module docstring proves it for any)."""
    data = random_bytes(n, 7)
    want = host(data)
    flipped = data.copy()
    changed = 0
    for byte in range(n):
        for bit in range(8):
            flipped[byte] ^= 1 << bit
            changed += host(flipped) != want
            flipped[byte] ^= 1 << bit
    assert changed == 8 * n


def test_single_bit_flips_across_chunks_change_the_digest_on_both_engines():
    data = random_bytes(3 * CHUNK + 101, 8)
    want = host(data)
    rng = np.random.default_rng(9)
    edges = [0, ROW - 1, CHUNK - 1, CHUNK, 2 * CHUNK + ROW, data.size - 1]
    for at in [*edges, *rng.integers(0, data.size, 20).tolist()]:
        for bit in (0, 7):
            flipped = data.copy()
            flipped[at] ^= 1 << bit
            assert host(flipped) != want, (at, bit)
            if at in edges and bit == 7:
                assert device(torch.from_numpy(flipped)) != [want], (at, bit)


def test_chunks_in_another_order_change_the_digest():
    chunks = [random_bytes(CHUNK, seed) for seed in range(3)]
    want = host(np.concatenate(chunks))
    for order in ([1, 0, 2], [0, 2, 1], [2, 1, 0], [1, 2, 0]):
        swapped = np.concatenate([chunks[i] for i in order])
        assert host(swapped) != want, order
        assert device(torch.from_numpy(swapped)) != [want], order
    # rows of a chunk, and words of a row, trading places
    data = np.concatenate(chunks)
    rows = data.copy()
    rows[:ROW], rows[ROW:2 * ROW] = data[ROW:2 * ROW], data[:ROW]
    words = data.copy()
    words[:4], words[4:8] = data[4:8], data[:4]
    assert host(rows) != want and host(words) != want


def test_a_trailing_zero_is_not_the_same_item():
    data = random_bytes(10, 3)
    padded = np.concatenate([data, np.zeros(2, np.uint8)])
    assert host(data) != host(padded)


def test_the_algorithm_decision():
    assert digests.algorithm_for(torch.zeros(3)) == digests.XXH3
    assert digests.algorithm_for(torch.zeros(3, device="meta")) == digests.XXH3
    if torch.cuda.is_available():
        assert digests.algorithm_for(torch.zeros(3, device="cuda")) == digests.WSUM
    assert digests.check(digests.WSUM) == digests.WSUM
    for bad in ("md5", "", None, 3, ["xxh3_64/chunks-2MiB"]):
        with pytest.raises(ValueError, match="unknown checksum algorithm"):
            digests.check(bad)
    assert digests.recorded_as(digests.XXH3) is None and digests.recorded_as(digests.WSUM) == digests.WSUM


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_device_computes_the_host_value():
    tensors = dtype_tensors()
    tensors["large"] = torch.randn(3 * CHUNK // 4 + 11)
    want = [host(stored_bytes(t)) for t in tensors.values()]
    assert device(*(t.cuda() for t in tensors.values())) == want
    assert device(tensors["float32"].cuda().t()) == [host(stored_bytes(tensors["float32"].t()))]
    torch.use_deterministic_algorithms(True)  # a job may ask for it: no op here refuses
    try:
        assert device(*(t.cuda() for t in tensors.values())) == want
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_tensor_op_engine_runs_under_deterministic_algorithms():
    data = random_bytes(CHUNK + ROW + 3, 11)
    torch.use_deterministic_algorithms(True)
    try:
        assert device(torch.from_numpy(data.copy()), torch.zeros(0)) == [host(data), host(np.empty(0, np.uint8))]
    finally:
        torch.use_deterministic_algorithms(False)
