"""What rank 0 tells the Trainer's loggers about checkpoints: one record per save, one line per resume."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ...engine.format.checksum import checksum
from ...engine.format.manifest import to_bytes
from ...engine.load.loader import LoadResult
from ...engine.metrics import CheckpointRecord
from .wandb_artifacts import log_checkpoint_artifact

log = logging.getLogger(__name__)


def log_record(
    trainer: pl.Trainer, record: CheckpointRecord, counters: dict[str, int], *, log_metrics: bool, log_artifact: bool
) -> None:
    """A finished save: its metrics plus the saver's running counters, and the committed one as a W&B artifact."""
    if record.outcome == "failed":
        log.error("checkpoint of step %d failed: %s", record.step, record.cause)
    if log_metrics:
        values = record.metrics()
        values.update({f"checkpoint/{name}": float(value) for name, value in counters.items()})
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step)
    if log_artifact and record.outcome == "committed":
        manifest = record.manifest
        digest = checksum(to_bytes(manifest)) if manifest else None
        log_checkpoint_artifact(trainer.loggers, record, digest)


def log_resume(trainer: pl.Trainer, tiers: Any = None) -> None:
    """Where the run resumed from and how long the load took (rank 0 calls it once per fit): one line on
    the console, and the loggers' metrics. `tiers`: the plan's CheckpointTiers, naming the tier read."""
    loaded = trainer.strategy.last_load
    # Lightning's own logger: shown at its default level, as its "Restoring states ..." line is (ours is
    # not configured by default, so an INFO line there would be invisible)
    rank_zero_info(resume_line(loaded, trainer.world_size, tiers))
    for logger in trainer.loggers:
        logger.log_metrics(
            {"checkpoint/resume_s": loaded.seconds, "checkpoint/resumed_step": float(loaded.step)},
            step=trainer.global_step,
        )
        logger.log_hyperparams({"shardckpt/resumed_from": loaded.path})


def resume_line(loaded: LoadResult, world_size: int, tiers: Any = None) -> str:
    """`... resumed from PATH (step 40) on 4 -> 2 ranks, durable tier, in 1.23s` (the words of `shardckpt timeline`)."""
    before = (loaded.manifest.get("topology") or {}).get("world_size")
    tier = "" if tiers is None else f", {'durable' if tiers.owns(loaded.path) else 'fast'} tier"
    return (
        f"lightning_shardckpt: resumed from {loaded.path} (step {loaded.step}) on "
        f"{before if before is not None else '?'} -> {world_size} ranks{tier}, in {loaded.seconds:.2f}s"
    )
