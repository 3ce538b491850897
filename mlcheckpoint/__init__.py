"""mlcheckpoint: peer-replicated, in-memory checkpoints for PyTorch DCP."""

from .dcp import MemoryStorageReader, MemoryStorageWriter
from .errors import (
    CapacityError,
    ConfigError,
    CorruptShardError,
    JobDirInUseError,
    MLCheckpointError,
    ProtocolError,
    ReplicationError,
    ShardNotFoundError,
    StagingError,
    StateDictError,
)
from .manager import CheckpointEntry, CheckpointManager, FlushResult, SaveResult
from .persistent import PersistentStorage
from .recovery import ResumeInfo
from .replication.schedule.status import ProtectionStatus
from .settings import Options, ReplicationOptions

__all__ = [
    "CapacityError", "CheckpointEntry", "CheckpointManager", "ConfigError", "CorruptShardError",
    "FlushResult", "JobDirInUseError", "MLCheckpointError", "MemoryStorageReader",
    "MemoryStorageWriter", "Options", "PersistentStorage", "ProtectionStatus", "ProtocolError",
    "ReplicationError", "ReplicationOptions", "ResumeInfo", "SaveResult", "ShardNotFoundError",
    "StagingError", "StateDictError",
]
__version__ = "0.1.0"
