"""The checksum algorithms an item may be recorded with, and the one decision of which an item
gets.

Two algorithms, both over 2 MiB chunks (so a large item is hashed by several threads, and a
receiver hashes each chunk as it lands):

- ``XXH3`` (``checksum.py``): xxh3_64 per chunk, combined. The host's own: its fused
  copy + hash (``_hashcopy.c``) keeps a CPU tensor's save one pass over memory.
- ``WSUM`` (``wsum.py``): weighted sums that a GPU computes with tensor ops where the bytes
  are, and the host computes in C to the same value (a partner verifying a replica on arrival,
  ``mlcheckpoint verify``, a resume into CPU tensors).

``algorithm_for`` is the decision: an item copied from device memory gets ``WSUM`` (the host
never reads its bytes to save it); an item on the CPU keeps ``XXH3``, which the host hashes
faster in the pass that copies it (``benchmarks/bench_gpu.py --only digest``; figures in
docs/performance.md). Manifests and the global metadata name each item's algorithm, so a
reader verifies every item, old (xxh3 only) and new alike, with the right one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import checksum, wsum

XXH3 = checksum.ALGORITHM
WSUM = wsum.NAME
ALGORITHMS = (XXH3, WSUM)
# What a record that names no algorithm was written with: every manifest and metadata before
# per-item algorithms.
DEFAULT = XXH3


def algorithm_for(t: torch.Tensor) -> str:
    """The algorithm an item copied from ``t`` is recorded with: ``WSUM`` for a tensor in CUDA
    memory (its checksum is computed there), ``XXH3`` otherwise (the host hashes it)."""
    return WSUM if t.device.type == "cuda" else XXH3


def recorded_as(algorithm: str) -> str | None:
    """What a manifest item or item location records for ``algorithm``: nothing for
    ``DEFAULT``, so such records read exactly as before."""
    return None if algorithm == DEFAULT else algorithm


def check(name: object) -> str:
    """``name`` if it is a known algorithm (one a peer or a file names); ValueError if not."""
    if not isinstance(name, str) or name not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {str(name)[:80]!r}")
    return name


def of(record: object) -> str:
    """The algorithm of a record (a manifest item, an item location): its own, or ``DEFAULT``
    when it names none."""
    name = getattr(record, "algorithm", None)
    return DEFAULT if name is None else name


def chunks_into(algorithm: str, src: int, dst: int, nbytes: int, out: np.ndarray) -> None:
    """The chunk digests of the ``nbytes`` at ``src`` (which start a chunk) into ``out``
    (uint64, one per chunk); with ``dst`` (not 0), copy the bytes there in the same pass."""
    if algorithm == WSUM:
        wsum.chunk_sums_into(src, dst, nbytes, out)
    elif checksum.native_hash_copy is not None:
        checksum.native_hash_copy(src, dst, nbytes, checksum.CHUNK_BYTES, out.ctypes.data)
    else:
        import ctypes
        for i in range(checksum.n_chunks(nbytes)):
            begin = i * checksum.CHUNK_BYTES
            out[i] = checksum.hash_at(src + begin, min(checksum.CHUNK_BYTES, nbytes - begin))
        if dst and nbytes:
            ctypes.memmove(dst, src, nbytes)


def combine(algorithm: str, chunk_digests: Sequence[int] | np.ndarray, nbytes: int) -> int:
    """An item's checksum from its chunks' digests, in order."""
    if algorithm == WSUM:
        return wsum.combine(chunk_digests, nbytes)
    return checksum.combine([int(d) for d in chunk_digests])


def digest_at(algorithm: str, address: int, nbytes: int) -> int:
    """The checksum of ``nbytes`` at ``address`` under ``algorithm`` (memory kept alive by the
    caller), on the calling thread."""
    out = np.zeros(checksum.n_chunks(nbytes), dtype=np.uint64)
    chunks_into(algorithm, address, 0, nbytes, out)
    return combine(algorithm, out, nbytes)


def streaming(algorithm: str) -> checksum.StreamingChecksum | wsum.StreamingWsum:
    """A checksum fed in order in pieces of any size (``update``, then ``digest``)."""
    return wsum.StreamingWsum() if algorithm == WSUM else checksum.StreamingChecksum()
