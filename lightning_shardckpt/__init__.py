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
from .saver import CheckpointSaver, SaveResult

__all__ = [
    "CheckpointNotFound",
    "CheckpointSaver",
    "CommitFailed",
    "ConfigError",
    "CorruptCheckpoint",
    "IncompatibleCheckpoint",
    "LoadConfig",
    "LoadResult",
    "SaveConfig",
    "SaveResult",
    "ShardCkptError",
    "StorageUnavailable",
    "VerifyConfig",
    "load_checkpoint",
]
