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

from ..settings import native_loop

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
    if not native_loop():
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


# Items below this many bytes are packed together (one copy kernel for many of them), larger
# contiguous ones are read in place; the rows are summed this many bytes of source at a time,
# and the packing buffer holds as many.
PACK_BELOW = 1 << 20
BLOCK_BYTES = 16 << 20
# A strided (or conjugated, negated, misaligned) item is copied into the packing buffer in pieces
# of at most this many bytes: never as a whole copy of the item.
PIECE_BYTES = 4 << 20
# Items are digested in groups of about this many bytes: the bookkeeping of a group's rows
# (8 bytes per 4 KiB row, a few times over) is freed before the next group's is made.
GROUP_BYTES = 1 << 30


def scratch_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """A bound on the extra device memory ``tensor_digests(tensors)`` takes while it runs: the
    row products of one block (``2 * BLOCK_BYTES``), the packing buffer (``BLOCK_BYTES``), one
    piece of a strided item, and the row bookkeeping of the largest group (under 64 bytes per
    4 KiB row of it, about 1.6% of its bytes, so at most ~16 MiB for a 1 GiB group), plus
    4 MiB of allocator rounding: 72 MiB for any state whose items are at most 1 GiB each. It does not grow with the number of items, nor with the state's size
    beyond its largest group (see docs/performance.md)."""
    largest_group = max((sum(_nbytes(t) for t in g) for g in _groups(tensors)), default=0)
    return 3 * BLOCK_BYTES + PIECE_BYTES + 64 * -(-largest_group // ROW_BYTES) + (4 << 20)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _in_place(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes as stored are its memory as it lies (read without a copy)."""
    return (t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and t.data_ptr() % 4 == 0)


def _pieces(t: torch.Tensor, limit: int):
    """``t`` as sub-tensors in row-major order, each of at most ``limit`` bytes (one element
    at least), so that a strided item is copied a piece at a time."""
    size = _nbytes(t)
    if size <= limit or t.dim() == 0:
        yield t
        return
    inner = size // t.shape[0]  # the bytes of t[i]
    if inner <= limit:
        step = limit // inner
        for i in range(0, t.shape[0], step):
            yield t[i:i + step]
    else:
        for i in range(t.shape[0]):
            yield from _pieces(t[i], limit)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element's size (same strides), so a copy moves its bits
    as stored; itself where conjugation or negation must be resolved (or no such integer)."""
    bits = _BITS.get(t.element_size())
    return t if bits is None or t.is_conj() or t.is_neg() else t.view(bits)


def _groups(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive runs of items of about ``GROUP_BYTES`` (an item larger: a group alone)."""
    groups: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        n = _nbytes(t)
        if groups[-1] and size + n > GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    return groups


class _Rows:
    """The row sums of a group of items, and which item and row of it each one is."""

    def __init__(self, device: torch.device, total_rows: int):
        self.sums = torch.empty(total_rows, dtype=torch.int64, device=device)
        self.filled = 0
        self.segments: list[tuple[int, int, int]] = []  # (item, its first row here, rows)


class _Engine:
    """The fixed scratch of one ``tensor_digests`` call, made on first use and reused by every
    group: the row products of a block and the packing buffer."""

    def __init__(self, device: torch.device):
        self.device = device
        self.weights, self.row_weights = _tables(device)
        self.block_rows = max(1, BLOCK_BYTES // ROW_BYTES)
        self._scratch: torch.Tensor | None = None
        self._pack: torch.Tensor | None = None
        self.fill = 0  # bytes in the packing buffer
        self._zeros: torch.Tensor | None = None  # a row of zeros: the pads of queued items
        self._queued: list[torch.Tensor] = []  # small items (and pads) not yet copied in
        self._queued_at = 0  # where the first of them goes

    def _sum_rows(self, words: torch.Tensor, rows: _Rows) -> None:
        """Sum the rows of ``words`` (int32, [n, ROW_WORDS]) weighted by column, into the next
        ``n`` row sums, ``block_rows`` at a time through the fixed scratch."""
        if self._scratch is None:
            self._scratch = torch.empty(self.block_rows, ROW_WORDS, dtype=torch.int64, device=self.device)
        n = words.shape[0]
        for r in range(0, n, self.block_rows):
            part = words[r:r + self.block_rows]
            product = self._scratch[:part.shape[0]]
            # Widened into the scratch, then weighted in place: ``torch.mul(part, weights,
            # out=product)`` would first make a widened copy of ``part`` (as large again).
            product.copy_(part)
            product.mul_(self.weights)
            torch.sum(product, dim=1, out=rows.sums[rows.filled + r:rows.filled + r + part.shape[0]])
        rows.filled += n

    def in_place(self, item: int, words: torch.Tensor, rows: _Rows) -> None:
        rows.segments.append((item, 0, words.shape[0]))
        self._sum_rows(words, rows)

    def pack(self, item: int, first_row: int, src: torch.Tensor, rows: _Rows) -> None:
        """Append an item's bytes from row ``first_row`` on (``src``: a flat uint8 view, or a
        tensor of any layout whose values are the bytes as stored) to the packing buffer, its
        last row zero-padded; full buffers are summed as they fill. Small contiguous items are
        queued and copied together, many per kernel (``torch.cat`` into the buffer)."""
        if self._pack is None:
            self._pack = torch.empty(BLOCK_BYTES, dtype=torch.uint8, device=self.device)
            self._zeros = torch.zeros(ROW_BYTES, dtype=torch.uint8, device=self.device)
        buf = self._pack
        n = _nbytes(src)
        rows.segments.append((item, first_row, -(-n // ROW_BYTES)))
        pad = -n % ROW_BYTES
        contiguous = src.dtype == torch.uint8 and src.dim() == 1 and src.is_contiguous()
        if contiguous and self.fill + n + pad <= BLOCK_BYTES:
            if not self._queued:
                self._queued_at = self.fill
            assert self._zeros is not None
            self._queued += [src, self._zeros[:pad]] if pad else [src]
            self.fill += n + pad
            return
        self._copy_queued()
        if contiguous:
            done = 0
            while done < n:  # bytes: cut anywhere
                k = min(n - done, BLOCK_BYTES - self.fill)
                buf[self.fill:self.fill + k].copy_(src[done:done + k])
                self.fill += k
                done += k
                if self.fill == BLOCK_BYTES:
                    self.flush(rows)
        else:
            for piece in _pieces(src, PIECE_BYTES):
                m = _nbytes(piece)
                if self.fill + m > BLOCK_BYTES:
                    self.flush(rows)
                # Copied as bits (an integer of the element's size: no dtype's own kernel is
                # needed, fp4 has none), or as its dtype where torch must resolve conjugation
                # or negation; the offset is a multiple of the element size (rows are, and so
                # is each piece).
                bits = _as_bits(piece)
                buf[self.fill:self.fill + m].view(bits.dtype).view(bits.shape).copy_(bits)
                self.fill += m
        pad = -self.fill % ROW_BYTES
        if pad:
            buf[self.fill:self.fill + pad].zero_()
            self.fill += pad

    def _copy_queued(self) -> None:
        """Copy the queued small items into their place in the buffer: one ``torch.cat``."""
        if self._queued:
            assert self._pack is not None
            torch.cat(self._queued, out=self._pack[self._queued_at:self._queued_at
                                                   + sum(t.numel() for t in self._queued)])
            self._queued = []

    def flush(self, rows: _Rows) -> None:
        """Sum the packing buffer's whole rows; a partial last row (an item in the middle of
        its bytes) moves to the buffer's start."""
        if self._pack is None:  # nothing was packed
            return
        self._copy_queued()
        whole = self.fill // ROW_BYTES
        if whole:
            self._sum_rows(self._pack[:whole * ROW_BYTES].view(torch.int32).view(whole, ROW_WORDS), rows)
        rest = self.fill - whole * ROW_BYTES
        if rest and whole:  # (the stream orders this after the sums that read those bytes)
            self._pack[:rest].copy_(self._pack[whole * ROW_BYTES:self.fill])
        self.fill = rest

    def digests(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """wsum64 of one group of items."""
        sizes = [_nbytes(t) for t in tensors]
        direct: list[tuple[int, torch.Tensor]] = []
        packed: list[tuple[int, int, torch.Tensor]] = []  # (item, first row, its bytes or values)
        for i, (t, n) in enumerate(zip(tensors, sizes, strict=True)):
            if n == 0:
                continue
            if not _in_place(t):
                packed.append((i, 0, t))
                continue
            flat = t.reshape(-1).view(torch.uint8)
            whole = n // ROW_BYTES if n >= PACK_BELOW else 0
            if whole:
                direct.append((i, flat[:whole * ROW_BYTES].view(torch.int32).view(whole, ROW_WORDS)))
            if n > whole * ROW_BYTES:
                packed.append((i, whole, flat[whole * ROW_BYTES:]))
        total_rows = sum(d.shape[0] for _, d in direct) + sum(-(-_nbytes(p) // ROW_BYTES) for *_, p in packed)
        rows = _Rows(self.device, total_rows)
        for i, words in direct:  # rows read in place first, then the packed ones, in order
            self.in_place(i, words, rows)
        for i, first, src in packed:
            self.pack(i, first, src, rows)
        self.flush(rows)
        assert rows.filled == total_rows and self.fill == 0
        return _combine_on_device(rows, sizes, self.row_weights, self.device)


def tensor_digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """wsum64 of each tensor's bytes (as stored: contiguous, row-major), as an int64 tensor on
    their device (two's complement of the uint64 digests), computed there with tensor ops.

    Runs on the current stream, which must see the tensors' final values. The work does not
    grow with the number of items: small items are packed into one buffer, many per copy, and
    the sums of every item are combined with a few index operations; a large contiguous item
    is read in place, ``BLOCK_BYTES`` at a time; a strided one is copied into the packing
    buffer a piece at a time, never whole. Extra device memory: a fixed scratch and the rows'
    bookkeeping of one group of items, at most ``scratch_bytes(tensors)``. The reference
    engine on the CPU too: CI checks it against the host's C engine.
    """
    if not tensors:
        return torch.empty(0, dtype=torch.int64)
    tensors = [t.detach() for t in tensors]
    engine = _Engine(tensors[0].device)
    out = [engine.digests(group) for group in _groups(tensors)]
    return out[0] if len(out) == 1 else torch.cat(out)


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
