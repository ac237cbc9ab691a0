"""What plug-ins (policies/plugin.py) see of a Lightning run: the Trainer's loggers, W&B alerts, collectives.

The plug-ins know no framework; this is their Lightning face: metrics go to `trainer.loggers` at the
current step, alerts to the W&B run when there is one, and the all-reduce that carries the health
control state runs on the training group, on the strategy's device.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from ...policies.plugin import PluginContext, Reporter
from .wandb_artifacts import mark_deleted, wandb_run

log = logging.getLogger(__name__)


class TrainerReporter(Reporter):
    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def log_metrics(self, values: dict[str, float]) -> None:
        for logger in self.trainer.loggers:
            logger.log_metrics(values, step=self.trainer.global_step)

    def alert(self, title: str, text: str, level: str, wait_s: float) -> None:
        run = wandb_run(self.trainer.loggers)
        if run is None or not hasattr(run, "alert"):
            return  # the log line and the event are the alert for other loggers
        try:
            import wandb

            run.alert(title=title, text=text, level=getattr(wandb.AlertLevel, level), wait_duration=wait_s)
        except Exception:  # an alert that cannot be sent is logged, never raised into training
            log.warning("could not send the W&B alert %r", title, exc_info=True)

    def checkpoints_deleted(self, deleted: list[dict[str, Any]]) -> None:
        mark_deleted(self.trainer.loggers, deleted)  # their W&B artifacts say so


def all_reduce_max(trainer: pl.Trainer):
    """MAX over the training group (every rank calls it at the same point), on the strategy's device."""

    def reduce(values: list[float]) -> list[float]:
        vector = torch.tensor(values, dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            vector = vector.to(trainer.strategy.root_device)
            dist.all_reduce(vector, op=dist.ReduceOp.MAX)
        return vector.cpu().tolist()

    return reduce


def plugin_context(trainer: pl.Trainer, plan: Any, **fields: Any) -> PluginContext:
    return PluginContext(
        location=plan.location,
        storage_options=dict(plan.save.storage_options),
        is_global_zero=trainer.is_global_zero,
        world_size=trainer.world_size,
        strategy=trainer.strategy,
        reporter=TrainerReporter(trainer),
        all_reduce_max=all_reduce_max(trainer),
        allow_shared_root=plan.save.allow_shared_root,
        fault_hook=trainer.strategy.fault_hook,
        **fields,
    )
