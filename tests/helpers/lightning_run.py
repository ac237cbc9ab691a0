"""A small Lightning module, datamodule and callback whose every piece of state is checked on resume.

`fit_on_rank` runs inside a rank started by `tests.helpers.spawn.run_ranks`: Lightning sees an
externally created process group (torchelastic-style environment variables) and launches nothing.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_shardckpt import ShardedCheckpoint, ShardedStrategy
from tests.helpers import training_state as ts


class TinyModule(pl.LightningModule):
    def __init__(self, parallelism: str = "ddp", lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = ts.build_model(seed=7)
        self.extra_loaded: Any = None

    def configure_model(self) -> None:
        if self.hparams.parallelism != "fsdp":
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]  # the quickstart's: ShardedStrategy's default mesh is (world, 1)
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (inputs,) = batch
        loss = self.net(inputs).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["my_extra"] = {"saved_at_step": self.global_step}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.extra_loaded = checkpoint.get("my_extra")


class TinyData(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.batches_served = 0

    def train_dataloader(self) -> DataLoader:
        inputs = torch.randn(96, 13, generator=torch.Generator().manual_seed(3))
        return DataLoader(TensorDataset(inputs), batch_size=4)

    def state_dict(self) -> dict[str, Any]:
        return {"batches_served": self.batches_served}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches_served = state["batches_served"]

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.batches_served += 1
        return batch


class CountingCallback(pl.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = state["batches"]


class CaptureAtStart(pl.Callback):
    """Gathers the full model + optimizer state and the restored bookkeeping when training (re)starts."""

    def __init__(self) -> None:
        self.at_start: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: TinyModule) -> None:
        optimizer = trainer.optimizers[0]
        self.at_start = {
            "full": _full(pl_module, optimizer),
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "lr": optimizer.param_groups[0]["lr"],
            "scheduler_last_epoch": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
            "extra": pl_module.extra_loaded,
            "datamodule_batches": trainer.datamodule.batches_served,
            "callback_batches": next(
                (cb.batches for cb in trainer.callbacks if isinstance(cb, CountingCallback)), None
            ),
        }


def _full(module: TinyModule, optimizer: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(
        module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    flat = {f"model.{k}": v.clone() for k, v in model_sd.items()}
    for name, state in optim_sd.get("state", {}).items():
        for key, value in state.items():
            flat[f"optim.{name}.{key}"] = torch.as_tensor(value).clone()
    return flat


def lightning_env(rank: int, world_size: int) -> None:
    # torchelastic-style variables: Lightning uses the existing process group and launches nothing
    os.environ.update(
        {
            "LOCAL_RANK": str(rank),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29555",
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
        }
    )


def ddp_trainer(world_size: int, max_steps: int, callbacks: list[pl.Callback], **options: Any) -> pl.Trainer:
    """The Trainer of a test's spawned rank: CPU, `world_size` gloo ranks under ShardedStrategy's DDP, no logger,
    no progress bar or model summary (a rank's output is the test's log); `options` replace or add Trainer
    arguments (`logger=`, ...)."""
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=world_size,
        strategy=ShardedStrategy(parallelism="ddp"),
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    return pl.Trainer(**{**settings, **options})


def fit_on_rank(
    rank: int, world_size: int, root: str, parallelism: str, max_steps: int, ckpt_path: Any, extra: dict
) -> dict:
    lightning_env(rank, world_size)
    capture = CaptureAtStart()
    checkpoint = ShardedCheckpoint(
        root,
        every_n_train_steps=extra.get("every", 3),
        keep_last=extra.get("keep_last"),
        resume_required=extra.get("resume_required", False),
        save=extra.get("save", {}),
        log_artifact=False,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        num_nodes=1,
        strategy=ShardedStrategy(parallelism=parallelism),
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint, CountingCallback(), capture],
        use_distributed_sampler=True,
    )
    module = TinyModule(parallelism=parallelism)
    trainer.fit(module, datamodule=TinyData(), ckpt_path=ckpt_path)
    optimizer = trainer.optimizers[0]
    return {
        "at_start": capture.at_start,
        "final": _full(module, optimizer),
        "global_step": trainer.global_step,
        "last_saved_step": checkpoint.last_saved_step,
    }


class PreemptAt(pl.Callback):
    """Sends this rank SIGUSR1 at `step`, as a cluster does to every process before preempting it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            import signal

            os.kill(os.getpid(), signal.SIGUSR1)


