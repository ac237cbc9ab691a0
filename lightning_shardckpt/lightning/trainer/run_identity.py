"""The identity of the running fit — config, model, code, run, data position — and its check at resume.

Every manifest carries it (identity/blocks.py); a resume compares the checkpoint's with this run's before
the first step, under the user's IdentityPolicy (identity/diff.py: error, warn or ignore per block).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl

from ...engine.load.loader import LoadResult
from ...identity import blocks as identity
from ...identity.diff import WARN, IdentityPolicy, compare
from ...policies.config_blocks import options_from
from .sampler_injection import train_sampler
from .wandb_artifacts import wandb_run

log = logging.getLogger(__name__)


class RunIdentity:
    """What ShardedCheckpoint records of the run; the static blocks are computed once per fit."""

    def __init__(self, run_config: Any, dataset_version: str | None, policy: Any) -> None:
        self.run_config = run_config
        self.dataset_version = dataset_version
        self.policy = options_from(IdentityPolicy, policy, "identity_policy block")  # validated at construction
        self._static: dict[str, Any] | None = None  # config, model, code, run

    def forget(self) -> None:
        """A new fit: the model, config or logger may have changed since the last one."""
        self._static = None

    def current(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        if self._static is None:
            run = wandb_run(trainer.loggers)
            self._static = {
                "config": identity.config_identity(self.run_config, hyperparameters=dict(pl_module.hparams) or None),
                "model": identity.model_identity(pl_module),
                "code": identity.code_identity(),
                "run": identity.run_identity(
                    device_type=trainer.strategy.root_device.type,
                    wandb_run_id=getattr(run, "id", None),
                    wandb_url=getattr(run, "url", None),
                ),
            }
        sampler, _ = train_sampler(trainer)
        dataset = sampler.dataset if sampler is not None else None
        data = identity.data_identity(
            dataset,
            dataset_version=self.dataset_version,
            seed=sampler.seed if sampler is not None else None,
            epoch=trainer.current_epoch,
            samples_consumed=sampler.global_position if sampler is not None else None,
        )
        return {**self._static, "data": data}

    def check_resume(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loaded: LoadResult
    ) -> dict[str, Any] | None:
        """Before the first step of a resumed run: the checkpoint's identity against this run's (raises under
        policy `error`). On rank 0, returns the comparison the `resume` event carries (training/resume_sequence.py
        writes it); None elsewhere."""
        report = compare(
            loaded.manifest.get("identity"), self.current(trainer, pl_module), self.policy, where=loaded.path
        )
        if not trainer.is_global_zero:
            return None
        # the blocks `compare` already warned about are named, not printed a second time
        warned = [diff.block for diff in report.diffs if diff.action == WARN]
        rest = "\n".join(diff.render() for diff in report.diffs if diff.action != WARN)
        summary = rest or ("identity matches" if report.matches else "")
        if warned:
            summary = f"{summary}\n(differs in {', '.join(warned)}: warned above)".lstrip("\n")
        log.info("identity of %s: %s", loaded.path, summary)
        return {"differences": report.differences, "unrecorded": report.unrecorded}
