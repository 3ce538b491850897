"""Layer 2: DCP StorageWriter / StorageReader over the tmpfs store."""

from .reader import MemoryStorageReader
from .writer import MemoryStorageWriter

__all__ = ["MemoryStorageReader", "MemoryStorageWriter"]
