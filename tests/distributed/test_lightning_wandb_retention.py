"""Retention deletes checkpoints that W&B artifacts reference: the offline W&B run (read back from its run
file) lists exactly the deleted ones, with their artifact version and URI, so nobody follows a dead reference."""

from __future__ import annotations

import os

from lightning.pytorch.loggers import WandbLogger

from lightning_shardckpt import ShardedCheckpoint
from lightning_shardckpt.lightning.trainer.wandb_artifacts import SUMMARY_DELETED, SUMMARY_DELETED_STEPS
from tests.helpers.lightning_run import TinyData, TinyModule, ddp_trainer, lightning_env
from tests.helpers.spawn import run_ranks
from tests.helpers.wandb_reader import find_run_file, read_run


def fit_with_retention(rank: int, world_size: int, root: str, workdir: str) -> dict:
    lightning_env(rank, world_size)
    checkpoint = ShardedCheckpoint(root, every_n_train_steps=2, keep_last=2)  # saves 2, 4, 6, 8: 2 and 4 go
    logger = WandbLogger(project="retention", save_dir=workdir, offline=True)
    trainer = ddp_trainer(world_size, 8, [checkpoint], logger=logger)
    trainer.fit(TinyModule(parallelism="ddp"), datamodule=TinyData())
    run_id = logger.experiment.id
    logger.experiment.finish()  # flush the offline run file: a spawned rank exits without W&B's atexit hook
    return {"run_id": run_id}


def test_the_offline_run_lists_every_checkpoint_retention_deleted_and_no_kept_one(tmp_path):
    root, workdir = str(tmp_path / "ckpt"), str(tmp_path / "wandb")
    run_id = run_ranks(fit_with_retention, 1, root, workdir, timeout_s=240)[0].value["run_id"]
    run = read_run(find_run_file(workdir))

    versions = {a["metadata"]["step"]: a for a in run.artifacts if a["type"] == "checkpoint"}
    assert sorted(versions) == [2, 4, 6, 8]
    gone = {step for step, a in versions.items() if not os.path.exists(a["metadata"]["uri"])}
    assert gone == {2, 4}  # retention deleted them after the commits of 6 and 8

    assert run.summary[SUMMARY_DELETED_STEPS] == [2, 4]
    listed = {row["step"]: row for row in run.summary[SUMMARY_DELETED]}
    assert set(listed) == gone
    for step, row in listed.items():
        assert row["artifact"] == f"checkpoints-{run_id}:step-{step}"
        assert row["uri"].endswith(row["checkpoint"]) and versions[step]["metadata"]["uri"].endswith(row["checkpoint"])
        assert row["deleted_at"].endswith("Z")
    # offline, the logged versions cannot change: no extra version was logged to mark them
    assert len([a for a in run.artifacts if a["type"] == "checkpoint"]) == 4
