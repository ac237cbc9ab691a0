"""lightning_shardckpt: sharded checkpoints that commit atomically, verify themselves and reshard on load."""

from .config import LoadConfig, SaveConfig, VerifyConfig
from .errors import (
    CheckpointNotFound,
    CommitFailed,
    ConfigError,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    ShardCkptError,
    StorageUnavailable,
)
from .loader import LoadResult, load_checkpoint
from .metrics import CheckpointRecord, read_events
from .persist import SaveResult
from .saver import CheckpointSaver, PendingSave

__all__ = [
    "CheckpointNotFound",
    "CheckpointRecord",
    "CheckpointSaver",
    "CommitFailed",
    "ConfigError",
    "CorruptCheckpoint",
    "IncompatibleCheckpoint",
    "LoadConfig",
    "LoadResult",
    "PendingSave",
    "SaveConfig",
    "SaveResult",
    "ShardCkptError",
    "StorageUnavailable",
    "VerifyConfig",
    "load_checkpoint",
    "read_events",
]
