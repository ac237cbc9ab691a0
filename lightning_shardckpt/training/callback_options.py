"""When ShardedCheckpoint saves and what it keeps: the callback's own options (`conf/checkpoint/`), Lightning-free.

Frozen and keyword-only like the engine's configs; `__post_init__` names the option, the rule and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.validate import require_keep_last, require_number, typed_options
from .preemption import DEFAULT_GRACE_S


@dataclass(frozen=True, kw_only=True)
@typed_options()
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

    @classmethod
    def saves_when_asked(
        cls, *, keep_last: int | None, keep_every_n_steps: int | None, resume_required: bool
    ) -> CallbackConfig:
        """A door that saves only when its loop asks (Fabric's `fabric.save`): retention and the resume policy
        apply, no schedule, no fit-end or preemption save of its own."""
        return cls(
            save_on_fit_end=False,
            save_on_preemption=False,
            keep_last=keep_last,
            keep_every_n_steps=keep_every_n_steps,
            resume_required=resume_required,
        )

    def __post_init__(self) -> None:
        require_number(
            "every_n_train_steps",
            self.every_n_train_steps,
            integer=True,
            at_least=1,
            allow_none=True,
            hint="every_n_train_steps=100 saves every 100 steps",
        )
        require_number(
            "every_n_minutes",
            self.every_n_minutes,
            above=0,
            allow_none=True,
            hint="every_n_minutes=30 saves every half hour",
        )
        require_number(
            "keep_every_n_steps",
            self.keep_every_n_steps,
            integer=True,
            at_least=1,
            allow_none=True,
            none_means="none",
            hint="keep_every_n_steps=1000 keeps every 1000th step",
        )
        require_keep_last(self.keep_last)
        require_number(
            "preemption_grace_s",
            self.preemption_grace_s,
            above=0,
            allow_none=True,
            none_means="no watchdog",
            hint="preemption_grace_s=60 exits 60 s after the signal",
        )
