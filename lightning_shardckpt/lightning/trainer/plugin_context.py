"""Where plug-ins (policies/plugin.py) report in a Lightning run: the Trainer's loggers and W&B alerts.

The plug-ins know no framework; this is their Lightning face: metrics go to `trainer.loggers` at the current step,
alerts to the W&B run when there is one, deletions mark the W&B artifacts. (Their collectives are the strategy's:
it is the saver host's `Agreement`.)
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl

from ...policies.plugin import Reporter
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

            # wandb's __init__.pyi omits AlertLevel, which its __init__.py exports (wandb.AlertLevel.WARN, ...)
            levels = wandb.AlertLevel  # type: ignore[attr-defined]
            run.alert(title=title, text=text, level=getattr(levels, level), wait_duration=wait_s)
        except Exception:  # an alert that cannot be sent is logged, never raised into training
            log.warning("could not send the W&B alert %r", title, exc_info=True)

    def checkpoints_deleted(self, deleted: list[dict[str, Any]]) -> None:
        mark_deleted(self.trainer.loggers, deleted)  # their W&B artifacts say so
