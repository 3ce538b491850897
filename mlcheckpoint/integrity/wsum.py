"""wsum64: the checksum a GPU computes where the bytes are, and the host computes in C to the
same value.

Definition (``NAME``, version 1). An item's bytes, zero-padded to a multiple of 4, are signed
32-bit little-endian words ``v``. They are cut into chunks of ``CHUNK_BYTES`` (2 MiB), each of
``ROWS_PER_CHUNK`` rows of ``ROW_WORDS`` words (4 KiB). A chunk's sum is

    s = sum over rows r of U[r] * (sum over columns j of v[r, j] * W[j])   (mod 2^64)

with fixed odd weights: ``W`` (``COLUMN_WEIGHTS``, int32) and ``U`` (``ROW_WEIGHTS``, uint64),
drawn once from splitmix64. The item's digest mixes each chunk's sum with its index and adds
its length:

    digest = fmix64( sum over chunks c of fmix64(s_c + (c + 1) * K_CHUNK)
                     + fmix64(nbytes ^ K_LENGTH) )                          (mod 2^64)

where fmix64 is MurmurHash3's 64-bit finalizer (a bijection) and an empty item has one chunk,
of sum 0.

Why this shape. Every operation is an integer product or a wrapping sum, so the value does not
depend on the order of the additions: a GPU reduces in any order with a few tensor ops
(``tensor_digests``: a multiply by the column weights and a row sum, then small index ops), and
the host runs the same sums in C (``_hashcopy.c``, 8 words per AVX2 step; numpy where it is
not built). What it guarantees:

- every single-bit flip changes the digest: a flip changes one word by +-2^b (b <= 31), so its
  chunk's sum moves by +-2^b * W[j] * U[r], an odd number times 2^b, never 0 mod 2^64; fmix64 is
  a bijection and the other chunks' terms are unchanged. The same holds for any change confined
  to one word;
- chunks in another order give another digest: each chunk's term depends on its index;
- any other change escapes only if the weighted differences cancel mod 2^64.

It is a corruption check, like xxh3 and crc32c, not a cryptographic hash.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

import numpy as np
import torch

from ..settings import tuning

log = logging.getLogger(__name__)

NAME = "wsum64/v1/chunks-2MiB"
ROW_WORDS = 1024
ROW_BYTES = 4 * ROW_WORDS
ROWS_PER_CHUNK = 512
CHUNK_BYTES = ROW_BYTES * ROWS_PER_CHUNK  # 2 MiB, as xxh3's chunks
CHUNK_WORDS = ROW_WORDS * ROWS_PER_CHUNK
K_CHUNK = 0x9E3779B97F4A7C15
K_LENGTH = 0xD6E8FEB86659FD93
_FMIX_1 = 0xFF51AFD7ED558CCD
_FMIX_2 = 0xC4CEB9FE1A85EC53
_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _weights() -> tuple[np.ndarray, np.ndarray]:
    """The column and row weights: odd, and pairwise distinct mod 2^33 (so two words of one
    row or one column that trade places always change the sum); fixed by the seeds."""
    w = (_splitmix64(np.arange(1, ROW_WORDS + 1, dtype=np.uint64)) | np.uint64(1))
    w = (w & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)
    u = _splitmix64(np.arange(1 << 20, (1 << 20) + ROWS_PER_CHUNK, dtype=np.uint64)) | np.uint64(1)
    assert len(set(w.tolist())) == ROW_WORDS
    assert len({int(x) % (1 << 33) for x in u}) == ROWS_PER_CHUNK
    return w, u


COLUMN_WEIGHTS, ROW_WEIGHTS = _weights()


def n_chunks(nbytes: int) -> int:
    return max(1, -(-nbytes // CHUNK_BYTES))


# ------------------------------------------------------------------ combining chunk sums
def fmix64(z: np.ndarray) -> np.ndarray:
    """MurmurHash3's finalizer over uint64 values."""
    with np.errstate(over="ignore"):
        z = z ^ (z >> np.uint64(33))
        z = z * np.uint64(_FMIX_1)
        z = z ^ (z >> np.uint64(33))
        z = z * np.uint64(_FMIX_2)
        return z ^ (z >> np.uint64(33))


