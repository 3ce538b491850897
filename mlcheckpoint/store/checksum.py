"""Checksums of shard bytes, fused with the copy so the bytes are hashed while cache-hot.

xxh3_64 runs at ~30 GB/s here; hashing a chunk right after copying it (still in cache) keeps
a save at ~0.75x memcpy, where copy-then-hash of the whole tensor costs ~0.6x. 8 MiB chunks
(in L3) hash nearly as fast as 2 MiB ones and cost 4x fewer parallel-copy launches, which
matters when the CPU is busy.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

ALGORITHM = "xxh3_64"
CHUNK_BYTES = 8 << 20


def checksum(buf) -> int:
    """Checksum of a buffer (bytes, memoryview, numpy array)."""
    return xxhash.xxh3_64_intdigest(buf)


def as_byte_tensor(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def copy_into(dst: np.ndarray, src: torch.Tensor) -> int:
    """Copy ``src`` into the uint8 array ``dst`` (same byte size) and return its checksum.

    Contiguous CPU sources are copied and hashed chunk by chunk; anything else (a strided
    view, a GPU tensor) is copied in one go and hashed afterwards.
    """
    nbytes = src.numel() * src.element_size()
    if dst.nbytes != nbytes:
        raise ValueError(f"size mismatch: buffer {dst.nbytes} B, tensor {nbytes} B")
    dst_t = torch.from_numpy(dst)
    if src.device.type == "cpu" and src.is_contiguous():
        src_b = as_byte_tensor(src)
        h = xxhash.xxh3_64()
        for start in range(0, nbytes, CHUNK_BYTES):
            end = min(start + CHUNK_BYTES, nbytes)
            dst_t[start:end].copy_(src_b[start:end])
            h.update(dst[start:end])
        return h.intdigest()
    dst_t.view(src.dtype).view(src.shape).copy_(src)
    if src.device.type != "cpu":
        torch.accelerator.synchronize()
    return checksum(dst)


def verify_into(dst: torch.Tensor | None, src: np.ndarray, expected: int) -> bool:
    """Hash ``src`` and, if ``dst`` is given, copy it there (same byte size, contiguous CPU).

    Returns whether the checksum matched. Hash and copy run per chunk so ``src`` is read from
    memory once. On a mismatch ``dst`` holds the bad bytes: callers raise, never use them.
    """
    h = xxhash.xxh3_64()
    if dst is None:
        return checksum(src) == expected
    dst_b = as_byte_tensor(dst)
    src_t = torch.from_numpy(src)
    for start in range(0, src.nbytes, CHUNK_BYTES):
        end = min(start + CHUNK_BYTES, src.nbytes)
        h.update(src[start:end])
        dst_b[start:end].copy_(src_t[start:end])
    return h.intdigest() == expected
