"""mlcheckpoint: peer-replicated, in-memory checkpoints for PyTorch DCP."""

from .dcp import MemoryStorageReader, MemoryStorageWriter
from .errors import (CapacityError, ConfigError, CorruptShardError, MLCheckpointError,
                     ShardNotFoundError)
from .manager import CheckpointEntry, CheckpointManager, ResumeInfo, SaveResult
from .store import LocalStore

__all__ = ["CheckpointEntry", "CheckpointManager", "ResumeInfo", "SaveResult", "CapacityError", "ConfigError", "CorruptShardError", "LocalStore", "MLCheckpointError",
           "MemoryStorageReader", "MemoryStorageWriter", "ShardNotFoundError"]
__version__ = "0.1.0"
