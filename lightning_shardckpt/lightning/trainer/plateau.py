"""ReduceLROnPlateau across a mid-epoch resume: the two updates Lightning would otherwise drop.

- Step interval: the checkpoint is taken at batch end (ShardedCheckpoint.on_train_batch_end), before
  Lightning's plateau step for that batch (in the epoch loop's `on_advance_end`). The save records the
  steps that are due, with the monitored value as it stands at the checkpoint, and the resumed run
  replays them before its first batch: it reduces on the same step as the uninterrupted run.
- Epoch interval: Lightning skips the plateau update at the end of the epoch a run resumed into (the
  fit loop is still "restarting" then). After a mid-epoch resume the callback runs it at the end of that
  epoch, as the uninterrupted run does, on the epoch's logged aggregates (restored, logged_results.py).
  A checkpoint taken at an epoch's end (on_train_epoch_end) precedes that epoch's update, which the
  resumed run never runs either: it is recorded and replayed like a step's.
"""

from __future__ import annotations

from typing import Any


def due_after(trainer: Any, interval: str) -> list[dict[str, Any]]:
    """At a save at batch end ("step") or epoch end ("epoch"): the plateau updates of that interval that
    Lightning runs right after this snapshot, with the monitored values as they stand now."""
    loop = trainer.fit_loop.epoch_loop
    # Lightning's own tests (training_epoch_loop.update_lr_schedulers): no step mid-accumulation
    if not trainer.lightning_module.automatic_optimization or (interval == "step" and loop._should_accumulate()):
        return []
    index_now = loop.batch_idx if interval == "step" else trainer.current_epoch
    due = []
    for index, config in enumerate(trainer.lr_scheduler_configs):
        if config.reduce_on_plateau and config.interval == interval and (index_now + 1) % config.frequency == 0:
            value = trainer.callback_metrics.get(config.monitor)
            if value is not None:  # missing: Lightning raises (strict) or skips it right after the save
                due.append({"scheduler": index, "monitor": config.monitor, "value": _detached(value)})
    return due


def replay(trainer: Any, due: list[dict[str, Any]]) -> None:
    """Before the first resumed batch: the updates the checkpoint was taken before, as Lightning runs them
    (the module's `lr_scheduler_step`, the scheduler progress counted)."""
    configs, loop = trainer.lr_scheduler_configs, trainer.fit_loop.epoch_loop
    for step in due:
        if step["scheduler"] >= len(configs) or configs[step["scheduler"]].monitor != step["monitor"]:
            continue  # configured differently now: nothing to replay
        loop.scheduler_progress.increment_ready()
        trainer.lightning_module.lr_scheduler_step(configs[step["scheduler"]].scheduler, step["value"])
        loop.scheduler_progress.increment_completed()


def update_at_resumed_epoch_end(trainer: Any) -> None:
    """At the end of the epoch a mid-epoch resume continued (on_train_epoch_end): the plateau update
    Lightning skips there, run where the uninterrupted run has it (an epoch that ran to its end)."""
    loop = trainer.fit_loop.epoch_loop
    progress = loop.batch_progress
    ran_to_end = progress.is_last_batch or progress.current.ready >= trainer.num_training_batches
    if trainer.fit_loop.restarting and ran_to_end:  # restarting: Lightning's own update will not run
        loop.update_lr_schedulers("epoch", update_plateau_schedulers=True)


def _detached(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if hasattr(value, "detach") else value
