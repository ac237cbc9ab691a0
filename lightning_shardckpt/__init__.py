"""lightning_shardckpt: sharded checkpoints that commit atomically, verify themselves and reshard on load."""

import importlib.util

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
from .training.checkpointer import Checkpointer
from .training.data import ResumableDistributedSampler

LIGHTNING_NAMES = ("ShardedCheckpoint", "ShardedDDPStrategy", "ShardedFSDPStrategy", "ShardedStrategy")

if importlib.util.find_spec("lightning") is None:
    # without Lightning (absent, or blocked as tests do) the engine, policies, training and ops still import

    def __getattr__(name: str):
        if name in LIGHTNING_NAMES:
            raise ImportError(
                f"lightning_shardckpt.{name} is the Lightning adapter and Lightning does not import here; "
                "install it (pip install 'lightning>=2.4'), or use the plain-PyTorch front door (Checkpointer) "
                "or the engine (CheckpointSaver, load_checkpoint)"
            )
        raise AttributeError(f"module 'lightning_shardckpt' has no attribute {name!r}")

else:
    from .lightning.callback import ShardedCheckpoint
    from .lightning.strategy import ShardedDDPStrategy, ShardedFSDPStrategy, ShardedStrategy
    from .lightning.strategy import register as _register_strategies

    _register_strategies()  # Trainer(strategy="shardckpt_ddp" / "shardckpt_fsdp")

__all__ = [
    "Checkpointer",
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
    "ResumableDistributedSampler",
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
