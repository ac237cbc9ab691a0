"""Retention tells the run's Reporter what it deleted, on the drain after the deleting commit, once each: the
hook W&B uses to mark artifacts whose checkpoint is gone (lightning/trainer/wandb_artifacts.py)."""

from __future__ import annotations

from typing import Any

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.policies.plugin import PluginContext, PluginList, Reporter
from lightning_shardckpt.policies.retention_plugin import RetentionPlugin
from tests.helpers.checkpoints import fresh_state


class DeletionLog(Reporter):
    def __init__(self) -> None:
        self.batches: list[list[dict[str, Any]]] = []

    def checkpoints_deleted(self, deleted: list[dict[str, Any]]) -> None:
        self.batches.append(deleted)


def test_each_deleted_checkpoint_is_reported_once_with_its_step_uri_and_time(tmp_path):
    root = str(tmp_path / "root")
    saver = CheckpointSaver(root, SaveConfig(async_save=False, run_id="r1"))
    reporter = DeletionLog()
    plugins = PluginList([RetentionPlugin(keep_last=2, keep_every_n_steps=None, keep_last_drilled=0)])
    location = fsio.resolve(root)
    plugins.start(PluginContext(location=location, run_id="r1", saver=saver, reporter=reporter))
    try:
        for step in (1, 2, 3, 4):
            saver.save(fresh_state(seed=step), step=step).result(timeout=60)
            plugins.drain(PluginContext(reporter=reporter))  # the training thread's batch end
        plugins.drain(PluginContext(reporter=reporter))  # nothing new: no empty report
    finally:
        saver.close()
    assert [[row["step"] for row in batch] for batch in reporter.batches] == [[1], [2]]
    kept = {entry.name for entry in catalog.list_checkpoints(location) if entry.committed}
    for (row,) in reporter.batches:
        assert row["checkpoint"] not in kept and row["uri"] == f"{location.url.rstrip('/')}/{row['checkpoint']}"
        assert row["deleted_at"] > 0
