"""Copy and checksum many items at once, on a few threads.

A save copies every tensor into the shard buffer and hashes what landed; a load hashes the
stored bytes and copies them into the model. One thread doing both reaches about half a
memcpy here. Both the copy (``ctypes.memmove``) and the hash (``checksum.hash_at``) run with
the GIL released, so the work is cut into ``CHUNK_BYTES`` pieces (a chunk is hashed right
after it is copied, while it is in cache) and split evenly across a small thread pool.

Items are contiguous CPU byte ranges given by address (or by offset in an open shard file, for
a process that has not mapped it: ``pread`` skips building page tables for a mapping used
once); callers keep the memory alive and check the sizes. Non-contiguous or device tensors are first copied by torch in the caller, then only
hashed here.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError, CorruptShardError
from .checksum import CHUNK_BYTES, combine, hash_at, n_chunks

log = logging.getLogger(__name__)

# Below this many bytes in all, handing work to threads costs more than it saves.
INLINE_BYTES = 4 << 20


@dataclass(frozen=True)
class Span:
    """One item: ``nbytes`` at address ``src``; with ``dst``, copied there (and hashed there,
    after the copy). With ``fd``, ``src`` is an offset in that file, read into ``dst``."""

    src: int
    nbytes: int
    dst: int | None = None
    fd: int | None = None


def default_threads() -> int:
    """``MLCHECKPOINT_COPY_THREADS`` if set, else min(4, usable cores)."""
    env = os.environ.get("MLCHECKPOINT_COPY_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ConfigError(f"MLCHECKPOINT_COPY_THREADS={env!r}: expected a whole number >= 1")
        return int(env)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    # Memory bandwidth, not cores, is the limit past a few threads; every rank of the node
    # saves at the same time.
    return max(1, min(4, cpus))


_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_threads
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


def split_evenly(pieces: list[tuple], size: Callable[[tuple], int], parts: int) -> list[list[tuple]]:
    """Deal ``pieces`` (in order) into ``parts`` contiguous runs of about equal total size."""
    groups: list[list[tuple]] = [[] for _ in range(parts)]
    share, done = max(sum(map(size, pieces)), 1) / parts, 0
    for piece in pieces:
        groups[min(parts - 1, int(done // share))].append(piece)
        done += size(piece)
    return groups


def _pread_into(fd: int, offset: int, address: int, n: int) -> None:
    view = memoryview((ctypes.c_char * n).from_address(address)).cast("B")
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got:]], offset + got)
        if k == 0:
            raise CorruptShardError(f"shard file ends {n - got} bytes short of an item")
        got += k


def _run(pieces: list[tuple[int, int, int, int, int, int | None]], out: list[list[int]]) -> None:
    memmove = ctypes.memmove
    for item, chunk, src, dst, n, fd in pieces:
        if fd is not None:
            _pread_into(fd, src, dst, n)
            out[item][chunk] = hash_at(dst, n)
        elif dst:
            memmove(dst, src, n)
            out[item][chunk] = hash_at(dst, n)
        else:
            out[item][chunk] = hash_at(src, n)


def hash_later(span: Span) -> Future:
    """Hash ``span`` on the copier's threads; the future's result is its checksum. Lets a
    receiver verify what has landed while the rest is still arriving."""
    return _executor(default_threads()).submit(process, [span], 1)


def process(spans: list[Span], threads: int | None = None) -> list[int]:
    """Copy the spans that have a ``dst`` and return every span's checksum (of what it holds
    after the copy), splitting the work across ``threads`` (default: ``default_threads()``)."""
    out: list[list[int]] = [[0] * n_chunks(s.nbytes) for s in spans]
    pieces: list[tuple[int, int, int, int, int, int | None]] = []
    for i, s in enumerate(spans):
        if s.fd is not None and not s.dst:
            raise ValueError("a span read from a file needs a destination")
        for c, start in enumerate(range(0, max(s.nbytes, 1), CHUNK_BYTES)):
            n = min(CHUNK_BYTES, s.nbytes - start)
            pieces.append((i, c, s.src + start, (s.dst + start) if s.dst else 0, n, s.fd))
    total = sum(s.nbytes for s in spans)
    threads = threads or default_threads()
    if threads == 1 or total <= INLINE_BYTES or len(pieces) == 1:
        _run(pieces, out)
    else:
        # Contiguous runs of equal byte counts: each thread walks its own stretch of memory.
        groups = split_evenly(pieces, lambda piece: piece[4], threads)
        pool = _executor(threads)
        futures = [pool.submit(_run, g, out) for g in groups[1:] if g]
        try:
            _run(groups[0], out)  # the caller works too instead of only waiting
        finally:
            wait(futures)  # never return (or raise) while a thread still writes
        for f in futures:
            f.result()
    return [combine(d) for d in out]
