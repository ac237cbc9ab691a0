"""When ShardedCheckpoint saves and what it keeps: the callback's own options (`conf/checkpoint/`), Lightning-free.

Frozen and keyword-only like the engine's configs; `__post_init__` names the option, the rule and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .preemption import DEFAULT_GRACE_S


@dataclass(frozen=True, kw_only=True)
class CallbackConfig:
    """When ShardedCheckpoint saves and what it keeps."""

    every_n_train_steps: int | None = None  # save after every N optimizer steps; None: off
    every_n_minutes: float | None = None  # save after N minutes of training time; None: off
    save_on_epoch_end: bool = False
    save_on_fit_end: bool = True  # a final checkpoint when fit ends (skipped if that step is already saved)
    save_on_preemption: bool = True  # SIGTERM / SIGUSR1: a final blocking save, then stop
    # after a preemption signal, a process whose fit has not returned by then exits (status 128 + signal);
    # None: never. Below the scheduler's kill time, above the final save's duration
    preemption_grace_s: float | None = DEFAULT_GRACE_S
    keep_last: int | None = None  # committed checkpoints to keep; None keeps all
    keep_every_n_steps: int | None = None  # also keep every checkpoint whose step is a multiple of this
    resume_required: bool = False  # ckpt_path="latest" with nothing committed: fail instead of starting fresh

    def __post_init__(self) -> None:
        _positive_or_none(
            "every_n_train_steps", self.every_n_train_steps, "every_n_train_steps=100 saves every 100 steps"
        )
        _positive_or_none("every_n_minutes", self.every_n_minutes, "every_n_minutes=30 saves every half hour")
        _positive_or_none(
            "keep_every_n_steps", self.keep_every_n_steps, "keep_every_n_steps=1000 keeps every 1000th step"
        )
        _positive_or_none(
            "preemption_grace_s", self.preemption_grace_s, "preemption_grace_s=60 exits 60 s after the signal"
        )
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(
                f"keep_last={self.keep_last} would delete the checkpoint being written; use >= 1 (or null to keep all)"
            )


def _positive_or_none(name: str, value: float | None, example: str) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{name}={value} must be > 0 or null (off); e.g. {example}")
