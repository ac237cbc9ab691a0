"""The data position a checkpoint carries: the sampler's consumed samples and every rank's RNG state."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from ...engine.collectives import rank_and_world
from ...training.data import gather_rng_states, restore_rng_state, rng_state_for_rank, samples_consumed
from .sampler_injection import train_sampler
from .strategy import ShardedStrategy


class DataPosition:
    def __init__(self) -> None:
        self._pending_batches = 0  # trained on, not yet applied by an optimizer step
        self._step_at_last_batch = 0
        self._loaded_rng: Any = None

    def started(self, trainer: pl.Trainer) -> None:
        self._step_at_last_batch = trainer.global_step

    def count_consumed(self, trainer: pl.Trainer) -> None:
        """Batches count as consumed once an optimizer step applied them (gradient accumulation aware)."""
        self._pending_batches += 1
        if trainer.global_step == self._step_at_last_batch:
            return
        self._step_at_last_batch = trainer.global_step
        sampler, batch_size = train_sampler(trainer)
        if sampler is not None and batch_size:
            sampler.mark_consumed(self._pending_batches, batch_size)
        self._pending_batches = 0

    @staticmethod
    def samples_consumed(trainer: pl.Trainer) -> int | None:
        sampler, _ = train_sampler(trainer)
        return samples_consumed(sampler) if sampler is not None else None

    @staticmethod
    def state(trainer: pl.Trainer | None) -> dict[str, Any]:
        """Every rank (the RNG gather is a collective)."""
        sampler, _ = train_sampler(trainer) if trainer is not None else (None, None)
        return {
            "sampler": sampler.state_dict() if sampler is not None else None,
            "rng": gather_rng_states(),  # every rank's generators, so a resized run can apply the rule in data.py
        }

    def load(self, state: dict[str, Any], strategy: Any) -> None:
        """`strategy`: the Trainer's, bound at fit start (None before: a bare load_state_dict call)."""
        self._loaded_rng = state.get("rng")
        if isinstance(strategy, ShardedStrategy):
            # the strategy applies it as the training loader is built, before Lightning sizes the epoch
            strategy.resume_sampler_state(state.get("sampler"))

    def restore_rng(self) -> None:
        """At train start of a resume. The sampler's position was restored earlier, as Lightning built the
        training loader (ShardedStrategy.process_dataloader), so the epoch is sized as an uninterrupted one."""
        loaded, self._loaded_rng = self._loaded_rng, None
        if loaded:
            restore_rng_state(rng_state_for_rank(loaded, rank_and_world()[0]))
