"""The invariants the doors' types now state: a hook called before Lightning set the door up is refused by name,
with the fix, rather than failing on a None deep inside (lightning/trainer/callback.py, strategy.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from lightning_shardckpt import ShardedCheckpoint, ShardedStrategy


def test_callback_hook_before_setup_names_setup_and_the_fix(tmp_path):
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    callback = ShardedCheckpoint(dirpath=str(tmp_path))
    with pytest.raises(RuntimeError, match=r"ShardedCheckpoint\.setup has not run.*Trainer\(callbacks=\[\.\.\.\]\)"):
        callback.on_train_end(trainer, pl.LightningModule())


def test_strategy_without_a_module_names_what_connects_it():
    strategy = ShardedStrategy(parallelism="ddp")
    with pytest.raises(RuntimeError, match=r"ShardedDDPStrategy has no LightningModule yet.*trainer\.fit"):
        strategy.state_layout()
