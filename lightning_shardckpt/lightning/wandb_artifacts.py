"""Record committed checkpoints as W&B artifacts by reference: their URI and manifest digest, no bytes."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..engine.metrics import CheckpointRecord

log = logging.getLogger(__name__)


def wandb_run(loggers: list[Any]) -> Any:
    """The W&B run of the first WandbLogger, or None."""
    for logger in loggers:
        if type(logger).__name__ == "WandbLogger":
            return logger.experiment
    return None


def log_checkpoint_artifact(loggers: list[Any], record: CheckpointRecord, manifest_digest: str | None) -> None:
    """For each WandbLogger: an artifact of type 'checkpoint' that references the committed directory."""
    for logger in loggers:
        if type(logger).__name__ != "WandbLogger":
            continue
        try:
            import wandb

            run = logger.experiment
            artifact = wandb.Artifact(
                name=f"checkpoints-{run.id}",
                type="checkpoint",
                metadata={
                    "step": record.step,
                    "checkpoint_id": record.checkpoint_id,
                    "uri": record.path,
                    "manifest_digest": manifest_digest,
                    "bytes_total": record.bytes_total,
                },
            )
            artifact.add_reference(_uri(record.path), name=f"step-{record.step:09d}", checksum=False)
            run.log_artifact(artifact, aliases=[f"step-{record.step}", "latest"])
        except Exception:  # an artifact is a convenience: never fail a run for it
            log.warning("could not log checkpoint step %d as a W&B artifact", record.step, exc_info=True)


def _uri(path: str | None) -> str:
    if path is None:
        raise ValueError("a committed checkpoint has a path")
    return path if "://" in path else "file://" + os.path.abspath(path)
