"""How a front door's options (ShardedCheckpoint's, ShardedFabricStrategy's, Checkpointer's) become its plug-ins
and its checkpoint plan."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from ..engine.config import LIGHTNING, LoadConfig, SaveConfig
from ..engine.tiers.config import TiersConfig, tiers_config_from
from ..policies.drills.drills_plugin import DrillConfig, TrainingDrills, drill_config_from
from ..policies.health.health_plugin import HealthWatch
from ..policies.health.rules import HealthConfig, health_config_from
from ..policies.plan import CheckpointPlan, Placement
from ..policies.plugin import Plugin, PluginList
from ..policies.retention_plugin import RetentionPlugin
from ..policies.tiers.tiers_plugin import TiersPlugin, tiered_dirpath
from .callback_options import CallbackConfig


def door_plugins(
    options: CallbackConfig, tiers: Any, drill: Any, health: Any, extra: Sequence[Plugin] | None = None
) -> tuple[PluginList, TiersConfig | None]:
    """A door's plug-ins from its options as the user gave them (dataclasses, dicts, Hydra blocks), validated now:
    bad options fail before training starts; `extra`: the user's own plug-ins, after ours. Returns the tiers'
    config too (it moves the root)."""
    tiers_config = tiers_config_from(tiers)
    plugins = checkpoint_plugins(options, tiers_config, drill_config_from(drill), health_config_from(health))
    for plugin in extra or ():
        plugins.add(plugin)  # checked there: a Plugin, its events and decisions spelt and shaped as the run calls them
    return plugins, tiers_config


def door_plan(
    root: str | None,
    options: CallbackConfig,
    save: SaveConfig,
    load: LoadConfig,
    *,
    tiers: Any,
    drill: Any,
    health: Any,
    placement: Placement,
    front_door: str,
    extra: Sequence[Plugin] | None = None,
) -> tuple[PluginList, CheckpointPlan]:
    """A door's plug-ins and its plan in one step, where the placement is known at construction (a plain loop)."""
    plugins, tiers_config = door_plugins(options, tiers, drill, health, extra)
    root = tiered_dirpath(root, tiers_config)
    return plugins, checkpoint_plan(root, save, load, options.resume_required, plugins, placement, front_door)


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
