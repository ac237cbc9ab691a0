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

COMMON = {
    "accelerator": "cpu",
    "num_nodes": 1,
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def _data(size: int = 64, batch_size: int = 4, **loader: Any) -> DataLoader:
    inputs = torch.randn(size, 13, generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(inputs, torch.arange(size)), batch_size=batch_size, **loader)


def _own(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, also those a module's own state_dict() leaves out."""
    return {name: value.detach().clone() for name, value in torch.nn.Module.state_dict(module).items()}


class AtStart(pl.Callback):
    """What a (resumed) fit starts from: the model's state and whatever `probe(trainer, module)` returns."""

    def __init__(self, probe: Any = None) -> None:
        self.probe = probe
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen = {"model": _own(pl_module), **(self.probe(trainer, pl_module) if self.probe else {})}


def _plain_save(
    world_size: int, module: pl.LightningModule, path: str, steps: int, callbacks: list, **trainer: Any
) -> str:
    saving = ModelCheckpoint(dirpath=path, every_n_train_steps=steps, save_top_k=-1)
    pl.Trainer(
        strategy=DDPStrategy(), devices=world_size, max_steps=steps, callbacks=[saving, *callbacks], **COMMON, **trainer
    ).fit(module, train_dataloaders=_data())
    return saving.best_model_path


def _sharded_save(
    world_size: int, module: pl.LightningModule, root: str, steps: int, callbacks: list, **trainer: Any
) -> None:
    pl.Trainer(
        strategy=ShardedStrategy(parallelism="ddp"),
        devices=world_size,
        max_steps=steps,
        callbacks=[ShardedCheckpoint(root, every_n_train_steps=steps, log_artifact=False), *callbacks],
        **COMMON,
        **trainer,
    ).fit(module, train_dataloaders=_data())


def _resume(
    world_size: int, module: pl.LightningModule, strategy: Any, ckpt_path: str, callbacks: list, steps: int
) -> None:
    saves = any(
        isinstance(cb, pl.callbacks.Checkpoint) for cb in callbacks
    )  # else no default ModelCheckpoint in the cwd
    pl.Trainer(
        strategy=strategy,
        devices=world_size,
        max_steps=steps,
        callbacks=callbacks,
        enable_checkpointing=saves,
        **COMMON,
    ).fit(module, train_dataloaders=_data(), ckpt_path=ckpt_path)


# --- 1. replicated-but-different state comes from rank 0 ---


class BatchNormModule(pl.LightningModule):
    """BatchNorm without SyncBN: every DDP rank's running statistics come from its own batches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(13, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )
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
    _resume(
        world_size,
        BatchNormModule(),
        ShardedStrategy(parallelism="ddp"),
        "latest",
        [ShardedCheckpoint(f"{workdir}/sharded", log_artifact=False), RankState(), sharded],
        4,
    )
    return {
        "saved_plain": _own(plain_module),
        "saved_sharded": _own(sharded_module),
        "plain": plain.seen,
        "sharded": sharded.seen,
    }


# --- 2. checkpoint hooks see checkpoint["state_dict"] on save and on load ---


class SmallModule(pl.LightningModule):
    def __init__(self, seed: int = 7, edit_on_load: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(13, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.edit_on_load = edit_on_load

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.edit_on_load:  # Lightning applies the weights after this hook: the edit must show
            checkpoint["state_dict"]["net.2.bias"] = checkpoint["state_dict"]["net.2.bias"] + 1.0


def _probe_average(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    from lightning.pytorch.callbacks import EMAWeightAveraging

    ema = next(cb for cb in trainer.callbacks if isinstance(cb, EMAWeightAveraging))
    return {"average": _own(ema._average_model.module)}


def hooks_on_rank(rank: int, world_size: int, workdir: str) -> dict:
    from lightning.pytorch.callbacks import EMAWeightAveraging

    lightning_env(rank, world_size)
    results: dict[str, Any] = {}

    # EMA: on save it puts the average in "state_dict" and the live weights beside it; on load it reads both
    def ema() -> EMAWeightAveraging:
        return EMAWeightAveraging(decay=0.5)

    plain_path = _plain_save(world_size, SmallModule(), f"{workdir}/ema-plain", 3, [ema()])
    _sharded_save(world_size, SmallModule(), f"{workdir}/ema-sharded", 3, [ema()])
    plain, sharded = AtStart(_probe_average), AtStart(_probe_average)
    _resume(world_size, SmallModule(seed=8), DDPStrategy(), plain_path, [ema(), plain], 4)
    _resume(
        world_size,
        SmallModule(seed=8),
        ShardedStrategy(parallelism="ddp"),
        "latest",
        [ShardedCheckpoint(f"{workdir}/ema-sharded", log_artifact=False), ema(), sharded],
        4,
    )
    results["ema"] = {"plain": plain.seen, "sharded": sharded.seen}
    # a module's on_load_checkpoint edits the weights before Lightning applies them
    plain_path = _plain_save(world_size, SmallModule(), f"{workdir}/edit-plain", 3, [])
    saved = SmallModule()
    _sharded_save(world_size, saved, f"{workdir}/edit-sharded", 3, [])
    plain, sharded = AtStart(), AtStart()
    _resume(world_size, SmallModule(seed=8, edit_on_load=True), DDPStrategy(), plain_path, [plain], 4)
    _resume(
        world_size,
        SmallModule(seed=8, edit_on_load=True),
        ShardedStrategy(parallelism="ddp"),
        "latest",
        [ShardedCheckpoint(f"{workdir}/edit-sharded", log_artifact=False), sharded],
        4,
    )
    results["edit"] = {"plain": plain.seen, "sharded": sharded.seen, "saved": _own(saved)}
    return results


# --- 3. strict_loading = False: Lightning's partial checkpoint ---


class FrozenBackbone(pl.LightningModule):
    """Lightning's documented pattern: the frozen backbone is not saved, and strict_loading is off.

    `pattern="state_dict"` leaves it out of `state_dict()`; `pattern="hook"` drops it in on_save_checkpoint.
    """

    def __init__(self, seed: int, pattern: str) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = torch.nn.Sequential(torch.nn.Linear(13, 16), torch.nn.Linear(16, 16)).requires_grad_(False)
        self.head = torch.nn.Linear(16, 1)
        self.pattern = pattern
        self.strict_loading = False

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        state = super().state_dict(*args, **kwargs)
        if self.pattern != "state_dict":
            return state
        return {key: value for key, value in state.items() if not key.startswith("backbone.")}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.pattern == "hook":
            checkpoint["state_dict"] = {
                k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("backbone.")
            }

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(batch[0]))).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.head.parameters(), lr=0.05)


def partial_on_rank(rank: int, world_size: int, workdir: str) -> dict:
    import logging

    lightning_env(rank, world_size)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_shardckpt").addHandler(handler)
    results: dict[str, Any] = {}
    for pattern in ("state_dict", "hook"):
        plain_path = _plain_save(world_size, FrozenBackbone(7, pattern), f"{workdir}/{pattern}-plain", 3, [])
        _sharded_save(world_size, FrozenBackbone(7, pattern), f"{workdir}/{pattern}-sharded", 3, [])
        plain, sharded = AtStart(), AtStart()
        _resume(world_size, FrozenBackbone(8, pattern), DDPStrategy(), plain_path, [plain], 4)
        _resume(
            world_size,
            FrozenBackbone(8, pattern),
            ShardedStrategy(parallelism="ddp"),
            "latest",
            [ShardedCheckpoint(f"{workdir}/{pattern}-sharded", log_artifact=False), sharded],
            4,
        )
        # the whole module (backbone included) as each fit started
        results[pattern] = {"plain": plain.seen, "sharded": sharded.seen, "fresh": _own(FrozenBackbone(8, pattern))}
    results["log"] = messages
    return results


# --- 5. the FSDP quickstart shards over every rank ---


class QuickstartFSDP(SmallModule):
    """The README's FSDP quickstart: fully_shard over the mesh's data-parallel dimension."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def fsdp_mesh_on_rank(rank: int, world_size: int, workdir: str) -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy

    lightning_env(rank, world_size)
    results: dict[str, Any] = {}
    runs = {
        "plain": ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1),
        "sharded": ShardedStrategy(parallelism="fsdp"),
    }
    for name, strategy in runs.items():
        module = QuickstartFSDP()
        callbacks = [ShardedCheckpoint(f"{workdir}/{name}", log_artifact=False)] if name == "sharded" else []
        pl.Trainer(
            strategy=strategy,
            devices=world_size,
            max_steps=3,
            callbacks=callbacks,
            enable_checkpointing=bool(callbacks),
            **COMMON,
        ).fit(module, train_dataloaders=_data())
        weight = module.net[0].weight
        results[name] = {
            "mesh": tuple(strategy.device_mesh.shape),
            "local_rows": weight.to_local().shape[0],
            "full": {
                k: v.full_tensor().clone() for k, v in module.net.state_dict().items()
            },  # collective, same order on all ranks
        }
    return results


# --- 4. a mid-epoch resume continues the epoch as an uninterrupted run would ---


class EpochLedger(SmallModule):
    """Per epoch: the sample ids each optimizer step applied, the steps, and where validation ran."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[int] = []
        self.applied: dict[int, list[int]] = {}
        self.steps: dict[int, int] = {}
        self.validated_at: list[tuple[int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.pending.extend(int(i) for i in batch[1])
        return self.net(batch[0]).pow(2).mean()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        epoch = self.current_epoch
        self.applied.setdefault(epoch, []).extend(self.pending)
        self.steps[epoch] = self.steps.get(epoch, 0) + 1
        self.pending = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.net(batch[0]).pow(2).mean(), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self.validated_at.append((self.current_epoch, self.global_step))

    def ledger(self) -> dict[str, Any]:
        return {
            "applied": self.applied,
            "steps": self.steps,
            "validated_at": self.validated_at,
            "unapplied": self.pending,
        }


def mid_epoch_on_rank(
    rank: int, world_size: int, workdir: str, size: int, accumulate: int, stop_at: int, phase: str = "all"
) -> dict:
    lightning_env(rank, world_size)
    common = dict(devices=world_size, accumulate_grad_batches=accumulate, num_sanity_val_steps=0, **COMMON)
    data = {"train_dataloaders": _data(size), "val_dataloaders": _data(8)}

    def fit(strategy: Any, callbacks: list, module: EpochLedger, ckpt_path: Any = None, **limits: Any) -> dict:
        pl.Trainer(
            strategy=strategy, callbacks=callbacks, enable_checkpointing=bool(callbacks), **limits, **common
        ).fit(module, **data, ckpt_path=ckpt_path)
        return module.ledger()

    if phase == "before":  # only the interrupted part, to be resumed by another spawn (another world size)
        return {
            "before": fit(
                ShardedStrategy(parallelism="ddp"),
                [ShardedCheckpoint(f"{workdir}/stopped", log_artifact=False)],
                EpochLedger(),
                max_epochs=2,
                max_steps=stop_at,
            )
        }
    if phase == "after":
        return {
            "after": fit(
                ShardedStrategy(parallelism="ddp"),
                [ShardedCheckpoint(f"{workdir}/stopped", log_artifact=False)],
                EpochLedger(),
                "latest",
                max_epochs=2,
            )
        }
    results = {
        "plain": fit(DDPStrategy(), [], EpochLedger(), max_epochs=2),
        "uninterrupted": fit(
            ShardedStrategy(parallelism="ddp"),
            [ShardedCheckpoint(f"{workdir}/whole", log_artifact=False)],
            EpochLedger(),
            max_epochs=2,
        ),
    }
    root = f"{workdir}/stopped"
    results["before"] = fit(
        ShardedStrategy(parallelism="ddp"),
        [ShardedCheckpoint(root, log_artifact=False)],
        EpochLedger(),
        max_epochs=2,
        max_steps=stop_at,
    )
    results["after"] = fit(
        ShardedStrategy(parallelism="ddp"),
        [ShardedCheckpoint(root, log_artifact=False)],
        EpochLedger(),
        "latest",
        max_epochs=2,
    )
    return results
