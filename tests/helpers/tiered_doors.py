"""Inside ranks of `tests.helpers.spawn.run_ranks`: one tiered run, resumed by each of the three front doors.

`write_tiered`: a plain loop's Checkpointer saves steps 1-3 with a fast and a durable tier (every commit copied);
each step's weights differ (the whole parameter set plus the step), so the step a door loads is visible in its
weights. `each_door_resumes`: the Trainer (ShardedCheckpoint), Fabric (ShardedFabricStrategy) and the Checkpointer
each resume `latest` with the same tiers and `drill={"fallback_to_last_good": True}`; between the two rounds rank 0
damages the durable copy of step 3 too (the test damaged the fast copy before). Each door reports the step its
model holds, the path it resumed from and its console resume line.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric import Fabric

from lightning_shardckpt import Checkpointer, ShardedCheckpoint, ShardedFabricStrategy, ShardedStrategy
from tests.helpers.fabric_ranks import TrainerShaped
from tests.helpers.lightning_run import TinyData, TinyModule, lightning_env

DRILL = {"fallback_to_last_good": True}


def tiers(workdir: str) -> dict[str, Any]:
    return {
        "fast": {"dirpath": f"{workdir}/fast"},
        "durable": {"dirpath": f"{workdir}/durable", "every_n_checkpoints": 1},
    }


def weights_at(step: int) -> dict[str, torch.Tensor]:
    """What the model holds after save `step` (the same on every rank)."""
    model = TrainerShaped(seed=1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(float(step))
    return {key: value.clone() for key, value in model.state_dict().items()}


def step_held(model: torch.nn.Module) -> int | None:
    """Which save's weights `model` holds (None: none of them)."""
    held = {key.removeprefix("module."): value for key, value in model.state_dict().items()}
    return next(
        (step for step in (1, 2, 3) if all(torch.equal(held[key], value) for key, value in weights_at(step).items())),
        None,
    )


def adamw_with_state(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The Trainer's optimizer kind (tests/helpers/lightning_run.py), with moments: every door's optimizer maps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(torch.ones(2, 13)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def write_tiered(rank: int, world_size: int, workdir: str) -> None:
    model = TrainerShaped(seed=1)
    state = {"model": model, "optim": adamw_with_state(model)}
    with Checkpointer(tiers=tiers(workdir)) as ckpt:
        for step in (1, 2, 3):
            model.load_state_dict(weights_at(step))
            assert ckpt.save(step, state, blocking=True).result().committed


class ConsoleLines(logging.Handler):
    """The lines a door shows its user (training/console.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        logging.getLogger("lightning_shardckpt.console").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


class HeldAtStart(pl.Callback):
    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = step_held(pl_module)


def trainer_resumes(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    held = HeldAtStart()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        num_nodes=1,
        strategy=ShardedStrategy(parallelism="ddp"),
        max_steps=4,  # the Checkpointer's checkpoint (step 1..3) goes on at its step: a step or two, no save
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ShardedCheckpoint(tiers=tiers(workdir), drill=DRILL, save_on_fit_end=False, log_artifact=False),
            held,
        ],
    )
    trainer.fit(TinyModule(parallelism="ddp"), datamodule=TinyData(), ckpt_path="latest")
    return {"step": held.step, "path": trainer.strategy.last_load.path}


def fabric_resumes(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    fabric = Fabric(
        accelerator="cpu",
        devices=world_size,
        strategy=ShardedFabricStrategy(parallelism="ddp", tiers=tiers(workdir), drill=DRILL),
    )
    fabric.launch()
    model = fabric.setup_module(TrainerShaped(seed=9))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    fabric.load("latest", {"model": model, "optimizer": optimizer})
    out = {"step": step_held(model.module), "path": fabric.strategy.last_load.path}
    fabric.strategy.close()
    return out


def checkpointer_resumes(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    model = TrainerShaped(seed=9)
    with Checkpointer(tiers=tiers(workdir), drill=DRILL) as ckpt:
        ckpt.load({"model": model, "optim": adamw_with_state(model)})
        return {"step": step_held(model), "path": ckpt.last_load.path}


DOORS = {"trainer": trainer_resumes, "fabric": fabric_resumes, "checkpointer": checkpointer_resumes}


def flip_byte(path: str, offset: int) -> None:
    """A bit-flip on disk (same size): the byte at `offset` of the local file `path` inverted."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def each_door_resumes(rank: int, world_size: int, workdir: str, durable_weight: tuple[str, int]) -> dict[str, Any]:
    lightning_env(rank, world_size)
    console = ConsoleLines()
    rounds: dict[str, dict[str, Any]] = {}
    for label in ("fast copy damaged", "both copies damaged"):
        if label == "both copies damaged":
            if rank == 0:
                flip_byte(*durable_weight)
            dist.barrier()
        rounds[label] = {}
        for door, resumes in DOORS.items():
            rounds[label][door] = {**resumes(rank, world_size, workdir), "lines": console.take()}
            dist.barrier()
    return rounds
