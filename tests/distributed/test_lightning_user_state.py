"""A mid-epoch resume on another world size looks like an uninterrupted run to the user's own state:
torchmetrics, `self.log(on_epoch=True)` aggregates and ReduceLROnPlateau (epoch and step interval).

One uninterrupted DDP run on 2 ranks (saving every 2 steps: saves must leave the live run unchanged) is
the reference; DDP and FSDP2 runs on 2 ranks stop after step 3 and resume on 1 (DDP) and 3 (FSDP) ranks.
What the module measures does not depend on the weights (the inputs' row sums), so every run, whatever
its world size, must see the same epoch.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import CatMetric, MaxMetric, MeanMetric, Metric, SumMetric

from lightning_shardckpt import ShardedCheckpoint, ShardedStrategy
from tests.helpers.lightning_run import TinyModule, lightning_env
from tests.helpers.spawn import run_ranks

SAMPLES, STOP_AT = 96, 3  # 2 ranks x batch 4: 12 steps an epoch; stopped after 3 (24 samples)
LR = 0.1


class UnreducedCount(Metric):
    """A state without a reduction: its synced form is one entry per saved rank, so it is not merged."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("count", torch.tensor(0.0), dist_reduce_fx=None)

    def update(self, samples: int) -> None:
        self.count = self.count + samples

    def compute(self) -> torch.Tensor:
        return self.count.sum()  # synced: one count per rank


class UserStateModule(TinyModule):
    def __init__(self, parallelism: str) -> None:
        super().__init__(parallelism=parallelism, lr=LR)
        self.samples = SumMetric()  # a count: sum reduction
        self.signal_mean = MeanMetric()  # sums of values and weights
        self.signal_mean.persistent(True)  # also in the model state dict (rank 0's copy there)
        self.ids = CatMetric()  # cat reduction: every sample id once
        self.signal_max = MaxMetric()  # max reduction
        self.unreduced = UnreducedCount()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, ids = batch
        signal = inputs.sum(dim=1)  # per sample, independent of the weights
        self.samples.update(torch.tensor(float(len(ids))))
        self.signal_mean.update(signal)
        self.ids.update(ids.float())
        self.signal_max.update(signal)
        self.unreduced.update(len(ids))
        self.log("signal", signal.mean(), on_step=True, on_epoch=True, sync_dist=True)  # mean over samples
        self.log("samples_logged", float(len(ids)), on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)
        self.log("signal_peak", signal.max(), on_step=False, on_epoch=True, reduce_fx="max", sync_dist=True)
        return self.net(inputs).pow(2).mean()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=LR)
        per_epoch = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        # reduces on the 3rd update (the step the interrupted runs stop at), then never again (cooldown)
        per_step = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=2, cooldown=100)
        for scheduler in (per_epoch, per_step):
            scheduler.step(-1e9)  # primed: every later value is worse, so updates count as bad ones
        return [optimizer], [
            {"scheduler": per_epoch, "interval": "epoch", "monitor": "signal_epoch"},
            {"scheduler": per_step, "interval": "step", "monitor": "signal_step"},
        ]


class Data(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        inputs = torch.randn(SAMPLES, 13, generator=torch.Generator().manual_seed(3))
        return DataLoader(TensorDataset(inputs, torch.arange(SAMPLES)), batch_size=4)


class LearningRates(pl.Callback):
    """The LR each optimizer step trains with (after every scheduler update before it)."""

    def __init__(self) -> None:
        self.at_step: dict[int, float] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.at_step.setdefault(trainer.global_step, trainer.optimizers[0].param_groups[0]["lr"])


def _fit(
    rank: int, world: int, root: str, parallelism: str, max_steps: int, ckpt_path: Any, every: int, epochs: int = 1
) -> dict:
    lightning_env(rank, world)
    rates = LearningRates()
    at_epoch_end = every == 0  # saves at epoch ends only
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        strategy=ShardedStrategy(parallelism=parallelism),
        max_steps=max_steps,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ShardedCheckpoint(
                root, every_n_train_steps=every or None, save_on_epoch_end=at_epoch_end, log_artifact=False
            ),
            rates,
        ],
    )
    module = UserStateModule(parallelism)
    trainer.fit(module, datamodule=Data(), ckpt_path=ckpt_path)
    per_epoch, per_step = (config.scheduler for config in trainer.lr_scheduler_configs)
    return {
        "global_step": trainer.global_step,
        "samples": float(module.samples.compute()),  # every compute syncs: every rank calls it
        "signal_mean": float(module.signal_mean.compute()),
        "ids": sorted(int(i) for i in module.ids.compute()),
        "signal_max": float(module.signal_max.compute()),
        "unreduced": float(module.unreduced.compute()),
        "logged": {key: float(value) for key, value in trainer.callback_metrics.items()},
        "lr_at_step": rates.at_step,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "per_epoch": {k: per_epoch.state_dict()[k] for k in ("last_epoch", "num_bad_epochs", "best")},
        "per_step_reductions": per_step.cooldown_counter > 0,
    }


def _first_runs(rank: int, world: int, workdir: str) -> dict:
    """One process group, four fits: the uninterrupted reference and three interrupted runs."""
    return {
        "reference": _fit(rank, world, f"{workdir}/reference", "ddp", -1, None, 2),
        "ddp": _fit(rank, world, f"{workdir}/ddp", "ddp", STOP_AT, None, 100),
        "fsdp": _fit(rank, world, f"{workdir}/fsdp", "fsdp", STOP_AT, None, 100),
        "epoch_end": _fit(rank, world, f"{workdir}/epoch-end", "ddp", -1, None, 0),  # one epoch, saved at its end
    }


