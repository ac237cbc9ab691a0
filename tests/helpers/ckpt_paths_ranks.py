"""Four fits on one process group: Lightning's `ckpt_path` spellings and ModelCheckpoint beside ShardedCheckpoint.

1. fresh: ShardedCheckpoint + ModelCheckpoint(filename="{step}-{train_loss:.4f}", top-2, save_last=True),
   `train_loss` logged without sync_dist (a per-rank value in the filename);
2. `ckpt_path="last"` with both: Lightning's `last.ckpt` (step 6 -> 10);
3. `ckpt_path="last"` with ShardedCheckpoint alone: its root's newest (step 10 -> 11);
4. `ckpt_path=<a checkpoint of another root>` into a new root: a fork (step 11 -> 13), whose callback state
   Lightning files under the source's dirpath.
Every resume is mid-epoch (12 batches per epoch), where Lightning warns about loaders it cannot resume.

Each rank's stderr (fd 2) goes to a file for the test to read: what the console shows at the default level.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shardckpt import ShardedCheckpoint
from tests.helpers.lightning_run import TinyData, TinyModule, ddp_trainer, lightning_env


class PerRankLoss(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (inputs,) = batch
        loss = self.net(inputs).pow(2).mean()
        self.log("train_loss", loss)  # no sync_dist: each rank's own value, as users often write it
        return loss


def _fit(workdir: str, root: str, max_steps: int, ckpt_path: Any, model_checkpoint: bool) -> dict:
    sharded = ShardedCheckpoint(f"{workdir}/{root}", every_n_train_steps=100, log_artifact=False)
    callbacks: list[Any] = [sharded]
    lightning_ckpt = None
    if model_checkpoint:
        lightning_ckpt = ModelCheckpoint(
            dirpath=f"{workdir}/lightning",
            filename="{step}-{train_loss:.4f}",
            monitor="train_loss",
            save_top_k=2,
            every_n_train_steps=2,
            save_last=True,
        )
        callbacks.append(lightning_ckpt)
    trainer = ddp_trainer(2, max_steps, callbacks)
    started: dict[str, Any] = {}

    class AtStart(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
            started["step"] = trainer.global_step

    trainer.callbacks.append(AtStart())
    trainer.fit(PerRankLoss(), datamodule=TinyData(), ckpt_path=ckpt_path)
    loaded = trainer.strategy.last_load
    return {
        "start_step": started.get("step"),
        "global_step": trainer.global_step,
        "resumed_path": loaded.path if loaded is not None else None,
        "batches_per_epoch": trainer.num_training_batches,
        "best_k": sorted(lightning_ckpt.best_k_models) if lightning_ckpt is not None else [],
        "last_model_path": lightning_ckpt.last_model_path if lightning_ckpt is not None else None,
    }


def ckpt_paths_on_rank(rank: int, world_size: int, workdir: str) -> dict:
    lightning_env(rank, world_size)
    captured = os.open(f"{workdir}/stderr-{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    saved_stderr = os.dup(2)
    sys.stderr.flush()
    os.dup2(captured, 2)
    try:
        fits = {
            "fresh": _fit(workdir, "run", 6, None, model_checkpoint=True),
            "last_with_model_checkpoint": _fit(workdir, "run", 10, "last", model_checkpoint=True),
            "last_alone": _fit(workdir, "run", 11, "last", model_checkpoint=False),
        }
        # an explicit path to one committed checkpoint of workdir/run (its newest, step 11: mid-epoch), into a new root
        source = max(os.path.join(f"{workdir}/run", n) for n in os.listdir(f"{workdir}/run") if n.startswith("step-"))
        fits["fork"] = _fit(workdir, "fork", 13, source, model_checkpoint=False)
    finally:
        sys.stderr.flush()
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
        os.close(captured)
    return fits
