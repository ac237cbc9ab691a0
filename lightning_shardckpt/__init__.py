"""lightning_shardckpt: sharded checkpoints that commit atomically, verify themselves and reshard on load."""

from .callback import ShardedCheckpoint

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
from .strategy import ShardedDDPStrategy, ShardedFSDPStrategy, ShardedStrategy, register as _register_strategies
from .verify import VerifyReport, verify_checkpoint

_register_strategies()  # Trainer(strategy="shardckpt_ddp" / "shardckpt_fsdp")

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
    "ShardedCheckpoint",
    "ShardedDDPStrategy",
    "ShardedFSDPStrategy",
    "ShardedStrategy",
    "StorageUnavailable",
    "VerifyConfig",
    "VerifyReport",
    "load_checkpoint",
    "read_events",
    "verify_checkpoint",
]
