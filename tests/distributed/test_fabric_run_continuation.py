"""Fabric: a load after train start that continues another run (its checkpoint in this run's shared root) starts
the plug-ins again on that run's saver, as the Checkpointer does (training/resume_sequence.py, SaveLoop's
`continue_from`): the next save is kept or deleted by retention like every other one."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric import Fabric

from lightning_shardckpt import ShardedFabricStrategy
from lightning_shardckpt.engine.catalog import list_checkpoints
from lightning_shardckpt.engine.storage.fsio import resolve
from tests.helpers.lightning_run import lightning_env
from tests.helpers.spawn import run_ranks


def fabric_saves(rank: int, world_size: int, root: str, steps: list[int], load: int | None, save: dict) -> Any:
    """Save `steps[0]`, load step `load` if given, save the rest; returns the run id the last save used."""
    lightning_env(rank, world_size)
    strategy = ShardedFabricStrategy(parallelism="ddp", root=root, keep_last=1, save={"async_save": False, **save})
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(torch.nn.Linear(4, 4))
    fabric.save(root, {"model": model, "step": steps[0]})
    if load is not None:
        fabric.load(load, {"model": model, "step": 0})
    for step in steps[1:]:
        fabric.save(root, {"model": model, "step": step})
    run_id = strategy.host.save_config.run_id
    strategy.close()
    return run_id


def test_a_fabric_load_that_continues_another_run_after_train_start_restarts_retention(tmp_path):
    root = str(tmp_path / "shared")
    run_ranks(fabric_saves, 1, root, [2], None, {"run_id": "run-b"}, timeout_s=180)
    [outcome] = run_ranks(fabric_saves, 1, root, [3, 4], 2, {"allow_shared_root": True}, timeout_s=180)

    assert outcome.value == "run-b"  # the load of run-b's step 2 from this root continues run-b
    by_run = [(entry.step, entry.run_id) for entry in list_checkpoints(resolve(root)) if entry.committed]
    # keep_last=1 for run-b's saves, after the load as before it: step 4 replaced run-b's step 2
    assert [step for step, run_id in by_run if run_id == "run-b"] == [4], by_run