def combine(chunk_sums: Sequence[int] | np.ndarray, nbytes: int) -> int:
    """An item's digest from its chunks' sums, in order (see the module docstring)."""
    sums = np.asarray(chunk_sums, dtype=np.uint64)
    with np.errstate(over="ignore"):
        index = np.arange(1, sums.size + 1, dtype=np.uint64) * np.uint64(K_CHUNK)
        total = fmix64(sums + index).sum(dtype=np.uint64)
        total = total + fmix64(np.array([nbytes ^ K_LENGTH], dtype=np.uint64))[0]
    return int(fmix64(np.array([total], dtype=np.uint64))[0])


# ------------------------------------------------------------------ the host engine
def _bind_native():
    """``_hashcopy``'s wsum functions, handed the weight tables; None where the extension is
    not built or the C loop is switched off (``MLCHECKPOINT_NATIVE=0``): numpy then."""
    if not tuning().native_loop:
        return None
    try:
        from . import _hashcopy
        _hashcopy.wsum_bind(COLUMN_WEIGHTS.ctypes.data, ROW_WEIGHTS.ctypes.data, ROWS_PER_CHUNK)
    except (ImportError, AttributeError, ValueError) as e:
        log.info("mlcheckpoint: C wsum64 unavailable (%s); using numpy", e)
        return None
    return _hashcopy


_native = _bind_native()
native_wsum_copy = _native.wsum_copy if _native is not None else None

# numpy's fallback: the weight of every word of a chunk, U[r] * W[j] mod 2^64 (4 MiB, made on
# first use), so a region is one multiply and one sum.
_word_weights: np.ndarray | None = None


def _chunk_word_weights() -> np.ndarray:
    global _word_weights
    if _word_weights is None:
        with np.errstate(over="ignore"):
            _word_weights = (ROW_WEIGHTS[:, None] * COLUMN_WEIGHTS.astype(np.int64).view(np.uint64)[None, :]
                             ).reshape(-1)
    return _word_weights


def _words(address: int, nbytes: int) -> np.ndarray:
    """The nbytes at ``address`` as int32 words, the last one zero-padded (a copy only then)."""
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address)) \
        if nbytes else np.empty(0, np.uint8)
    if nbytes % 4:
        raw = np.concatenate([raw, np.zeros(4 - nbytes % 4, np.uint8)])
    return raw.view(np.int32)


def span_sum(address: int, nbytes: int, word: int) -> int:
    """What the ``nbytes`` at ``address`` add to their chunk's sum, starting at ``word`` of the
    chunk and ending inside it (a last partial word zero-padded)."""
    if _native is not None:
        return int(_native.wsum_span(address, nbytes, word))
    if word * 4 + nbytes > CHUNK_BYTES:
        raise ValueError("span_sum: the span leaves its chunk")
    v = _words(address, nbytes)
    weights = _chunk_word_weights()[word:word + v.size]
    with np.errstate(over="ignore"):
        return int((v.astype(np.int64).view(np.uint64) * weights).sum(dtype=np.uint64))


def chunk_sums_into(src: int, dst: int, nbytes: int, out: np.ndarray) -> None:
    """The sums of the chunks of the ``nbytes`` at ``src`` (which start a chunk) into ``out``
    (uint64, ``n_chunks(nbytes)`` of them); with ``dst`` (not 0), copy the bytes there too."""
    if native_wsum_copy is not None:
        native_wsum_copy(src, dst, nbytes, out.ctypes.data)
        return
    for i in range(n_chunks(nbytes)):
        k = min(CHUNK_BYTES, nbytes - i * CHUNK_BYTES)
        out[i] = span_sum(src + i * CHUNK_BYTES, k, 0)
    if dst and nbytes:
        ctypes.memmove(dst, src, nbytes)


def digest_at(address: int, nbytes: int) -> int:
    """wsum64 of ``nbytes`` at ``address`` (the caller keeps the memory alive)."""
    sums = np.zeros(n_chunks(nbytes), dtype=np.uint64)
    chunk_sums_into(address, 0, nbytes, sums)
    return combine(sums, nbytes)


