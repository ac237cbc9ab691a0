"""tests/helpers/wandb_reader.py against a real W&B offline run made by Lightning's WandbLogger."""

from __future__ import annotations

import shutil
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import WandbLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_shardckpt.engine.format.names import checkpoint_dirname
from tests.helpers.wandb_reader import BLOCK_SIZE, find_run_file, iter_records, read_run

CHECKPOINT = checkpoint_dirname(6, "abcdef012345")  # the directory the logged artifact references

BIG = "x" * (3 * BLOCK_SIZE)  # a config value whose record spans several 32 KiB blocks (FIRST, MIDDLE, LAST)


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.layer(inputs), targets)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """A 6-step fit logged by WandbLogger (offline), plus a checkpoint artifact by reference; the run is finished."""
    save_dir = tmp_path_factory.mktemp("wandb")
    ckpt_dir = save_dir / "ckpt" / CHECKPOINT
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / "manifest.json").write_text('{"step": 6}')
    logger = WandbLogger(save_dir=str(save_dir), project="reader-test", mode="offline")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    logger.log_hyperparams({"lr": 0.1, "nested": {"depth": 2}, "big": BIG})
    trainer.fit(Regression(), DataLoader(data, batch_size=4))
    import wandb

    artifact = wandb.Artifact("checkpoints-reader-test", type="checkpoint", metadata={"step": 6})
    artifact.add_reference(ckpt_dir.as_uri(), name="step-000000006")
    logger.experiment.log_artifact(artifact, aliases=["latest", "step-6"])
    logger.experiment.summary["final_note"] = "done"
    run_id = logger.experiment.id
    logger.experiment.finish()
    wait_for_the_exit_record(find_run_file(str(save_dir)))
    return save_dir, run_id


def wait_for_the_exit_record(run_file: str, timeout_s: float = 120.0) -> None:
    """finish() can return before wandb-core has written the run's last records (seen on a loaded machine: the
    file grew from 11 to 36 records after it); the tests read the file as a finished run, which ends with `exit`."""
    deadline = time.monotonic() + timeout_s
    while not any(record.WhichOneof("record_type") == "exit" for record in iter_records(run_file)):
        assert time.monotonic() < deadline, f"{run_file} has no exit record {timeout_s:g} s after finish()"
        time.sleep(0.1)


def test_history_rows_hold_every_logged_step(offline_run):
    save_dir, run_id = offline_run
    run = read_run(find_run_file(str(save_dir)))
    assert run.run_id == run_id
    losses = [(row["trainer/global_step"], row["train/loss"]) for row in run.history if "train/loss" in row]
    assert [step for step, _ in losses] == list(range(6))
    assert all(isinstance(loss, float) for _, loss in losses)
    assert [step for step, _ in run.series("train/loss")] == [
        row["_step"] for row in run.history if "train/loss" in row
    ]


def test_config_summary_and_artifacts_are_read(offline_run):
    save_dir, _ = offline_run
    run = read_run(find_run_file(str(save_dir)))
    assert run.config["lr"] == 0.1 and run.config["nested"] == {"depth": 2}
    assert run.config["big"] == BIG  # reassembled from FIRST/MIDDLE/LAST fragments across blocks
    assert run.summary["final_note"] == "done"
    assert run.summary["trainer/global_step"] == 5
    (artifact,) = run.artifacts
    assert artifact["type"] == "checkpoint" and artifact["name"] == "checkpoints-reader-test"
    assert set(artifact["aliases"]) == {"latest", "step-6"} and artifact["metadata"] == {"step": 6}
    (entry,) = artifact["entries"]
    assert entry["ref"].startswith("file://") and entry["ref"].endswith(f"{CHECKPOINT}/manifest.json")


def test_a_torn_tail_ends_the_stream_without_error(offline_run, tmp_path):
    save_dir, _ = offline_run
    whole = find_run_file(str(save_dir))
    complete = list(iter_records(whole))
    torn = tmp_path / "torn.wandb"
    shutil.copyfile(whole, torn)
    with open(torn, "r+b") as handle:
        handle.truncate(torn.stat().st_size - 5)  # a run still being written (or killed mid-record)
    partial = list(iter_records(str(torn)))
    assert 0 < len(partial) < len(complete)
    assert [r.SerializeToString() for r in partial] == [r.SerializeToString() for r in complete[: len(partial)]]


def test_a_file_that_is_not_a_run_is_refused(tmp_path):
    path = tmp_path / "run-bogus.wandb"
    path.write_bytes(b"PK\x03\x04 not a W&B file")
    with pytest.raises(ValueError, match="not a W&B run file"):
        list(iter_records(str(path)))
