"""How a front door's options (ShardedCheckpoint's, Checkpointer's) become its plug-ins and its checkpoint plan."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..engine.config import LIGHTNING, LoadConfig, SaveConfig
from ..engine.tiers.config import TiersConfig
from ..policies.drills.plugin import DrillConfig, TrainingDrills
from ..policies.health.plugin import HealthWatch
from ..policies.health.rules import HealthConfig
from ..policies.plugin import PluginList
from ..policies.retention_plugin import RetentionPlugin
from ..policies.tiers.plugin import TiersPlugin
from .callback_options import CallbackConfig
from .plan import CheckpointPlan, Placement


def checkpoint_plugins(
    options: CallbackConfig, tiers: TiersConfig | None, drill: DrillConfig, health: HealthConfig
) -> PluginList:
    """In this order: their saver listeners run so (replication, then retention, then the health rules)."""
    tier_keep = tiers.fast.keep_last if tiers is not None else None
    keep_last = tier_keep if tier_keep is not None else options.keep_last
    return PluginList(
        ([TiersPlugin(tiers)] if tiers is not None else [])
        + [
            RetentionPlugin(keep_last, options.keep_every_n_steps, drill.keep_last_drilled),
            TrainingDrills(drill),
            HealthWatch(health),
        ]
    )


def checkpoint_plan(
    root: str,
    save: SaveConfig,
    load: LoadConfig,
    resume_required: bool,
    plugins: PluginList,
    placement: Placement,
    front_door: str = LIGHTNING,
) -> CheckpointPlan:
    """The plan of this process: plug-ins shape it (tiers: this node's fast root; drills: the fallback); the
    load reads with the storage options the save writes with. `front_door`: whose words errors advise in."""
    save = dataclasses.replace(save, front_door=front_door)
    plan = CheckpointPlan(root=root, save=save, load=load, resume_required=resume_required)
    plan = plugins.shape_plan(plan, placement)
    return dataclasses.replace(plan, load=dataclasses.replace(plan.load, storage_options=plan.save.storage_options))


def placement_of(trainer: Any) -> Placement:
    return Placement(node_rank=trainer.node_rank, local_rank=trainer.local_rank, num_nodes=trainer.num_nodes)


def placement_from_env() -> Placement:
    """Where this process runs, from torchrun's environment (a single process: node 0, local rank 0)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return Placement(
        node_rank=int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        num_nodes=max(1, int(os.environ.get("WORLD_SIZE", "1")) // max(1, local_world)),
    )
