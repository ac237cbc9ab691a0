"""Lightning conventions, each run twice on the same ranks: plain Lightning (DDPStrategy + its own
checkpoint file) and ShardedStrategy + ShardedCheckpoint. The tests compare what each restores.

Every function runs inside a rank started by `tests.helpers.spawn.run_ranks`.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_shardckpt import ShardedCheckpoint, ShardedStrategy
from tests.helpers.lightning_run import lightning_env

COMMON = dict(accelerator="cpu", num_nodes=1, logger=False, enable_progress_bar=False, enable_model_summary=False)


def _data(size: int = 64, batch_size: int = 4, **loader: Any) -> DataLoader:
    inputs = torch.randn(size, 13, generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(inputs, torch.arange(size)), batch_size=batch_size, **loader)


def _own(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


class AtStart(pl.Callback):
    """What a (resumed) fit starts from: the model's state and whatever `probe(trainer, module)` returns."""

    def __init__(self, probe: Any = None) -> None:
        self.probe = probe
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen = {"model": _own(pl_module), **(self.probe(trainer, pl_module) if self.probe else {})}


def _plain_save(world_size: int, module: pl.LightningModule, path: str, steps: int, callbacks: list, **trainer: Any) -> str:
    saving = ModelCheckpoint(dirpath=path, every_n_train_steps=steps, save_top_k=-1)
    pl.Trainer(strategy=DDPStrategy(), devices=world_size, max_steps=steps, callbacks=[saving, *callbacks], **COMMON, **trainer).fit(
        module, train_dataloaders=_data())
    return saving.best_model_path


def _sharded_save(world_size: int, module: pl.LightningModule, root: str, steps: int, callbacks: list, **trainer: Any) -> None:
    pl.Trainer(strategy=ShardedStrategy(parallelism="ddp"), devices=world_size, max_steps=steps,
               callbacks=[ShardedCheckpoint(root, every_n_train_steps=steps, log_artifact=False), *callbacks], **COMMON, **trainer).fit(
        module, train_dataloaders=_data())


def _resume(world_size: int, module: pl.LightningModule, strategy: Any, ckpt_path: str, callbacks: list, steps: int) -> None:
    pl.Trainer(strategy=strategy, devices=world_size, max_steps=steps, callbacks=callbacks, **COMMON).fit(
        module, train_dataloaders=_data(), ckpt_path=ckpt_path)


# --- 1. replicated-but-different state comes from rank 0 ---


class BatchNormModule(pl.LightningModule):
    """BatchNorm without SyncBN: every DDP rank's running statistics come from its own batches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.net = torch.nn.Sequential(torch.nn.Linear(13, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.loaded_extra: Any = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["saved_by_rank"] = self.global_rank  # differs per rank, like any rank-local extra

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_extra = checkpoint.get("saved_by_rank")


class RankState(pl.Callback):
    """A callback whose state differs per rank."""

    def __init__(self) -> None:
        self.rank: int | None = None
        self.loaded: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.rank = trainer.global_rank

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def _probe_rank_sources(trainer: pl.Trainer, module: BatchNormModule) -> dict[str, Any]:
    state = next(cb for cb in trainer.callbacks if isinstance(cb, RankState))
    return {"extra": module.loaded_extra, "callback": state.loaded}


def rank_sources_on_rank(rank: int, world_size: int, workdir: str) -> dict:
    lightning_env(rank, world_size)
    plain_module, sharded_module = BatchNormModule(), BatchNormModule()
    plain_path = _plain_save(world_size, plain_module, f"{workdir}/plain", 3, [RankState()])
    _sharded_save(world_size, sharded_module, f"{workdir}/sharded", 3, [RankState()])
    plain, sharded = AtStart(_probe_rank_sources), AtStart(_probe_rank_sources)
    _resume(world_size, BatchNormModule(), DDPStrategy(), plain_path, [RankState(), plain], 4)
    _resume(world_size, BatchNormModule(), ShardedStrategy(parallelism="ddp"), "latest",
            [ShardedCheckpoint(f"{workdir}/sharded", log_artifact=False), RankState(), sharded], 4)
    return {"saved_plain": _own(plain_module), "saved_sharded": _own(sharded_module), "plain": plain.seen, "sharded": sharded.seen}
