"""ShardedCheckpoint records the run's metrics (trainer.callback_metrics) in each manifest, and bisect
finds the checkpoint where a mid-run config change made the loss jump, with the config diff naming it."""

from __future__ import annotations

from typing import Any

import torch

from lightning_shardckpt import ShardedCheckpoint
from lightning_shardckpt.engine.format.outcomes import decode_metrics
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.ops.bisect import bisect, lineage_of
from lightning_shardckpt.ops.checks import parse_check
from tests.helpers.lightning_run import TinyData, TinyModule, ddp_trainer, lightning_env
from tests.helpers.spawn import run_ranks

LOSS = "train/loss"


class ScaledLoss(TinyModule):
    """TinyModule with a loss weight in its config: raising it mid-run is the config change under test."""

    def __init__(self, parallelism: str = "ddp", lr: float = 0.05, loss_scale: float = 1.0) -> None:
        super().__init__(parallelism=parallelism, lr=lr)
        self.save_hyperparameters()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (inputs,) = batch
        loss = self.net(inputs).pow(2).mean() * self.hparams.loss_scale
        self.log(LOSS, loss)
        return loss


def fit(rank: int, world_size: int, root: str, loss_scale: float, max_steps: int, ckpt_path: Any) -> int:
    lightning_env(rank, world_size)
    trainer = ddp_trainer(world_size, max_steps, [ShardedCheckpoint(root, every_n_train_steps=2, log_artifact=False)])
    trainer.fit(ScaledLoss(loss_scale=loss_scale), datamodule=TinyData(), ckpt_path=ckpt_path)
    return trainer.global_step


def test_a_config_change_that_makes_the_loss_jump_is_found_by_a_metric_bisect(tmp_path):
    root = str(tmp_path / "run")
    assert run_ranks(fit, 2, root, 1.0, 6, None, timeout_s=240)[0].value == 6
    assert run_ranks(fit, 2, root, 1000.0, 12, "latest", timeout_s=240)[0].value == 12  # the same run, resumed
    location = fsio.resolve(root)
    losses = {entry.step: decode_metrics(entry.manifest).get(LOSS) for entry in lineage_of(location)}
    assert sorted(losses) == [2, 4, 6, 8, 10, 12] and None not in losses.values(), losses  # recorded at every save
    threshold = 10 * max(losses[step] for step in (2, 4, 6))
    assert all(losses[step] > threshold for step in (8, 10, 12)), losses

    check, kind = parse_check(f"metric:{LOSS}>{threshold}")
    report = bisect(location, check, kind=kind)
    assert (report["last_good"]["step"], report["first_bad"]["step"]) == (6, 8)
    assert report["identity"]["differs"] == ["config"]
    assert report["identity"]["blocks"]["config"]["lines"] == ["hyperparameter loss_scale: 1.0 -> 1000.0"]
    assert report["resume"]["ckpt_path"] == report["last_good"]["path"]
