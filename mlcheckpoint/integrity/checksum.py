"""Checksums of shard bytes: xxh3_64 over fixed 2 MiB chunks, combined.

An item of at most ``CHUNK_BYTES`` is hashed as a whole with xxh3_64. A larger item's checksum
is the xxh3_64 of its chunks' xxh3_64 digests (8 little-endian bytes each, in order). The chunks
are independent, so one large tensor is copied and hashed by several threads at once
(``copier.py``), and a receiver hashes each chunk as it arrives, while it is cache-hot.

The hashing itself calls xxhash's C function directly through ctypes: ctypes drops the GIL for
the call, which the ``xxhash`` module does not, so hashing threads run in parallel with each
other and with the copies. If the C symbols are not found the module's Python API is used
(same digests, serialised on the GIL). The copier's C loop (``_hashcopy.c``, when built) is
handed the same library's streaming functions, so its digests are these too.
"""

from __future__ import annotations

import ctypes
import logging
import struct

import numpy as np
import torch
import xxhash

from ..settings import native_loop

log = logging.getLogger(__name__)

CHUNK_BYTES = 2 << 20
ALGORITHM = "xxh3_64/chunks-2MiB"


def _xxhash_library() -> ctypes.CDLL | None:
    """The ``xxhash`` package's extension, opened for its exported C functions."""
    try:
        return ctypes.CDLL(xxhash._xxhash.__file__)  # type: ignore[attr-defined]
    except (OSError, AttributeError):
        return None


_LIB = _xxhash_library()


def _fastest(name: str) -> str:
    """``name``'s ``_dispatch`` twin where the library exports one: the same function (same
    digests) in the widest vector unit the CPU has (AVX2, AVX-512); the plain one is built for
    SSE2 and hashes cached bytes at about half the speed here."""
    return name + "_dispatch" if hasattr(_LIB, name + "_dispatch") else name


def _bind_xxh3():
    fn = getattr(_LIB, _fastest("XXH3_64bits"), None)  # None also when _LIB is
    if fn is None:
        log.debug("xxhash C symbols not reachable; hashing holds the GIL")
        return None
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return fn


_XXH3 = _bind_xxh3()


def _bind_native():
    """The C inner loop (``_hashcopy.c``) bound to xxhash's streaming functions, or None:
    not built (no C compiler at install), switched off with ``MLCHECKPOINT_NATIVE=0``, or the
    xxhash symbols are missing. Without it the copier runs its Python loop (same digests)."""
    if not native_loop():  # (MLCHECKPOINT_NATIVE=0, read when this module is imported)
        return None
    try:
        from . import _hashcopy
        names = ("XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset",
                 _fastest("XXH3_64bits_update"), "XXH3_64bits_digest")
        _hashcopy.bind(*(ctypes.cast(getattr(_LIB, n), ctypes.c_void_p).value for n in names))
    except (ImportError, AttributeError, ValueError) as e:
        log.info("mlcheckpoint: C copy loop unavailable (%s); using the Python loop", e)
        return None
    return _hashcopy.hash_copy


native_hash_copy = _bind_native()


def hash_at(address: int, nbytes: int) -> int:
    """xxh3_64 of ``nbytes`` at ``address`` (the caller keeps the memory alive)."""
    if _XXH3 is not None:
        return _XXH3(address, nbytes)
    if nbytes == 0:
        return xxhash.xxh3_64_intdigest(b"")
    return xxhash.xxh3_64_intdigest((ctypes.c_char * nbytes).from_address(address))


def combine(chunk_digests: list[int]) -> int:
    """An item's checksum from its chunks' digests (see the module docstring)."""
    if len(chunk_digests) == 1:
        return chunk_digests[0]
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(chunk_digests)}Q", *chunk_digests))


def n_chunks(nbytes: int) -> int:
    return max(1, -(-nbytes // CHUNK_BYTES))


def byte_array(buf) -> np.ndarray:
    """A contiguous buffer (bytes, memoryview, numpy array) as a flat uint8 array, no copy."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def checksum(buf) -> int:
    """Checksum of one item's bytes (bytes, memoryview, numpy array), in the calling thread."""
    arr = byte_array(buf)
    address, nbytes = arr.ctypes.data, arr.nbytes
    return combine([hash_at(address + i, min(CHUNK_BYTES, nbytes - i))
                    for i in range(0, max(nbytes, 1), CHUNK_BYTES)])


class StreamingChecksum:
    """Checksum of one item fed in order, in pieces of any size (a receiver's view)."""

    def __init__(self) -> None:
        self._digests: list[int] = []
        self._partial = xxhash.xxh3_64()
        self._in_chunk = 0

    def update(self, piece) -> None:
        mv = memoryview(piece).cast("B")
        while mv.nbytes:
            take = min(CHUNK_BYTES - self._in_chunk, mv.nbytes)
            if self._in_chunk == 0 and take == CHUNK_BYTES:
                self._digests.append(xxhash.xxh3_64_intdigest(mv[:take]))  # whole chunk at once
            else:
                self._partial.update(mv[:take])
                self._in_chunk += take
                if self._in_chunk == CHUNK_BYTES:
                    self._digests.append(self._partial.intdigest())
                    self._partial.reset()
                    self._in_chunk = 0
            mv = mv[take:]

    def digest(self) -> int:
        digests = list(self._digests)
        if self._in_chunk or not digests:
            digests.append(self._partial.intdigest())
        return combine(digests)


def as_byte_tensor(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)
