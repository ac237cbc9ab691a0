"""A Lightning fit (1 CPU rank, ShardedStrategy + ShardedCheckpoint) on storage that fails, in its own process.

    python -m tests.helpers.fit_on_faulty_storage SPEC_JSON

SPEC: {"root": url, "storage_options": {...}, "keep_last": int|null, "every": int, "max_steps": int,
"scenario": "plain" | "transient_disk_full" | "refused_deletes", "marker": path (refused_deletes)}.
Prints one JSON line (global step, outcome counters, housekeeping notes, committed steps on storage,
the thread each retention pass ran on),
then collects garbage and leaves through the interpreter's normal exit: the exit status is part of
the verdict (134 was a SIGABRT from a half-written tensor record; 1 a `fit` that raised).

Scenarios, each a callback that changes the storage between saves (a save every 2 steps):
- transient_disk_full (quota:// root): after the step-2 checkpoint commits, the disk is sized for two
  checkpoints; someone else's file fills most of the free room for the step-4 save, and is gone again
  from step 5 on;
- refused_deletes (flaky:// root): the storage refuses deletes from step 3 to step 9 (the retention
  passes after the step-4, -6 and -8 commits fail), then allows them again.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import sys
import threading
from typing import Any

import lightning.pytorch as pl

from tests.helpers import flaky_fs, quota_fs  # noqa: F401  (register quota:// and flaky://)


class TransientDiskFull(pl.Callback):
    def __init__(self, root: str) -> None:
        self.root = root
        self.ballast: str | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        saver = trainer.strategy.existing_saver(self.root)
        if saver is None:
            return
        fs = saver.root.fs
        if trainer.global_step == 3:
            saver.wait()  # the step-2 checkpoint committed
            # sized by the shard file: the budget refuses what goes through fsspec's open (shards); the
            # engine's small local files (manifest, .metadata) are never refused, only counted
            (shard,) = glob.glob(os.path.join(saver.root.path, "step-*", "__0_0.distcp"))
            shard_bytes = os.path.getsize(shard)
            fs.budget_bytes = quota_fs.used_bytes(fs.quota_root) + int(
                1.3 * shard_bytes
            )  # room for one more: two in all
            self.ballast = os.path.join(fs.quota_root, "someone-elses-file")
            with open(self.ballast, "wb") as handle:  # leaves 0.4 shards of room for step 4
                handle.write(b"\0" * int(0.9 * shard_bytes))
        elif trainer.global_step == 5 and self.ballast:
            saver.wait()  # the step-4 save ran out of space
            os.unlink(self.ballast)
            self.ballast = None


class RefusedDeletes(pl.Callback):
    def __init__(self, root: str, marker: str) -> None:
        self.root, self.marker = root, marker

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        saver = trainer.strategy.existing_saver(self.root)
        if saver is None:
            return
        if 3 <= trainer.global_step <= 9:
            # every save finished (retention included) before the step goes on: the passes after the
            # step-4, -6 and -8 commits meet the refusal wherever retention runs
            saver.wait()
        if trainer.global_step == 3:
            open(self.marker, "w").close()
        elif trainer.global_step == 9:
            os.unlink(self.marker)


class KeepSaver(pl.Callback):
    """Holds on to the run's saver: the strategy forgets it at teardown, its counters are the report."""

    def __init__(self, root: str) -> None:
        self.root, self.saver = root, None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.saver = trainer.strategy.existing_saver(self.root) or self.saver


def watch_retention_threads() -> list[str]:
    """Record the name of the thread each retention pass runs on (the pass itself is untouched)."""
    from lightning_shardckpt.policies import retention

    threads: list[str] = []
    apply = retention.apply

    def watched(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return apply(*args, **kwargs)

    retention.apply = watched
    return threads


def main(spec: dict) -> int:
    from lightning_shardckpt import ShardedCheckpoint, ShardedStrategy
    from lightning_shardckpt.engine import catalog
    from lightning_shardckpt.engine.storage import fsio
    from tests.helpers.lightning_run import TinyData, TinyModule

    root, options = spec["root"], spec.get("storage_options") or {}
    retention_threads = watch_retention_threads()
    keeper = KeepSaver(root)
    callbacks: list[pl.Callback] = [keeper]
    if spec["scenario"] == "transient_disk_full":
        callbacks.append(TransientDiskFull(root))
    elif spec["scenario"] == "refused_deletes":
        callbacks.append(RefusedDeletes(root, spec["marker"]))
    checkpoint = ShardedCheckpoint(
        root,
        every_n_train_steps=spec["every"],
        keep_last=spec.get("keep_last"),
        log_artifact=False,
        save={"storage_options": options, "teardown_timeout_s": 60, "write_events": False},
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ShardedStrategy(parallelism="ddp"),
        max_steps=spec["max_steps"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, checkpoint],
    )
    trainer.fit(TinyModule(), datamodule=TinyData())
    location = fsio.resolve(root, options)
    committed = sorted(entry.step for entry in catalog.list_checkpoints(location) if entry.committed)
    uncommitted = sorted(entry.step for entry in catalog.list_checkpoints(location) if not entry.committed)
    saver = keeper.saver
    report = {
        "global_step": trainer.global_step,
        "counters": saver.counters.snapshot(),
        "notes": saver.counters.notes(),
        "committed_on_storage": committed,
        "uncommitted_on_storage": uncommitted,
        "retention_threads": retention_threads,
    }
    gc.collect()
    print(json.dumps(report))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