def features_on_rank(rank: int, world_size: int, workdir: str) -> dict:
    """One process group, three fits: ModelCheckpoint + CSV metrics + retention; preemption; manual save."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    lightning_env(rank, world_size)
    common = dict(
        accelerator="cpu", devices=world_size, num_nodes=1, enable_progress_bar=False, enable_model_summary=False
    )

    # 1. our callback with retention, Lightning's ModelCheckpoint beside it, metrics into a CSVLogger
    sharded = ShardedCheckpoint(
        f"{workdir}/run", every_n_train_steps=2, keep_last=2, keep_every_n_steps=4, log_artifact=False
    )
    lightning_ckpt = ModelCheckpoint(dirpath=f"{workdir}/lightning", every_n_train_steps=3, save_top_k=1, monitor=None)
    trainer = pl.Trainer(
        strategy=ShardedStrategy(parallelism="ddp"),
        max_steps=10,
        logger=CSVLogger(f"{workdir}/csv", name="run"),
        callbacks=[sharded, lightning_ckpt],
        **common,
    )
    trainer.fit(TinyModule(), datamodule=TinyData())
    manual = f"{workdir}/manual.ckpt"
    trainer.save_checkpoint(manual)
    first = {"model_checkpoint_best": lightning_ckpt.best_model_path, "log_dir": trainer.logger.log_dir}

    # 2. preemption: SIGUSR1 on every rank at step 3 -> a blocking save of step 3, then stop
    preempted = ShardedCheckpoint(f"{workdir}/preempt", every_n_train_steps=100, log_artifact=False)
    trainer = pl.Trainer(
        strategy=ShardedStrategy(parallelism="ddp"),
        max_steps=50,
        logger=False,
        callbacks=[PreemptAt(3), preempted],
        **common,
    )
    trainer.fit(TinyModule(), datamodule=TinyData())
    second = {"stopped_at": trainer.global_step}

    # 3. resume from the root that trainer.save_checkpoint wrote
    capture = CaptureAtStart()
    trainer = pl.Trainer(
        strategy=ShardedStrategy(parallelism="ddp"),
        max_steps=12,
        logger=False,
        callbacks=[ShardedCheckpoint(f"{workdir}/after-manual", log_artifact=False), capture],
        **common,
    )
    trainer.fit(TinyModule(), datamodule=TinyData(), ckpt_path=manual)
    return {**first, **second, "manual_resume_step": capture.at_start["global_step"]}


class IdModule(TinyModule):
    """Records the sample ids each optimizer step trained on."""

    def __init__(self) -> None:
        super().__init__(parallelism="ddp")
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, ids = batch
        self.seen.extend(int(i) for i in ids)
        return self.net(inputs).pow(2).mean()


class IdData(pl.LightningDataModule):
    """A plain shuffled DataLoader: Lightning injects the distributed sampler, the strategy swaps it."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def train_dataloader(self) -> DataLoader:
        inputs = torch.randn(self.size, 13, generator=torch.Generator().manual_seed(3))
        return DataLoader(TensorDataset(inputs, torch.arange(self.size)), batch_size=4, shuffle=True)


class RngProbe(pl.Callback):
    """Torch RNG state as the checkpoint captures it (batch end, before ShardedCheckpoint, which runs
    last) and as the first resumed batch finds it."""

    def __init__(self) -> None:
        self.at_batch_end: dict[int, torch.Tensor] = {}
        self.at_first_batch: torch.Tensor | None = None

    def on_train_batch_start(self, *args: Any) -> None:
        if self.at_first_batch is None:
            self.at_first_batch = torch.get_rng_state()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.at_batch_end[trainer.global_step] = torch.get_rng_state()


def ids_on_rank(
    rank: int, world_size: int, root: str, size: int, max_steps: int, ckpt_path: Any, accumulate: int = 1
) -> dict:
    lightning_env(rank, world_size)
    torch.manual_seed(1000 + rank)  # every rank's generator differs, so restoring the wrong one shows
    module = IdModule()
    probe = RngProbe()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        num_nodes=1,
        strategy=ShardedStrategy(parallelism="ddp"),
        max_steps=max_steps,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulate,
        callbacks=[ShardedCheckpoint(root, every_n_train_steps=2, log_artifact=False), probe],
    )
    trainer.fit(module, datamodule=IdData(size), ckpt_path=ckpt_path)
    return {
        "seen": module.seen,
        "global_step": trainer.global_step,
        "rng_at_step": probe.at_batch_end,
        "rng_at_first_batch": probe.at_first_batch,
    }


