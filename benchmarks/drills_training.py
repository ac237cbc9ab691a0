"""One training run for benchmarks/drills.py: the main job's model on 2 DDP CPU ranks, drills on or off.

Lightning starts rank 1 by re-running this script; rank 0 writes the loop time to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))  # lm.py, and the probe lm:probe for the drill ranks
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl  # noqa: E402
import lm  # noqa: E402

from lightning_shardckpt import ShardedCheckpoint, ShardedStrategy  # noqa: E402
from lightning_shardckpt.engine.format import drill_records  # noqa: E402
from lightning_shardckpt.engine.storage.fsio import resolve  # noqa: E402


class LoopTimer(pl.Callback):
    """Wall time of the training loop: after start-up, before the final save's wait (ShardedCheckpoint runs last)."""

    def __init__(self) -> None:
        self.started = self.loop_s = self.cpu_started = self.loop_cpu_s = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started, self.cpu_started = time.perf_counter(), time.process_time()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.loop_s = time.perf_counter() - self.started
        # this rank's own CPU (every thread): what drills add to the training process itself, far less noisy on
        # a shared machine than wall time (a drill in other processes shows only in loop_s)
        self.loop_cpu_s = time.process_time() - self.cpu_started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--drill-every", type=int, default=None)
    parser.add_argument("--drill-mode", choices=("training", "external"), default="training")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    data = lm.CharDataModule(num_chars=400_000, batch_size=16)
    model = lm.CharLM(vocab_size=len(lm.ALPHABET), d_model=args.d_model, n_layers=4, n_heads=4, decay_steps=args.steps)
    drill = {"every_n_checkpoints": args.drill_every, "probe": "lm:probe"} if args.drill_every else None
    if args.drill_mode == "external":  # a follower drills (benchmarks/drills.py starts it); the run watches
        drill = {"mode": "external", "probe": "lm:probe"}
    checkpoint = ShardedCheckpoint(
        args.root, every_n_train_steps=args.save_every, keep_last=2, log_artifact=False, drill=drill
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardedStrategy(parallelism="ddp"),
        max_steps=args.steps,
        callbacks=[timer := LoopTimer(), checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, data)
    if trainer.is_global_zero:
        drills = drill_records.list_record_names(resolve(args.root))
        Path(args.out).write_text(
            json.dumps(
                {
                    "loop_s": timer.loop_s,
                    "loop_cpu_s": timer.loop_cpu_s,
                    "checkpoints": trainer.global_step // args.save_every,
                    "drills": sum(len(records) for records in drills.values()),
                }
            )
        )


if __name__ == "__main__":
    main()
