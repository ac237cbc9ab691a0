"""Inside a rank of `tests.helpers.spawn.run_ranks`: what a new Lightning user writes, on 2 gloo ranks (issue 48).

`user_code_on_rank` runs, in one spawn:
- "evaluate": an FSDP model whose `configure_model` is the README's snippet, exactly as printed (read from the
  README), fit with the README's callback list, then `validate` / `test` (ckpt_path="best") and `predict`
  (ckpt_path="last") on the same Trainer: Lightning calls `configure_model` again for each, and loads the
  checkpoint named through `trainer.checkpoint_callback`;
- "from_checkpointer": a plain loop's Checkpointer (a ResumableDistributedSampler beside it) saves after 3 steps,
  24 of 32 samples into its epoch; then `Trainer.fit(ckpt_path=that checkpoint, max_steps=5)` continues, and
  `validate(ckpt_path=that checkpoint)` evaluates it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_shardckpt import (
    Checkpointer,
    ResumableDistributedSampler,
    ShardedCheckpoint,
    ShardedStrategy,
    resolve_checkpoint,
)
from tests.helpers.lightning_run import ddp_trainer, lightning_env

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_configure_model() -> Any:
    """The README's `configure_model`, compiled from its python block as printed (in a module that imports
    what FSDP2 users import, as the user's own module does)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (block,) = [b for b in blocks if "def configure_model(self)" in b]
    namespace: dict[str, Any] = {"FSDPModule": FSDPModule, "fully_shard": fully_shard}
    exec(compile(block, f"{README}:configure_model", "exec"), namespace)  # noqa: S102 - our own README
    return namespace["configure_model"]


class ReadmeModel(pl.LightningModule):
    """The user's model: blocks in a ModuleList, the README's configure_model."""

    configure_model = readme_configure_model()

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            inputs = torch.tanh(block(inputs))
        return inputs

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self(batch[0]).pow(2).mean(), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self(batch[0]).pow(2).mean(), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def dataset() -> TensorDataset:
    return TensorDataset(torch.randn(32, 8, generator=torch.Generator().manual_seed(3)))


class ReadmeData(pl.LightningDataModule):
    def _loader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=4)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader


def _evaluate(workdir: str) -> dict[str, Any]:
    callback = ShardedCheckpoint(dirpath=f"{workdir}/run", every_n_train_steps=2, keep_last=3, log_artifact=False)
    trainer = ddp_trainer(2, 3, [callback], strategy=ShardedStrategy(parallelism="fsdp"))
    model, data = ReadmeModel(), ReadmeData()
    trainer.fit(model, data)
    out: dict[str, Any] = {"checkpoint_callback_is_ours": trainer.checkpoint_callback is callback}
    for name, run, ckpt_path in (
        ("validate", trainer.validate, "best"),
        ("test", trainer.test, "best"),
        ("predict", trainer.predict, "last"),
    ):
        result = run(model, datamodule=data, ckpt_path=ckpt_path)
        loaded = trainer.strategy.last_load
        out[name] = {
            "path": loaded.path if loaded is not None else None,
            "step": loaded.step if loaded is not None else None,
            "ran": bool(result),
        }
    return out


class AtTrainStart(pl.Callback):
    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sampler = trainer.train_dataloader.sampler
        self.seen = {"step": trainer.global_step, "position": sampler.global_position, "epoch": sampler.epoch}


def _from_checkpointer(workdir: str, rank: int, world_size: int) -> dict[str, Any]:
    # the plain loop, as the Checkpointer's how-to writes it
    model = ReadmeModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    sampler = ResumableDistributedSampler(dataset(), num_replicas=world_size, rank=rank)
    with Checkpointer(f"{workdir}/plain", sampler=sampler) as ckpt:
        for step, (inputs,) in enumerate(DataLoader(dataset(), sampler=sampler, batch_size=4), start=1):
            model(inputs).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            sampler.mark_consumed(1, 4)
            if step == 3:
                assert ckpt.save(step, {"model": model, "optim": optimizer}, blocking=True).result().committed
                break
    checkpoint = resolve_checkpoint(f"{workdir}/plain").path  # its one checkpoint directory
    # the Lightning user's fit from it
    at_start = AtTrainStart()
    callbacks = [ShardedCheckpoint(f"{workdir}/lightning", log_artifact=False), at_start]
    trainer = ddp_trainer(world_size, 5, callbacks, strategy=ShardedStrategy(parallelism="fsdp"))
    trainer.fit(ReadmeModel(), datamodule=ReadmeData(), ckpt_path=checkpoint)
    out = {
        "at_start": at_start.seen,
        "global_step": trainer.global_step,
        "not_restored": list(trainer.strategy.not_restored),
    }
    # and an evaluation of it: Lightning restores the validate loop's state from the same dict
    out["validated"] = bool(trainer.validate(datamodule=ReadmeData(), ckpt_path=checkpoint))
    return out


def user_code_on_rank(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    lightning_env(rank, world_size)
    return {"evaluate": _evaluate(workdir), "from_checkpointer": _from_checkpointer(workdir, rank, world_size)}
