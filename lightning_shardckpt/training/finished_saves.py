"""Finished saves, on the training thread of a loop without Lightning: drain the saver, log, tell the plug-ins.

The Lightning face of the same steps is lightning/saving.py (`log_finished`), which logs to the Trainer's
loggers; here rank 0 logs through the loop's own `log_metrics(values, step)` callable (e.g. `wandb.log`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..engine import metrics
from ..policies.plugin import PluginContext, PluginList, Reporter

log = logging.getLogger(__name__)

LogMetrics = Callable[[dict[str, float], int], Any]


class CallableReporter(Reporter):
    """Plug-ins' metrics (drills, health) to the loop's `log_metrics`, at the loop's current step."""

    def __init__(self, log_metrics: LogMetrics | None, step: Callable[[], int]) -> None:
        self.log_metrics_to, self.step = log_metrics, step

    def log_metrics(self, values: dict[str, float]) -> None:
        if self.log_metrics_to is not None:
            self.log_metrics_to(values, self.step())


def drain_finished(saver: Any, plugins: PluginList, context: PluginContext, reporter: CallableReporter) -> None:
    """Every rank drains its saver's records; rank 0 logs them and hands the commits to the plug-ins (drills)."""
    if saver is None:
        return
    records = saver.poll_records()
    if not context.is_global_zero:
        return
    plugins.drain(context)  # finished drills, health alerts and drill_now requests
    if not records:
        return
    counters = {**saver.counters.snapshot(), **saver.counters.notes(), **plugins.counters()}
    for record in records:
        if record.outcome == metrics.FAILED:
            log.error("checkpoint of step %d failed: %s", record.step, record.cause)
        values = record.metrics()
        values.update({f"checkpoint/{name}": float(value) for name, value in counters.items()})
        reporter.log_metrics(values)
        if record.outcome == metrics.COMMITTED:
            plugins.on_commit(record)  # drills: a queue put, the drill runs on its own thread and processes
