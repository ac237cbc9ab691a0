"""The two halves of a save on the training thread: the request (every rank) and logging what finished."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from ...engine.format.outcomes import METRICS_EXTRA, encode_metrics
from ...engine.save.saver import PendingSave
from ...policies.plugin import PluginContext, PluginList
from ...training.finished_saves import drain_finished
from .checkpoint_logging import log_record
from .data_position import DataPosition
from .run_identity import RunIdentity


def request_save(
    trainer: pl.Trainer, saver: Any, identity: RunIdentity, plugins: PluginList, *, never_skip: bool
) -> PendingSave:
    """Every rank: Lightning's snapshot and what goes with it, handed to the saver (which copies in the background)."""
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    current = identity.current(trainer, trainer.lightning_module) if trainer.is_global_zero else None
    extra = plugins.save_extra(trainer.lightning_module, trainer.global_rank)  # every rank: the probe's collectives
    # the outcome next to the identity: what the run logged by the time it saved (floats only)
    extra = {**(extra or {}), METRICS_EXTRA: encode_metrics(trainer.callback_metrics)}
    return trainer.strategy.save_to_saver(
        saver,
        checkpoint,
        identity=current,
        samples_consumed=DataPosition.samples_consumed(trainer),
        extra=extra,
        never_skip=never_skip,
    )


def log_finished(
    trainer: pl.Trainer,
    saver: Any,
    plugins: PluginList,
    context: PluginContext,
    log_metrics: bool,
    log_artifact: bool,
) -> None:
    """Finished saves, on the training thread: every rank drains its saver, rank 0 logs and tells the plug-ins."""
    drain_finished(
        saver,
        plugins,
        context,
        lambda record, counters: log_record(
            trainer, record, counters, log_metrics=log_metrics, log_artifact=log_artifact
        ),
    )
