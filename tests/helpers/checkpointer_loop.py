"""A door's save loop built as the Checkpointer builds one (saves only when asked, one node, no tiers, drills or
health), for the tests that drive the door core directly: they choose the agreement it runs on and the reporter."""

from __future__ import annotations

from typing import Any

from lightning_shardckpt import LoadConfig, SaveConfig
from lightning_shardckpt.engine.config import CHECKPOINTER
from lightning_shardckpt.policies.plan import Placement
from lightning_shardckpt.training.callback_options import CallbackConfig
from lightning_shardckpt.training.checkpoint_setup import door_plan
from lightning_shardckpt.training.save_loop import SaveLoop
from lightning_shardckpt.training.savers import SaverHost


def checkpointer_loop(
    root: str,
    save: SaveConfig,
    *,
    agreement: Any,
    reporter: Any,
    world_size: int = 1,
    keep_last: int | None = None,
    fault_hook: Any = None,
) -> SaveLoop:
    """The loop over `root`, its saver host on `agreement` (a fake one, or a control group), rank 0 of `world_size`."""
    options = CallbackConfig.saves_when_asked(keep_last=keep_last, keep_every_n_steps=None, resume_required=False)
    plugins, plan = door_plan(
        root,
        options,
        save,
        LoadConfig(),
        tiers=None,
        drill=None,
        health=None,
        placement=Placement(node_rank=0, local_rank=0, num_nodes=1),
        front_door=CHECKPOINTER,
    )
    return SaveLoop(
        plan=plan,
        plugins=plugins,
        options=options,
        host=SaverHost(plan.save, agreement, fault_hook=fault_hook),
        reporter=reporter,
        rank=0,
        world_size=world_size,
    )
