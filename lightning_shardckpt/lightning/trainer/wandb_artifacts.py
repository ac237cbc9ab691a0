"""Record committed checkpoints as W&B artifacts by reference: their URI and manifest digest, no bytes; and
mark them when retention deletes the checkpoint, so nobody follows a dead reference.

How a deletion is marked depends on what W&B allows:
- every run (online and offline): the run's summary `checkpoint/deleted_by_retention` lists each deleted
  checkpoint (step, uri, deleted_at, the artifact version `checkpoints-<run id>:step-<N>`), and
  `checkpoint/deleted_steps` the steps; an offline run's file carries them to `wandb sync`;
- online, for a version this process logged: the version itself gets `deleted_by_retention: true` and
  `deleted_at` in its metadata and a description saying the checkpoint is gone. W&B cannot change a version
  an offline run logged (it is not on the server yet, and the SDK cannot fetch it back), nor one logged by
  an earlier process of a resumed run without a server round trip; the summary covers those.
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timezone
from typing import Any

from ...engine.metrics import CheckpointRecord

log = logging.getLogger(__name__)

SUMMARY_DELETED, SUMMARY_DELETED_STEPS = "checkpoint/deleted_by_retention", "checkpoint/deleted_steps"
SUMMARY_KEEP = 200  # deleted checkpoints listed in full in the summary (the newest); every step stays in the steps list
WAIT_S = 30  # for an online version still uploading before its metadata can change
REMEMBER = 1000  # logged versions remembered for marking (retention deletes the oldest first)
# (W&B run id, checkpoint directory) -> the artifact version this process logged for it
_logged: dict[tuple[str, str], Any] = {}


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
                name=artifact_name(run),
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
            _logged[(run.id, _dirname(record.path))] = run.log_artifact(
                artifact, aliases=[f"step-{record.step}", "latest"]
            )
            while len(_logged) > REMEMBER:  # without retention nothing is ever marked: keep the memory bounded
                _logged.pop(next(iter(_logged)))
        except Exception:  # an artifact is a convenience: never fail a run for it
            log.warning("could not log checkpoint step %d as a W&B artifact", record.step, exc_info=True)


def mark_deleted(loggers: list[Any], deleted: list[dict[str, Any]]) -> None:
    """For each WandbLogger: record that retention deleted these checkpoints (see the module's docstring)."""
    for logger in loggers:
        if type(logger).__name__ != "WandbLogger":
            continue
        try:
            run = logger.experiment
            rows = [
                {
                    **entry,
                    "deleted_at": _iso(entry["deleted_at"]),
                    "artifact": f"{artifact_name(run)}:step-{entry['step']}",
                }
                for entry in deleted
            ]
            listed = list(run.summary.get(SUMMARY_DELETED) or []) + rows
            steps = list(run.summary.get(SUMMARY_DELETED_STEPS) or []) + [row["step"] for row in rows]
            run.summary.update({SUMMARY_DELETED: listed[-SUMMARY_KEEP:], SUMMARY_DELETED_STEPS: steps})
            for row in rows:
                _mark_version(run, row)
        except Exception:  # a mark is a convenience: never fail a run for it
            log.warning(
                "could not mark deleted checkpoints on W&B: %s", [e["checkpoint"] for e in deleted], exc_info=True
            )


def artifact_name(run: Any) -> str:
    return f"checkpoints-{run.id}"


def _mark_version(run: Any, row: dict[str, Any]) -> None:
    """Online: the logged version itself says the checkpoint is gone (offline: W&B cannot update it)."""
    artifact = _logged.pop((run.id, row["checkpoint"]), None)
    if artifact is None or run.offline:
        return
    artifact.wait(timeout=WAIT_S)
    artifact.metadata = {**artifact.metadata, "deleted_by_retention": True, "deleted_at": row["deleted_at"]}
    artifact.description = f"deleted by retention at {row['deleted_at']}: {row['uri']} no longer exists"
    artifact.save()


def _dirname(path: str | None) -> str:
    return (path or "").rstrip("/").rsplit("/", 1)[-1]


def _iso(stamp: float) -> str:
    return datetime.fromtimestamp(stamp, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _uri(path: str | None) -> str:
    if path is None:
        raise ValueError("a committed checkpoint has a path")
    return path if "://" in path else "file://" + os.path.abspath(path)
