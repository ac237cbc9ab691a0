"""lightning_shardckpt: sharded checkpoints that commit atomically, verify themselves and reshard on load."""

from .engine.config import LoadConfig, SaveConfig, VerifyConfig
from .engine.load.loader import LoadResult, load_checkpoint
from .engine.metrics import CheckpointRecord, read_events
from .engine.save.persist import SaveResult
from .engine.save.saver import CheckpointSaver, PendingSave
from .errors import (
    CheckpointNotFound,
    CommitFailed,
    ConfigError,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    ShardCkptError,
    StorageUnavailable,
    UntrustedCheckpoint,
)
from .ops.export import ExportOptions, ExportResult, export_checkpoint
from .ops.verify import VerifyReport, verify_checkpoint
from .policies.health_eval import Transition
from .policies.health_rules import HealthConfig, HealthRule, NormalRange, Persistence
from .policies.mitigations import HealthControl, MitigationContext, register_mitigation

try:
    import lightning.pytorch  # noqa: F401
except ImportError:  # without Lightning (absent or blocked) the engine, policies, training and ops still import
    pass
else:
    from .lightning.callback import ShardedCheckpoint
    from .lightning.strategy import ShardedDDPStrategy, ShardedFSDPStrategy, ShardedStrategy
    from .lightning.strategy import register as _register_strategies

    _register_strategies()  # Trainer(strategy="shardckpt_ddp" / "shardckpt_fsdp")

__all__ = [
    "CheckpointNotFound",
    "CheckpointRecord",
    "CheckpointSaver",
    "CommitFailed",
    "ConfigError",
    "CorruptCheckpoint",
    "ExportOptions",
    "ExportResult",
    "HealthConfig",
    "HealthControl",
    "HealthRule",
    "IncompatibleCheckpoint",
    "LoadConfig",
    "LoadResult",
    "MitigationContext",
    "NormalRange",
    "PendingSave",
    "Persistence",
    "SaveConfig",
    "SaveResult",
    "ShardCkptError",
    "ShardedCheckpoint",
    "ShardedDDPStrategy",
    "ShardedFSDPStrategy",
    "ShardedStrategy",
    "StorageUnavailable",
    "Transition",
    "UntrustedCheckpoint",
    "VerifyConfig",
    "VerifyReport",
    "export_checkpoint",
    "load_checkpoint",
    "read_events",
    "register_mitigation",
    "verify_checkpoint",
]
