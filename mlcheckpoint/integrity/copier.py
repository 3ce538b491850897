"""Copy and checksum many items at once, on a few threads.

A save copies every tensor into the shard buffer and hashes the bytes; a load hashes the
stored bytes and copies them into the model. One thread doing both reaches about half a
memcpy here. Both the copy (``ctypes.memmove``) and the hash (``checksum.hash_at``) run with
the GIL released, so the work is cut into ``CHUNK_BYTES`` pieces that a small thread pool
and the calling thread take in turn. Each piece is hashed at its source first and copied
right after, from cache: hashing the destination after the copy instead was 15-25% slower
here, because the copy's stores had pushed the piece out of the core's 1 MiB L2 by then.

The C loop (``_hashcopy.c``, when built) does a piece of up to 16 MiB per call instead, with
the same digests; see there.

Items are contiguous CPU byte ranges given by address; callers keep the memory alive and
check the sizes, and take a tensor's address only where ``raw_copyable`` says it has one. A shard mapped just now (a resume) has no page tables yet: its pages are
faulted in by the threads here as they hash, two at a time. Non-contiguous or device tensors
are first copied by torch in the caller, then only hashed here.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..settings import tuning
from . import digests, wsum
from .checksum import CHUNK_BYTES, hash_at, n_chunks, native_hash_copy

log = logging.getLogger(__name__)

# Below this many bytes in all, handing work to threads costs more than it saves.
INLINE_BYTES = 4 << 20


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def raw_copyable(t: torch.Tensor) -> bool:
    """Whether ``t``'s value is exactly ``numel * element_size`` bytes of its dtype in one
    strided storage, so that its bytes may be copied by address (contiguous, on the CPU) or by
    ``Tensor.copy_`` into a plain view of a buffer, and read back the same way.

    Only a plain tensor is. A subclass may keep its bytes in inner tensors (a wrapper subclass
    has no valid storage of its own: its address is not its data) or compute them; a quantized
    tensor needs its scales; a sparse or nested one has no single strided storage. Those take
    DCP's own route (``dcp/serialized.py``): this is the one place that decides.
    """
    return (type(t) in _PLAIN_TYPES and t.layout is torch.strided and not t.is_quantized
            and not t.is_meta)


@dataclass(frozen=True)
class Span:
    """One item: ``nbytes`` at address ``src``; with ``dst``, copied there. Its checksum is
    taken with ``algorithm`` (``digests.py``); None: only copied (its checksum is taken
    elsewhere, e.g. on the device it is copied to next), and reported as 0."""

    src: int
    nbytes: int
    dst: int | None = None
    algorithm: str | None = digests.XXH3


def default_threads() -> int:
    """The process's ``Tuning.copy_threads`` (settings.py)."""
    return tuning().copy_threads


_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


def _executor() -> ThreadPoolExecutor:
    global _pool, _pool_threads
    threads = default_threads()  # re-read: the setting may change between saves
    with _lock:
        if _pool is None or _pool_threads != threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="mlcheckpoint-copy")
            _pool_threads = threads
        return _pool


def _forget_pool_after_fork() -> None:
    global _pool, _pool_threads
    _pool, _pool_threads = None, 0  # the parent's threads do not exist in the child


os.register_at_fork(after_in_child=_forget_pool_after_fork)


# With the C loop a piece of work is up to PIECE_BYTES (whole chunks: one call, one GIL
# hand-off for several chunks); without it, one chunk.
PIECE_BYTES = 8 * CHUNK_BYTES

_Piece = tuple[int, int, int, int, str | None]  # (first digest slot, src, dst or 0, nbytes, algorithm)


def _do_piece(piece: _Piece, chunk_digests: np.ndarray) -> None:
    slot, src, dst, n, algorithm = piece
    if algorithm is None:
        ctypes.memmove(dst, src, n)  # (ctypes drops the GIL for the call)
    elif algorithm == digests.WSUM:
        wsum.chunk_sums_into(src, dst, n, chunk_digests[slot:slot + n_chunks(n)])
    elif native_hash_copy is not None:
        native_hash_copy(src, dst, n, CHUNK_BYTES, chunk_digests.ctypes.data + 8 * slot)
    else:
        chunk_digests[slot] = hash_at(src, n)  # brings the piece into cache for the copy
        if dst:
            ctypes.memmove(dst, src, n)


def _piece_bytes(algorithm: str | None) -> int:
    """Whole chunks per piece where a C loop (or a plain copy) does several in one call; one
    chunk otherwise."""
    if algorithm is None:
        return PIECE_BYTES
    native = wsum.native_wsum_copy if algorithm == digests.WSUM else native_hash_copy
    return PIECE_BYTES if native is not None else CHUNK_BYTES


class _Batch:
    """One ``process`` call's copies and hashes, on the copier's threads and the caller's.

    Workers and the caller take the next piece from one shared counter, so whoever is free
    does the next piece, and a worker that starts late (the pool busy with another batch)
    finds nothing left and returns at once.
    """

    def __init__(self, spans: list[Span], workers: int) -> None:
        self._spans = spans
        self._first: list[int] = []  # each span's first digest slot
        self._pieces: list[_Piece] = []
        slots = 0
        for s in spans:
            self._first.append(slots)
            step = _piece_bytes(s.algorithm)
            for begin in range(0, max(s.nbytes, 1), step):
                self._pieces.append((slots + begin // CHUNK_BYTES, s.src + begin,
                                     (s.dst + begin) if s.dst else 0,
                                     min(step, s.nbytes - begin), s.algorithm))
            slots += n_chunks(s.nbytes)
        self._digests = np.zeros(slots, dtype=np.uint64)  # one per chunk
        self._next = itertools.count()  # next() on it is atomic under the GIL
        self._left = len(self._pieces)
        self._lock = threading.Lock()
        self._all_done = threading.Event()
        self._error: BaseException | None = None
        if self._left == 0:
            self._all_done.set()
        if workers > 0 and len(self._pieces) > 1:
            pool = _executor()
            for _ in range(min(workers, len(self._pieces))):
                pool.submit(self._work)

    def _work(self) -> None:
        pieces, digests = self._pieces, self._digests
        while (i := next(self._next)) < len(pieces):
            try:
                _do_piece(pieces[i], digests)
            except BaseException as e:  # noqa: BLE001 (kept for result(); the other pieces still run)
                self._error = self._error or e
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    self._all_done.set()

    def result(self) -> list[int]:
        """Take part in the remaining pieces, wait until every piece is done (never return or
        raise while a thread still writes), and return each span's checksum."""
        self._work()
        self._all_done.wait()
        if self._error is not None:
            raise self._error
        ends = self._first[1:] + [len(self._digests)]
        return [0 if s.algorithm is None else digests.combine(s.algorithm, self._digests[a:b], s.nbytes)
                for s, a, b in zip(self._spans, self._first, ends)]


def hash_later(span: Span) -> Future:
    """Hash ``span`` on the copier's threads; the future's result is its checksum. Lets a
    receiver verify what has landed while the rest is still arriving."""
    return _executor().submit(process, [span], 1)


def process(spans: list[Span], threads: int | None = None) -> list[int]:
    """Copy the spans that have a ``dst`` and return every span's checksum (of the bytes
    copied), splitting the work across ``threads`` (default: ``default_threads()``), the
    calling thread among them."""
    threads = threads or default_threads()
    total = sum(s.nbytes for s in spans)
    inline = threads == 1 or total <= INLINE_BYTES
    return _Batch(spans, 0 if inline else threads - 1).result()
