"""CheckpointPlan: everything a strategy needs from the checkpoint callback, handed over in one call.

`ShardedCheckpoint.setup` builds one plan (plug-ins shape it: tiers move the root to the fast tier) and
gives it to `ShardedStrategy.use_plan`. Frozen: a later change is a new plan, never an attribute written
on the strategy from outside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..engine.config import LoadConfig, SaveConfig
from ..engine.storage import fsio


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where this process runs: what plug-ins need to shape the plan (a node-local fast tier)."""

    node_rank: int = 0
    local_rank: int = 0
    num_nodes: int = 1


@dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    """The checkpoint root of this process and how to save to and load from it."""

    root: str  # this node's checkpoint root: `ckpt_path="latest"`, step numbers and ids are looked up here
    save: SaveConfig = field(default_factory=SaveConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    resume_required: bool = False  # ckpt_path="latest" with nothing committed: fail instead of starting fresh
    fallback_to_last_good: bool = False  # "latest" that fails to load resumes from the last known-good instead
    tier_restore: Any = None  # policies.tiers.CheckpointTiers: `latest` / `last-good` consider every tier

    @cached_property
    def location(self) -> fsio.Location:
        """The root, resolved (filesystem and path) with the save's storage options: the one object for it."""
        return fsio.resolve(self.root, self.save.storage_options)

    def owns(self, checkpoint_path: str) -> bool:
        """`checkpoint_path` is a checkpoint directory directly under this root."""
        parent = fsio.resolve(checkpoint_path.rstrip("/").rsplit("/", 1)[0], self.save.storage_options)
        return parent.same_place(self.location)
