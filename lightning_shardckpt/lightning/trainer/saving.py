"""A save's request on the training thread (every rank): Lightning's snapshot and what goes with it."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from ...engine.format.outcomes import METRICS_EXTRA, encode_metrics
from ...engine.save.saver import PendingSave
from ...policies.plugin import PluginList
from .data_position import DataPosition
from .run_identity import RunIdentity
from .strategy import ShardedStrategy


def request_save(
    trainer: pl.Trainer, saver: Any, identity: RunIdentity, plugins: PluginList, *, never_skip: bool
) -> PendingSave:
    """Every rank: Lightning's snapshot and what goes with it, handed to the saver (which copies in the background)."""
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    current = identity.current(trainer, trainer.lightning_module) if trainer.is_global_zero else None
    extra = plugins.save_extra(trainer.lightning_module, trainer.global_rank)  # every rank: the probe's collectives
    # the outcome next to the identity: what the run logged by the time it saved (floats only)
    extra = {**(extra or {}), METRICS_EXTRA: encode_metrics(trainer.callback_metrics)}
    return ShardedStrategy.of(trainer).save_to_saver(
        saver,
        checkpoint,
        identity=current,
        samples_consumed=DataPosition.samples_consumed(trainer),
        extra=extra,
        never_skip=never_skip,
    )