class StreamingWsum:
    """wsum64 of one item fed in order, in pieces of any size (a receiver's view)."""

    def __init__(self) -> None:
        self._sums: list[int] = []
        self._current = 0  # the sum of the chunk being fed, so far
        self._at = 0  # bytes fed
        self._carry = b""  # the start of a word split between pieces

    def update(self, piece) -> None:
        mv = memoryview(piece).cast("B")
        if self._carry:  # finish the split word first
            take = min(4 - len(self._carry), mv.nbytes)
            self._carry += bytes(mv[:take])
            mv = mv[take:]
            if len(self._carry) < 4:
                return
            word = np.frombuffer(self._carry, dtype=np.uint8)
            self._add(word.ctypes.data, 4)
            self._carry = b""
        arr = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else np.empty(0, np.uint8)
        whole = arr.size - arr.size % 4
        done = 0
        while done < whole:
            k = min(whole - done, CHUNK_BYTES - self._at % CHUNK_BYTES)
            self._add(arr.ctypes.data + done, k)
            done += k
        self._carry = arr[whole:].tobytes()

    def _add(self, address: int, nbytes: int) -> None:
        """Whole words that end inside (or at the end of) the current chunk."""
        within = self._at % CHUNK_BYTES
        self._current = (self._current + span_sum(address, nbytes, within // 4)) & _MASK64
        self._at += nbytes
        if self._at % CHUNK_BYTES == 0:
            self._sums.append(self._current)
            self._current = 0

    def digest(self) -> int:
        sums, current, nbytes = list(self._sums), self._current, self._at
        if self._carry:
            word = np.frombuffer(self._carry + bytes(4 - len(self._carry)), dtype=np.uint8)
            current = (current + span_sum(word.ctypes.data, 4, (nbytes % CHUNK_BYTES) // 4)) & _MASK64
            nbytes += len(self._carry)
        if nbytes % CHUNK_BYTES or not sums:
            sums.append(current)
        return combine(sums, nbytes)


# ------------------------------------------------------------------ the tensor-op engine
def _as_int64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _logical_shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    """``z >> bits`` as uint64 would shift (int64's ``>>`` copies the sign bit)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _fmix64_tensor(z: torch.Tensor) -> torch.Tensor:
    z = z ^ _logical_shift(z, 33)
    z = z * _as_int64(_FMIX_1)
    z = z ^ _logical_shift(z, 33)
    z = z * _as_int64(_FMIX_2)
    return z ^ _logical_shift(z, 33)


_device_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights on ``device`` (int64: W widened, U as two's complement), made once."""
    tables = _device_tables.get(device)
    if tables is None:
        w = torch.from_numpy(COLUMN_WEIGHTS.astype(np.int64)).to(device)
        u = torch.from_numpy(ROW_WEIGHTS.view(np.int64).copy()).to(device)
        tables = _device_tables[device] = (w, u)
    return tables


# Items below this many bytes are packed together (one copy kernel for all of them), larger
# ones are read in place; the rows are summed this many bytes of source at a time.
PACK_BELOW = 1 << 20
BLOCK_BYTES = 16 << 20


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as stored (contiguous, conjugation and negation resolved), flat uint8."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8)


class _Rows:
    """The row sums of a batch of items, and which item and row of it each one is."""

    def __init__(self, device: torch.device, total_rows: int):
        self.sums = torch.empty(total_rows, dtype=torch.int64, device=device)
        self.filled = 0
        self.segments: list[tuple[int, int, int]] = []  # (item, its first row here, rows)

    def add(self, words: torch.Tensor, item: int, first_row: int, weights: torch.Tensor,
            scratch: torch.Tensor) -> None:
        """Sum the rows of ``words`` (int32, [rows, ROW_WORDS]) weighted by column."""
        rows = words.shape[0]
        block = max(1, BLOCK_BYTES // ROW_BYTES)
        for r in range(0, rows, block):
            part = words[r:r + block]
            product = scratch[:part.shape[0]]
            torch.mul(part, weights, out=product)
            torch.sum(product, dim=1, out=self.sums[self.filled + r:self.filled + r + part.shape[0]])
        self.segments.append((item, first_row, rows))
        self.filled += rows


def tensor_digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """wsum64 of each tensor's bytes (as stored: contiguous, row-major), as an int64 tensor on
    their device (two's complement of the uint64 digests), computed there with tensor ops.

    Runs on the current stream, which must see the tensors' final values. The work does not
    grow with the number of items: small items are packed into one buffer with one copy, and
    the sums of every item are combined with a few index operations; a large item is read in
    place, ``BLOCK_BYTES`` at a time. Extra device memory: about 2 * ``BLOCK_BYTES`` plus the
    small items' bytes, in pieces of at most ``PACK_LIMIT``. The reference engine on the CPU
    too: CI checks it against the host's C engine.
    """
    if not tensors:
        return torch.empty(0, dtype=torch.int64)
    device = tensors[0].device
    weights, row_weights = _tables(device)
    views = [_byte_view(t) for t in tensors]
    sizes = [v.numel() for v in views]
    # Rows read in place (a large item's whole rows) and rows to pack (small items, and the
    # partial last row of a large one).
    direct: list[tuple[int, torch.Tensor]] = []
    packed: list[tuple[int, int, torch.Tensor]] = []  # (item, first row, bytes)
    for i, (v, n) in enumerate(zip(views, sizes)):
        if n == 0:
            continue
        whole = n // ROW_BYTES if n >= PACK_BELOW else 0
        if whole:
            body = v[:whole * ROW_BYTES]
            if body.data_ptr() % 4:  # an odd offset into its storage: an aligned copy
                body = body.clone()
            direct.append((i, body.view(torch.int32).view(whole, ROW_WORDS)))
        if n > whole * ROW_BYTES:
            packed.append((i, whole, v[whole * ROW_BYTES:]))
    packed_rows = sum(-(-p[2].numel() // ROW_BYTES) for p in packed)
    rows = _Rows(device, sum(d[1].shape[0] for d in direct) + packed_rows)
    block_rows = max(1, BLOCK_BYTES // ROW_BYTES)
    scratch = torch.empty(min(block_rows, max(rows.sums.numel(), 1)), ROW_WORDS, dtype=torch.int64,
                          device=device)
    for i, words in direct:
        rows.add(words, i, 0, weights, scratch)
    zeros = torch.zeros(ROW_BYTES, dtype=torch.uint8, device=device)  # the rows' padding
    for batch in _pack_batches(packed):
        pieces: list[torch.Tensor] = []
        for i, first, b in batch:
            pad = -b.numel() % ROW_BYTES
            pieces += [b, zeros[:pad]] if pad else [b]
            rows.segments.append((i, first, -(-b.numel() // ROW_BYTES)))
        # One copy for the batch: torch.cat copies many inputs per kernel.
        block = torch.cat(pieces).view(torch.int32).view(-1, ROW_WORDS)
        start = rows.filled
        for r in range(0, block.shape[0], block_rows):
            part = block[r:r + block_rows]
            product = scratch[:part.shape[0]]
            torch.mul(part, weights, out=product)
            torch.sum(product, dim=1, out=rows.sums[start + r:start + r + part.shape[0]])
        rows.filled += block.shape[0]
    return _combine_on_device(rows, sizes, row_weights, device)


def _pack_batches(packed: list[tuple[int, int, torch.Tensor]]) -> list[list[tuple[int, int, torch.Tensor]]]:
    """The items to pack, in batches of at most ``PACK_LIMIT`` padded bytes."""
    batches: list[list[tuple[int, int, torch.Tensor]]] = [[]]
    size = 0
    for p in packed:
        padded = -(-p[2].numel() // ROW_BYTES) * ROW_BYTES
        if batches[-1] and size + padded > PACK_LIMIT:
            batches.append([])
            size = 0
        batches[-1].append(p)
        size += padded
    return [b for b in batches if b]


PACK_LIMIT = 64 << 20


def _combine_on_device(rows: _Rows, sizes: list[int], row_weights: torch.Tensor,
                       device: torch.device) -> torch.Tensor:
    """Row sums -> chunk sums -> digests. Sums over runs of rows (and of chunks) are
    differences of a cumulative sum, gathered at the runs' ends: no atomic adds, so the result
    is the same under ``torch.use_deterministic_algorithms`` (and integer sums wrap alike in any
    order anyway). The runs' layout is sent to the device in one copy."""
    chunks = [-(-n // CHUNK_BYTES) if n else 1 for n in sizes]
    chunk_base = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
    total_chunks = int(chunk_base[-1])
    seg = np.array(rows.segments, dtype=np.int64).reshape(-1, 3)  # item, first row, rows
    seg_start = np.concatenate([[0], np.cumsum(seg[:, 2])]).astype(np.int64)
    # Each segment's rows, cut where its item's chunks end: pieces [begin, end) of the rows,
    # each in one chunk; a chunk gets at most two (an item's rows read in place, then its last
    # partial row, packed), so its sum is two gathered pieces (the second may be the empty one).
    item, first, n, at = seg[:, 0], seg[:, 1], seg[:, 2], seg_start[:-1]
    first_chunk, last_chunk = first // ROWS_PER_CHUNK, (first + n - 1) // ROWS_PER_CHUNK
    count = last_chunk - first_chunk + 1
    of_piece = np.repeat(np.arange(len(seg)), count)
    nth = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    chunk = first_chunk[of_piece] + nth  # the item's chunk of each piece
    low = np.maximum(first[of_piece], chunk * ROWS_PER_CHUNK)
    high = np.minimum((first + n)[of_piece], (chunk + 1) * ROWS_PER_CHUNK)
    begin = low - first[of_piece] + at[of_piece]
    end = high - first[of_piece] + at[of_piece]
    owner = chunk_base[item[of_piece]] + chunk
    empty = len(begin)  # the index of an empty piece, for chunks with fewer than two
    of_chunk = np.full((total_chunks, 2), empty, dtype=np.int64)
    order = np.argsort(owner, kind="stable")
    slot = np.zeros(len(owner), dtype=np.int64)
    if len(owner):
        first_of = np.searchsorted(owner[order], owner[order], side="left")
        slot[order] = np.arange(len(owner)) - first_of
    assert slot.size == 0 or slot.max() < 2, "a chunk made of more than two runs of rows"
    of_chunk[owner, slot] = np.arange(len(owner))
    index_in_item = np.arange(total_chunks, dtype=np.int64) - np.repeat(chunk_base[:-1], chunks)
    layout = _to_device([seg[:, 1], seg[:, 2], seg_start[:-1], np.concatenate([begin, [0]]),
                         np.concatenate([end, [0]]), of_chunk.reshape(-1), index_in_item,
                         chunk_base, np.asarray(sizes, np.int64)], device)
    seg_first, seg_rows, seg_at, piece_begin, piece_end, chunk_pieces, chunk_index, base_t, sizes_t = layout
    n_rows = rows.filled
    if n_rows:
        of_row = torch.repeat_interleave(torch.arange(len(seg), device=device), seg_rows,
                                         output_size=n_rows)
        row_in_item = torch.arange(n_rows, device=device) - seg_at[of_row] + seg_first[of_row]
        weighted = rows.sums[:n_rows] * row_weights[row_in_item % ROWS_PER_CHUNK]
        running = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(weighted, 0)])
        pieces = running[piece_end] - running[piece_begin]  # (the last: the empty piece, 0)
        chunk_sums = pieces[chunk_pieces].view(total_chunks, 2).sum(dim=1)
    else:
        chunk_sums = torch.zeros(total_chunks, dtype=torch.int64, device=device)
    terms = _fmix64_tensor(chunk_sums + (chunk_index + 1) * _as_int64(K_CHUNK))
    running = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(terms, 0)])
    totals = running[base_t[1:]] - running[base_t[:-1]]
    return _fmix64_tensor(totals + _fmix64_tensor(sizes_t ^ _as_int64(K_LENGTH)))


def _to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Small int64 arrays on ``device``: one host tensor (page-locked on CUDA), one copy,
    ordered on the current stream without blocking the host."""
    lengths = [a.size for a in arrays]
    host = torch.from_numpy(np.concatenate([a.astype(np.int64) for a in arrays]))
    if device.type == "cuda":
        host = host.pin_memory()
    on_device = host.to(device, non_blocking=True)
    return list(torch.split(on_device, lengths))


def to_unsigned(digests: torch.Tensor) -> list[int]:
    """``tensor_digests``' values (on the host) as the uint64 digests the host engine returns."""
    return [int(d) & _MASK64 for d in digests.tolist()]
