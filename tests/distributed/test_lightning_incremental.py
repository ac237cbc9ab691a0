"""`save.incremental: true` through Lightning (ShardedStrategy + ShardedCheckpoint) on 2 gloo ranks, DDP
and FSDP2: a LoRA-style module (frozen base, trainable head) writes after its first checkpoint about its
trainable state, and every checkpoint verifies (referenced bytes included)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_shardckpt import ShardedCheckpoint, ShardedStrategy
from lightning_shardckpt.engine.format import parts_manifest
from lightning_shardckpt.ops.verify import verify_checkpoint
from tests.helpers.lightning_run import TinyData, lightning_env
from tests.helpers.spawn import run_ranks

WIDTH = 512


class LoraModule(pl.LightningModule):
    def __init__(self, parallelism: str) -> None:
        super().__init__()
        self.parallelism = parallelism
        torch.manual_seed(7)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(13, WIDTH), torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 5)
        )
        self.net[1].requires_grad_(False)  # the frozen base: 1 MiB of the 1.06 MiB

    def configure_model(self) -> None:
        if self.parallelism != "fsdp":
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (inputs,) = batch
        return self.net(inputs).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.01)


def fit(rank: int, world_size: int, root: str, parallelism: str) -> None:
    lightning_env(rank, world_size)
    checkpoint = ShardedCheckpoint(root, every_n_train_steps=2, log_artifact=False, save={"incremental": True})
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        num_nodes=1,
        strategy=ShardedStrategy(parallelism=parallelism),
        max_steps=6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint],
    )
    trainer.fit(LoraModule(parallelism), datamodule=TinyData())


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_lightning_incremental_saves_write_the_trainable_state(tmp_path, parallelism):
    root = str(tmp_path / "ckpt")
    run_ranks(fit, 2, root, parallelism)
    directories = sorted(Path(root).glob("step-*"))
    assert len(directories) >= 3
    manifests = [json.loads((d / "manifest.json").read_text()) for d in directories]
    # the shard files each checkpoint wrote (format v4 at 2 ranks: the parts table names them, FORMAT.md §10.1)
    own = [sum(f["bytes"] for f in parts_manifest.files_of(m) if f["kind"] == parts_manifest.SHARD) for m in manifests]
    assert "references" not in manifests[0]
    trainable = (13 * WIDTH + WIDTH + WIDTH * 5 + 5) * 4 * 3  # trainable params + AdamW's two moments
    for manifest, written in zip(manifests[1:], own[1:]):
        assert "references" in manifest, "the frozen base should be referenced"
        # + record headers and Lightning's pickled loop state, rewritten every time (tens of KB)
        assert trainable <= written <= 1.1 * trainable + 96 * 1024, (written, trainable)
        assert written < own[0] / 2
    for directory in directories:
        assert verify_checkpoint(str(directory)).ok
