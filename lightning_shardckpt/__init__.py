"""lightning_shardckpt: sharded checkpoints that commit atomically, verify themselves and reshard on load.

Every public name is imported on first use (PEP 562): `import lightning_shardckpt` costs nothing, so the
`shardckpt` command answers in well under a second, and the engine never imports Lightning. Using any
of the Lightning names (ShardedCheckpoint, ShardedStrategy, ...) imports the Lightning adapter, which
registers `Trainer(strategy="shardckpt_ddp" / "shardckpt_fsdp")` and the same two names for Fabric; so
does importing this package after Lightning. A script that only spells the strategy as a string after `import lightning_shardckpt`, with
Lightning imported later, registers it with `import lightning_shardckpt.lightning`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointNotFound,
    CommitFailed,
    ConfigError,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    ShardCkptError,
    SignatureRefused,
    StorageUnavailable,
    UntrustedCheckpoint,
)

# public name -> the module that defines it (relative to this package)
ENGINE_NAMES = {
    "LoadConfig": ".engine.config",
    "SaveConfig": ".engine.config",
    "SignConfig": ".engine.config",
    "VerifyConfig": ".engine.config",
    "LoadResult": ".engine.load.loader",
    "load_checkpoint": ".engine.load.loader",
    "CheckpointRecord": ".engine.metrics",
    "read_events": ".engine.metrics",
    "SaveResult": ".engine.save.persist",
    "PeersConfig": ".engine.tiers.config",
    "TierConfig": ".engine.tiers.config",
    "TiersConfig": ".engine.tiers.config",
    "CheckpointSaver": ".engine.save.saver",
    "PendingSave": ".engine.save.saver",
    "CheckpointInfo": ".ops.roots",
    "CheckpointListing": ".ops.roots",
    "ManifestSummary": ".ops.roots",
    "follow_checkpoints": ".ops.roots",
    "list_checkpoints": ".ops.roots",
    "read_manifest_summary": ".ops.roots",
    "resolve_checkpoint": ".ops.roots",
    "ExportOptions": ".ops.export",
    "ExportResult": ".ops.export",
    "export_checkpoint": ".ops.export",
    "VerifyReport": ".ops.verify",
    "verify_checkpoint": ".ops.verify",
    "DrillConfig": ".policies.drills.drills_plugin",
    "Transition": ".policies.health.evaluate",
    "HealthConfig": ".policies.health.rules",
    "HealthRule": ".policies.health.rules",
    "NormalRange": ".policies.health.rules",
    "Persistence": ".policies.health.rules",
    "HealthControl": ".policies.health.mitigations",
    "MitigationContext": ".policies.health.mitigations",
    "register_mitigation": ".policies.health.mitigations",
    "Plugin": ".policies.plugin",
    "PluginContext": ".policies.plugin",
    "PluginState": ".policies.plugin",
    "ControlApplier": ".policies.decisions",
    "ControlExchange": ".policies.decisions",
    "CounterSource": ".policies.decisions",
    "DrillTarget": ".policies.decisions",
    "IntervalScaler": ".policies.decisions",
    "ManifestExtras": ".policies.decisions",
    "PlanShaper": ".policies.decisions",
    "RetentionGuard": ".policies.decisions",
    "RunMembership": ".policies.decisions",
    "SaverRouter": ".policies.decisions",
    "StopDecider": ".policies.decisions",
    "CheckpointOptions": ".training.checkpoint_options",
    "Checkpointer": ".training.checkpointer",
    "ResumableDistributedSampler": ".training.data",
}
LIGHTNING_NAMES = {
    "ShardedCheckpoint": ".lightning.trainer.callback",
    "ShardedDDPStrategy": ".lightning.trainer.strategy",
    "ShardedFSDPStrategy": ".lightning.trainer.strategy",
    "ShardedStrategy": ".lightning.trainer.strategy",
    "ShardedFabricStrategy": ".lightning.fabric.strategy",
    "ShardedFabricDDPStrategy": ".lightning.fabric.strategy",
    "ShardedFabricFSDPStrategy": ".lightning.fabric.strategy",
}


def __getattr__(name: str) -> Any:
    if name in LIGHTNING_NAMES and importlib.util.find_spec("lightning") is None:
        raise ImportError(
            f"lightning_shardckpt.{name} is the Lightning adapter and Lightning does not import here; "
            "install it (pip install 'lightning>=2.4'), or use the plain-PyTorch front door (Checkpointer) "
            "or the engine (CheckpointSaver, load_checkpoint)"
        )
    module = ENGINE_NAMES.get(name) or LIGHTNING_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_shardckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if sys.modules.get("lightning") is not None:  # Lightning is loaded already: register the strategy names now, cheaply
    importlib.import_module(".lightning", __name__)

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from .engine.config import LoadConfig, SaveConfig, SignConfig, VerifyConfig
    from .engine.load.loader import LoadResult, load_checkpoint
    from .engine.metrics import CheckpointRecord, read_events
    from .engine.save.persist import SaveResult
    from .engine.save.saver import CheckpointSaver, PendingSave
    from .engine.tiers.config import PeersConfig, TierConfig, TiersConfig
    from .lightning.fabric.strategy import ShardedFabricDDPStrategy, ShardedFabricFSDPStrategy, ShardedFabricStrategy
    from .lightning.trainer.callback import ShardedCheckpoint
    from .lightning.trainer.strategy import ShardedDDPStrategy, ShardedFSDPStrategy, ShardedStrategy
    from .ops.export import ExportOptions, ExportResult, export_checkpoint
    from .ops.roots import (
        CheckpointInfo,
        CheckpointListing,
        ManifestSummary,
        follow_checkpoints,
        list_checkpoints,
        read_manifest_summary,
        resolve_checkpoint,
    )
    from .ops.verify import VerifyReport, verify_checkpoint
    from .policies.decisions import (
        ControlApplier,
        ControlExchange,
        CounterSource,
        DrillTarget,
        IntervalScaler,
        ManifestExtras,
        PlanShaper,
        RetentionGuard,
        RunMembership,
        SaverRouter,
        StopDecider,
    )
    from .policies.drills.drills_plugin import DrillConfig
    from .policies.health.evaluate import Transition
    from .policies.health.mitigations import HealthControl, MitigationContext, register_mitigation
    from .policies.health.rules import HealthConfig, HealthRule, NormalRange, Persistence
    from .policies.plugin import Plugin, PluginContext, PluginState
    from .training.checkpoint_options import CheckpointOptions
    from .training.checkpointer import Checkpointer
    from .training.data import ResumableDistributedSampler

# the errors above, ENGINE_NAMES and LIGHTNING_NAMES (tests/unit/test_public_api.py holds them equal)
__all__ = [
    "CheckpointOptions",
    "Checkpointer",
    "CheckpointInfo",
    "CheckpointListing",
    "CheckpointNotFound",
    "CheckpointRecord",
    "CheckpointSaver",
    "CommitFailed",
    "ConfigError",
    "CorruptCheckpoint",
    "DrillConfig",
    "ExportOptions",
    "ExportResult",
    "HealthConfig",
    "HealthControl",
    "HealthRule",
    "IncompatibleCheckpoint",
    "LoadConfig",
    "LoadResult",
    "ManifestSummary",
    "MitigationContext",
    "NormalRange",
    "PeersConfig",
    "PendingSave",
    "Plugin",
    "PluginContext",
    "ResumableDistributedSampler",
    "Persistence",
    "SaveConfig",
    "SaveResult",
    "ShardCkptError",
    "ShardedCheckpoint",
    "ShardedDDPStrategy",
    "ShardedFSDPStrategy",
    "ShardedFabricDDPStrategy",
    "ShardedFabricFSDPStrategy",
    "ShardedFabricStrategy",
    "ShardedStrategy",
    "SignConfig",
    "SignatureRefused",
    "StorageUnavailable",
    "TierConfig",
    "TiersConfig",
    "Transition",
    "UntrustedCheckpoint",
    "VerifyConfig",
    "VerifyReport",
    "export_checkpoint",
    "follow_checkpoints",
    "list_checkpoints",
    "load_checkpoint",
    "read_events",
    "read_manifest_summary",
    "register_mitigation",
    "resolve_checkpoint",
    "verify_checkpoint",
    "ControlApplier",
    "ControlExchange",
    "CounterSource",
    "DrillTarget",
    "IntervalScaler",
    "ManifestExtras",
    "PlanShaper",
    "RetentionGuard",
    "RunMembership",
    "SaverRouter",
    "StopDecider",
    "PluginState",
]
