"""One externally launched rank of a long training run that a test preempts with real signals.

    RANK=0 WORLD_SIZE=2 MASTER_PORT=... python -m tests.helpers.preemption_rank ROOT [--health] [--grace S]

Started once per rank by tests/distributed/test_preemption_signals.py with the environment torchrun or SLURM
gives a rank (torchelastic-style variables: Lightning uses the existing ranks and launches nothing), forked from
the tests' forkserver (tests.helpers.spawn.ForkedMain) rather than as a fresh interpreter. It trains
far more steps than the test waits for, a little slowly, saving every few steps; the test signals it. When fit
returns, it prints one line `RESULT {json}` (its step and the callback's view) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_shardckpt import ShardedCheckpoint, ShardedStrategy
from tests.helpers.lightning_run import TinyData, TinyModule

HEALTH_RULES = Path(__file__).resolve().parents[2] / "conf" / "health" / "default.yaml"
STEP_S = 0.1  # per step: a signal lands mid-run, a few steps after the first commit


class SlowSteps(pl.Callback):
    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(STEP_S)


class SlowFitEnd(pl.Callback):
    """The end of fit takes a while, as a large model's final save does: a signal sent a moment after
    another rank's lands while this rank is still inside fit. Runs before ShardedCheckpoint's hook."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_end(self, *args: Any) -> None:
        time.sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--health", action="store_true", help="the recipe's default health rules (their all-reduce)")
    parser.add_argument("--grace", type=float, default=None, help="preemption_grace_s")
    parser.add_argument("--slow-fit-end", type=float, default=0.0)
    args = parser.parse_args()
    options: dict[str, Any] = {}
    if args.grace is not None:
        options["preemption_grace_s"] = args.grace
    checkpoint = ShardedCheckpoint(
        args.root,
        every_n_train_steps=4,
        log_artifact=False,
        health=str(HEALTH_RULES) if args.health else None,
        **options,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=ShardedStrategy(parallelism="ddp"),
        max_steps=100_000,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SlowSteps(), SlowFitEnd(args.slow_fit_end), checkpoint],
    )
    trainer.fit(TinyModule(), datamodule=TinyData())
    result = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "last_saved_step": checkpoint.last_saved_step,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