def triggers_on_rank(rank: int, world_size: int, workdir: str) -> dict:
    """Strategy by its registered name; saves by wall time, and at epoch ends."""
    import time as time_module

    lightning_env(rank, world_size)

    class SlowStep(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            time_module.sleep(0.05)

    common = dict(
        accelerator="cpu",
        devices=world_size,
        num_nodes=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    by_time = ShardedCheckpoint(
        f"{workdir}/by-time", every_n_minutes=0.1 / 60, save_on_fit_end=False, log_artifact=False
    )
    trainer = pl.Trainer(strategy="shardckpt_ddp", max_steps=4, callbacks=[SlowStep(), by_time], **common)
    trainer.fit(TinyModule(), datamodule=TinyData())
    strategy_type = type(trainer.strategy).__name__
    by_epoch = ShardedCheckpoint(
        f"{workdir}/by-epoch", save_on_epoch_end=True, save_on_fit_end=False, log_artifact=False
    )
    trainer = pl.Trainer(strategy="shardckpt_ddp", max_epochs=2, callbacks=[by_epoch], **common)
    trainer.fit(TinyModule(), datamodule=TinyData())
    return {"strategy": strategy_type, "epoch_steps": trainer.num_training_batches}


def preflight_on_rank(rank: int, world_size: int, dirpath: str, storage_options: dict) -> dict:
    lightning_env(rank, world_size)
    module = TinyModule()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ShardedStrategy(parallelism="ddp"),
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        callbacks=[ShardedCheckpoint(dirpath, save={"storage_options": storage_options})],
    )
    try:
        trainer.fit(module, datamodule=TinyData())
    except Exception as err:  # the error type and message are the result
        return {"error": f"{type(err).__name__}: {err}", "global_step": module.global_step}
    return {"error": None, "global_step": module.global_step}


def from_model_checkpoint_on_rank(
    rank: int, world_size: int, workdir: str, parallelism: str, saved: str | None, continue_here: bool = True
) -> dict:
    """A user's run checkpointed by Lightning's own ModelCheckpoint (DDPStrategy: a `.ckpt` file;
    ModelParallelStrategy: a DCP directory) for 3 steps, when `saved` is None; then (or from `saved`, on this
    world size) continued under ShardedStrategy + ShardedCheckpoint for 3 more, then once more from "latest"."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    lightning_env(rank, world_size)
    common: dict[str, Any] = dict(
        accelerator="cpu", devices=world_size, num_nodes=1, logger=False, enable_progress_bar=False
    )
    first: dict[str, Any] = {}
    if saved is None:
        lightnings = ModelCheckpoint(dirpath=f"{workdir}/lightning", every_n_train_steps=3, save_top_k=1)
        strategy = DDPStrategy() if parallelism == "ddp" else ModelParallelStrategy()
        trainer = pl.Trainer(strategy=strategy, max_steps=3, callbacks=[lightnings, CountingCallback()], **common)
        module = TinyModule(parallelism=parallelism)
        trainer.fit(module, datamodule=TinyData())
        saved = lightnings.best_model_path
        first = {"saved": saved, "final": _full(module, trainer.optimizers[0])}
        if not continue_here:
            return first

    def fit(max_steps: int, ckpt_path: str) -> dict[str, Any]:
        capture = CaptureAtStart()
        sharded = ShardedCheckpoint(f"{workdir}/root", every_n_train_steps=100, log_artifact=False)
        trainer = pl.Trainer(
            strategy=ShardedStrategy(parallelism=parallelism),
            max_steps=max_steps,
            callbacks=[sharded, CountingCallback(), capture],
            **common,
        )
        module = TinyModule(parallelism=parallelism)
        trainer.fit(module, datamodule=TinyData(), ckpt_path=ckpt_path)
        return {
            "at_start": capture.at_start,
            "final": _full(module, trainer.optimizers[0]),
            "global_step": trainer.global_step,
        }

    continued = fit(6, saved)
    return {**first, "continued": continued, "from_latest": fit(8, "latest")}


class Recipe:
    """A user's own class in hyperparameters: torch's weights_only loader refuses to build it."""

    def __init__(self, width: int) -> None:
        self.width = width


class RecipeModule(TinyModule):
    def __init__(self, recipe: Recipe | None = None) -> None:
        super().__init__(parallelism="ddp")
        self.save_hyperparameters()


def untrusted_lightning_ckpt_on_rank(rank: int, world_size: int, workdir: str) -> dict:
    """A `.ckpt` of Lightning's own whose hyperparameters pickle a user class, continued under ShardedStrategy:
    first without trust (the error), then with ShardedCheckpoint(trust_checkpoint=True)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    lightning_env(rank, world_size)
    common: dict[str, Any] = dict(accelerator="cpu", devices=world_size, logger=False, enable_progress_bar=False)
    lightnings = ModelCheckpoint(dirpath=f"{workdir}/lightning", every_n_train_steps=2)
    trainer = pl.Trainer(strategy="ddp", max_steps=2, callbacks=[lightnings], **common)
    trainer.fit(RecipeModule(Recipe(3)), datamodule=TinyData())
    outcome: dict[str, Any] = {}
    for trust in (False, True):
        sharded = ShardedCheckpoint(f"{workdir}/root", trust_checkpoint=trust, log_artifact=False)
        trainer = pl.Trainer(strategy=ShardedStrategy(parallelism="ddp"), max_steps=3, callbacks=[sharded], **common)
        try:
            trainer.fit(RecipeModule(), datamodule=TinyData(), ckpt_path=lightnings.best_model_path)
            outcome[str(trust)] = trainer.global_step
        except Exception as err:  # the error type and message are the result
            outcome[str(trust)] = f"{type(err).__name__}: {err}"
    return outcome
