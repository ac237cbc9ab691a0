"""Finished saves, on the training thread: drain the saver, log each record, tell the plug-ins of commits.

Every front door runs these steps at each step end; where a record is logged is the front door's: the
Trainer's loggers (lightning/trainer/saving.py), or a plain loop's `log_metrics(values, step)` (e.g. `wandb.log`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..engine import metrics
from ..engine.metrics import CheckpointRecord
from ..policies.plugin import PluginContext, PluginList, Reporter

if TYPE_CHECKING:
    from ..engine.save.saver import CheckpointSaver

log = logging.getLogger(__name__)

LogMetrics = Callable[[dict[str, float], int], Any]
LogRecord = Callable[[CheckpointRecord, dict[str, int]], None]  # a finished save and the running counters


class CallableReporter(Reporter):
    """Plug-ins' metrics (drills, health) to the loop's `log_metrics`, at the loop's current step."""

    def __init__(self, log_metrics: LogMetrics | None, step: Callable[[], int]) -> None:
        self.log_metrics_to, self.step = log_metrics, step

    def log_metrics(self, values: dict[str, float]) -> None:
        if self.log_metrics_to is not None:
            self.log_metrics_to(values, self.step())


def drain_finished(
    saver: CheckpointSaver | None, plugins: PluginList, context: PluginContext, log_record: LogRecord
) -> None:
    """Every rank drains its saver's records; rank 0 logs each (`log_record(record, counters)`) and hands the
    commits to the plug-ins (drills). The front door says where a record goes (its loggers, a callable)."""
    if saver is None:
        return
    records = saver.poll_records()
    if not context.is_global_zero:
        return
    plugins.drain(context)  # finished drills, health alerts and drill_now requests
    if not records:
        return
    # notes: failed_dirs_removed, retention_errors, ...; plug-ins': replicated, replication_failed, ...
    counters = {**saver.counters.snapshot(), **saver.counters.notes(), **plugins.counters()}
    for record in records:
        log_record(record, counters)
        if record.outcome == metrics.COMMITTED:
            plugins.on_commit(record)  # drills: a queue put, the drill runs on its own thread and processes


def record_logger(reporter: Reporter) -> LogRecord:
    """A finished save's metrics and the saver's running counters, through the reporter's `log_metrics`."""

    def log_record(record: CheckpointRecord, counters: dict[str, int]) -> None:
        if record.outcome == metrics.FAILED:
            log.error("checkpoint of step %d failed: %s", record.step, record.cause)
        values = record.metrics()
        values.update({f"checkpoint/{name}": float(value) for name, value in counters.items()})
        reporter.log_metrics(values)

    return log_record
