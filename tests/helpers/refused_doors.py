"""Issue 46 item 6, on a spawned rank: each door, written as its user writes it, with `save.format_version=2` over
the readers' manifest bound. The bound is lowered in this rank (engine/save/metadata_budget.py reads it from its
module: `MANIFEST_MAX_BYTES`) so that a tiny model's v2 manifest at one rank (~3 KB) is over it, as 16,384 ranks x
1,000 tensors are over 1 GiB; every rank sees the same world and shapes, so one rank shows what every rank does.

Each door's run returns how many training steps ran, the refusal (ConfigError's text, or None) and what its root
holds afterwards.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric import Fabric

from lightning_shardckpt import Checkpointer, ConfigError, ShardedCheckpoint, ShardedFabricStrategy
from lightning_shardckpt.engine.save import metadata_budget
from tests.helpers import training_state as ts
from tests.helpers.lightning_run import TinyData, TinyModule, ddp_trainer, lightning_env

BOUND = 2_000  # bytes: the v2 manifest's header and one rank's entry are ~1.6 KB, each tensor ~0.4 KB more
OVER_THE_BOUND = {"format_version": 2, "async_save": False}


def doors_over_the_bound(rank: int, world_size: int, workdir: str) -> dict[str, dict[str, Any]]:
    lightning_env(rank, world_size)
    metadata_budget.MANIFEST_MAX_BYTES = BOUND
    return {
        "trainer": _outcome(_trainer_fit, os.path.join(workdir, "trainer"), world_size),
        "fabric": _outcome(_fabric_loop, os.path.join(workdir, "fabric"), world_size),
        "checkpointer": _outcome(_checkpointer_loop, os.path.join(workdir, "plain"), world_size),
    }


def _outcome(run: Any, root: str, world_size: int) -> dict[str, Any]:
    steps = [0]
    try:
        run(root, world_size, steps)
        refused = None
    except ConfigError as err:
        refused = str(err)
    return {"steps": steps[0], "refused": refused, "root": sorted(os.listdir(root)) if os.path.isdir(root) else None}


def _trainer_fit(root: str, world_size: int, steps: list[int]) -> None:
    class Counted(TinyModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            steps[0] += 1
            return super().training_step(batch, batch_idx)

    checkpoint = ShardedCheckpoint(root, every_n_train_steps=1, save=OVER_THE_BOUND, log_artifact=False)
    trainer = ddp_trainer(world_size, max_steps=3, callbacks=[checkpoint])
    trainer.fit(Counted(), datamodule=TinyData())


def _fabric_loop(root: str, world_size: int, steps: list[int]) -> None:
    strategy = ShardedFabricStrategy(parallelism="ddp", root=root, save=OVER_THE_BOUND)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    try:
        model = fabric.setup_module(ts.build_model(seed=7))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load("latest", state)  # the resume: the run root's latest, or nothing on a fresh root
        for step in range(state["step"] + 1, 4):
            model(torch.randn(8, 13)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            steps[0] += 1
            state["step"] = step
            fabric.save(root, state)
    finally:
        strategy.close()


def _checkpointer_loop(root: str, world_size: int, steps: list[int]) -> None:
    model = ts.build_model(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = {"model": model, "optim": optimizer}
    with Checkpointer(root, every_n_steps=1, max_steps=3, save=OVER_THE_BOUND) as ckpt:
        start = ckpt.load(state) or 0
        for step in range(start + 1, 4):
            model(torch.randn(8, 13)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            steps[0] += 1
            ckpt.maybe_save(step, state)
