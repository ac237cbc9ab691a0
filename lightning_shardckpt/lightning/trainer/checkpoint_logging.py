"""What rank 0 tells the Trainer's loggers about checkpoints: one record per save, where a resume came from."""

from __future__ import annotations

import logging

import lightning.pytorch as pl

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


def log_resumed_from(trainer: pl.Trainer, loaded: LoadResult) -> None:
    """Where the resume came from, as a hyperparameter of the Trainer's loggers (rank 0, once per resume; its
    metrics, the event and the console line are training/resume_sequence.py's, the same in every door)."""
    for logger in trainer.loggers:
        logger.log_hyperparams({"shardckpt/resumed_from": loaded.path})