def _resumes_on_one_rank(rank: int, world: int, workdir: str) -> dict:
    return {
        "ddp": _fit(rank, world, f"{workdir}/ddp", "ddp", -1, "latest", 100),
        "epoch_end": _fit(rank, world, f"{workdir}/epoch-end", "ddp", -1, "latest", 0, epochs=2),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    workdir = str(tmp_path_factory.mktemp("user-state"))
    first = run_ranks(_first_runs, 2, workdir, timeout_s=240)
    one = run_ranks(_resumes_on_one_rank, 1, workdir, timeout_s=240)
    fsdp = run_ranks(_fit, 3, f"{workdir}/fsdp", "fsdp", -1, "latest", 100, timeout_s=240)
    return {
        "reference": [o.value["reference"] for o in first],
        "stopped": [o.value[kind] for o in first for kind in ("ddp", "fsdp")],
        "resumed": {"ddp 2 -> 1": [one[0].value["ddp"]], "fsdp 2 -> 3": [o.value for o in fsdp]},
        "after_epoch_end": one[0].value["epoch_end"],
    }


def test_the_runs_stopped_mid_epoch_and_resumed_to_the_epoch_end(runs):
    assert {run["global_step"] for run in runs["stopped"]} == {STOP_AT}
    assert [r["global_step"] for r in runs["resumed"]["ddp 2 -> 1"]] == [STOP_AT + 18]  # 72 samples, 1 x 4
    assert {r["global_step"] for r in runs["resumed"]["fsdp 2 -> 3"]} == {STOP_AT + 6}  # 72 samples, 3 x 4


def test_saving_leaves_the_live_metrics_of_every_rank_unchanged(runs):
    # the reference saved every 2 steps (each save syncs, stores and unsyncs): the totals are still exact
    assert [r["samples"] for r in runs["reference"]] == [SAMPLES, SAMPLES]
    assert runs["reference"][0]["ids"] == list(range(SAMPLES))
    assert {r["samples"] for r in runs["stopped"]} == {2 * 4 * STOP_AT}


@pytest.mark.parametrize("resize", ["ddp 2 -> 1", "fsdp 2 -> 3"])
def test_torchmetrics_after_a_resume_on_another_world_size_equal_the_uninterrupted_run(runs, resize):
    reference = runs["reference"][0]
    for rank, resumed in enumerate(runs["resumed"][resize]):
        where = f"{resize}, rank {rank}"
        assert resumed["samples"] == SAMPLES, where  # not 48 (restarted empty) nor 72 (rank 0's share)
        assert resumed["ids"] == list(range(SAMPLES)), where  # every sample once
        assert resumed["signal_mean"] == pytest.approx(reference["signal_mean"], rel=1e-5), where
        assert resumed["signal_max"] == reference["signal_max"], where


@pytest.mark.parametrize("resize", ["ddp 2 -> 1", "fsdp 2 -> 3"])
def test_logged_epoch_aggregates_after_a_resume_cover_the_whole_epoch(runs, resize):
    reference = runs["reference"][0]["logged"]
    assert reference["samples_logged"] == SAMPLES
    for rank, resumed in enumerate(runs["resumed"][resize]):
        logged = resumed["logged"]
        assert logged["samples_logged"] == SAMPLES, f"{resize}, rank {rank}"
        assert logged["signal_epoch"] == pytest.approx(reference["signal_epoch"], rel=1e-5), f"{resize}, rank {rank}"
        assert logged["signal_peak"] == reference["signal_peak"], f"{resize}, rank {rank}"


@pytest.mark.parametrize("resize", ["ddp 2 -> 1", "fsdp 2 -> 3"])
def test_epoch_interval_plateau_update_runs_at_the_end_of_the_resumed_epoch(runs, resize):
    reference = runs["reference"][0]
    assert reference["lr"] == pytest.approx(LR * 0.5 * 0.5)  # the step reduction, then the epoch one
    for resumed in runs["resumed"][resize]:
        assert resumed["lr"] == pytest.approx(reference["lr"])
        assert resumed["per_epoch"] == reference["per_epoch"]


@pytest.mark.parametrize("resize", ["ddp 2 -> 1", "fsdp 2 -> 3"])
def test_step_interval_plateau_reduces_on_the_same_step_after_a_resume(runs, resize):
    reference = runs["reference"][0]["lr_at_step"]
    assert reference[STOP_AT - 1] == LR and reference[STOP_AT] == LR * 0.5  # reduced after step 3's batch
    for resumed in runs["resumed"][resize]:
        # the checkpoint of step 3 precedes that reduction: the resumed run replays it before its first batch
        assert resumed["lr_at_step"][STOP_AT] == reference[STOP_AT]
        assert resumed["per_step_reductions"]


def test_epoch_plateau_update_after_an_epoch_end_checkpoint_is_applied_before_the_next_epoch(runs):
    # saved in on_train_epoch_end, before Lightning's plateau update of that epoch, which the resumed run
    # (starting the next epoch) never runs: replayed at train start, the next epoch trains at the reduced LR
    epoch_steps = SAMPLES // 8
    resumed = runs["after_epoch_end"]
    assert min(resumed["lr_at_step"]) == epoch_steps and resumed["global_step"] == epoch_steps + SAMPLES // 4
    assert resumed["lr_at_step"][epoch_steps] == pytest.approx(runs["reference"][0]["lr"])  # 0.025, not 0.05


def test_a_metric_state_without_a_reduction_comes_back_as_rank_zeros_own_share(runs):
    # documented: not merged; rank 0 resumes with saved rank 0's share (12 of the 24 samples), the others empty
    assert runs["reference"][0]["unreduced"] == SAMPLES
    for resize, ranks in runs["resumed"].items():
        assert {r["unreduced"] for r in ranks} == {SAMPLES - 4 * STOP_AT}, resize
