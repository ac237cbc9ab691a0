"""What of the user's own training state needs merging across ranks, so a resume on any world size
continues like an uninterrupted run: the module's torchmetrics (metric_states.py), the epoch's logged
aggregates (logged_results.py) and the plateau updates around a mid-epoch checkpoint (plateau.py).

ShardedCheckpoint carries it in its own state (key "user_state"): captured on every rank as Lightning
dumps the checkpoint (collectives on the training group, main thread; rank 0's copy is written), given
back in three moments: the metrics as the callback state loads (the module is set up by then), the
logged aggregates and the replayed plateau updates at train start, the skipped plateau update at the end
of the resumed epoch.
"""

from __future__ import annotations

from typing import Any, cast

import lightning.pytorch as pl
from lightning.pytorch.loops.progress import _ProcessedTracker

from ...engine.collectives import rank_and_world
from . import logged_results, metric_states, plateau

KEY = "user_state"


def _saved_at(trainer: pl.Trainer) -> str | None:
    """Where in the loop this save is, named as the plateau interval whose update follows it: "step" (at
    batch end: Lightning's own test, completed one behind processed), "epoch" (in on_train_epoch_end,
    after an epoch that ran to its end) or None (elsewhere: fit end, outside fit)."""
    if not trainer.training:
        return None
    # Lightning's progress dataclasses declare `current` as the base tracker their default factory subclasses
    batches = cast(_ProcessedTracker, trainer.fit_loop.epoch_loop.batch_progress.current)
    epochs = cast(_ProcessedTracker, trainer.fit_loop.epoch_progress.current)
    if batches.completed == batches.processed - 1:
        return "step"
    in_epoch_end = epochs.completed == epochs.processed - 1
    return "epoch" if in_epoch_end and _last_batch(trainer) else None


def _last_batch(trainer: pl.Trainer) -> bool:
    """The epoch's last batch has run (Lightning's test before its epoch-end plateau update)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.is_last_batch or progress.current.ready >= trainer.num_training_batches


class UserState:
    def __init__(self) -> None:
        self._loaded: dict[str, Any] | None = None
        self._resumed_mid_epoch = False

    def state(self, trainer: pl.Trainer | None) -> dict[str, Any]:
        """Every rank, in Lightning's dump_checkpoint: the metrics' syncs and the results' gather are collectives."""
        if trainer is None or trainer.lightning_module is None:
            return {}
        saved_at = _saved_at(trainer)
        # mid-epoch: the resumed run continues this epoch (after its last batch, Lightning starts the next)
        mid_epoch = saved_at == "step" and not _last_batch(trainer)
        return {
            KEY: {
                "metrics": metric_states.capture(trainer.lightning_module, rank_and_world()[0]),
                "mid_epoch": mid_epoch,
                "logged": logged_results.capture(trainer) if mid_epoch else {},
                "plateau_due": plateau.due_after(trainer, saved_at) if saved_at else [],
            }
        }

    def load(self, state: dict[str, Any], trainer: pl.Trainer | None) -> None:
        """As Lightning restores the callback's state (after the model's): the metrics now, the rest at train start."""
        self._loaded = state.get(KEY)
        if self._loaded and trainer is not None and trainer.lightning_module is not None:
            metric_states.restore(trainer.lightning_module, self._loaded["metrics"], rank_and_world()[0])

    def resumed(self, trainer: pl.Trainer) -> None:
        """At train start of a resume, before the first batch: the epoch's logged aggregates and the
        plateau steps the checkpoint was taken before."""
        loaded, self._loaded = self._loaded, None
        self._resumed_mid_epoch = bool(loaded and loaded["mid_epoch"])
        if not loaded:
            return
        if self._resumed_mid_epoch:
            logged_results.restore(trainer, loaded["logged"], rank_and_world()[0])
        plateau.replay(trainer, loaded["plateau_due"])

    def epoch_ended(self, trainer: pl.Trainer) -> None:
        """At the end of every epoch, after the epoch-end save: the plateau update Lightning skips at the end
        of the epoch a mid-epoch resume continued."""
        if self._resumed_mid_epoch:
            self._resumed_mid_epoch = False
            plateau.update_at_resumed_epoch_end(trainer)
