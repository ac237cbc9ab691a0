"""When a save is due, and why: the save schedule of every front door, free of any framework.

Plain inputs (the optimizer step, the clock, flags the caller already agreed on across ranks) in, a
`Due` (why, whether to block, whether training stops) or None out. The caller owns the collectives: a
verdict read off one rank's clock goes through `agree` so every rank decides alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from .callback_options import CallbackConfig

log = logging.getLogger(__name__)

STEPS = "every_n_train_steps"
MINUTES = "every_n_minutes"
EPOCH_END = "epoch_end"
FIT_END = "fit_end"
PREEMPTION = "preemption"
HEALTH_STOP = "health_stop"
MANUAL = "manual"  # a save the loop asked for (Checkpointer.save, fabric.save)


@dataclass(frozen=True, kw_only=True)
class Due:
    """What the schedule asks for at one point of the loop."""

    reason: str  # one of the names above
    save: bool = True  # False: stop only (the step is already saved)
    blocking: bool = False  # wait for the commit before training goes on (the run is about to stop)
    never_skip: bool = False  # the run's last state: wait for a slot even under when_busy=skip
    stop: bool = False  # training stops after this step


class SaveSchedule:
    """Decides whether a save is due; remembers the last saved step and when it was saved."""

    def __init__(self, options: CallbackConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self.clock = clock
        self.last_saved_step: int | None = None
        self.last_save_time = clock()
        self.stopped = False  # a stop already acted on: the stop request is answered once

    # --- what the caller tells it ---
    def started(self, resumed_step: int | None = None) -> None:
        """Training starts (again): minutes count from now; a resumed step counts as saved."""
        self.last_save_time = self.clock()
        if resumed_step is not None:
            self.last_saved_step = resumed_step

    def saving(self, step: int) -> int | None:
        """A save of `step` starts: recorded before the snapshot, so it holds it too. Returns the previous value."""
        previous, self.last_saved_step = self.last_saved_step, step
        return previous

    def skipped(self, previous: int | None) -> None:
        """The saver skipped it (when_busy=skip): nothing was saved, so the fit-end save must still happen."""
        self.last_saved_step = previous

    def saved(self) -> None:
        self.last_save_time = self.clock()

    # --- what it decides ---
    def minutes_elapsed(self, interval_factor: float = 1.0) -> bool:
        """This process's clock: every_n_minutes (× the health factor) passed since the last save."""
        minutes = self.options.every_n_minutes
        return (
            minutes is not None and minutes > 0 and self.clock() - self.last_save_time >= minutes * 60 * interval_factor
        )

    def at_batch_end(
        self,
        step: int,
        *,
        max_steps: int | None,
        preempted: bool = False,
        stop_reason: str | None = None,
        interval_factor: float = 1.0,
        agree: Callable[[bool], bool] = bool,
    ) -> Due | None:
        """After the optimizer step `step`. `agree` turns this rank's clock verdict into every rank's (a
        collective): it is called only where every rank calls it, never after an earlier rank-alike answer.
        `stop_reason`: why a plug-in (a health rule's stop_training) asks to stop, answered once."""
        if preempted:  # one final blocking save, even of a step already saved
            log.warning("preemption signal: saving step %d before stopping", step)
            return Due(reason=PREEMPTION, blocking=True, never_skip=True, stop=True)
        if stop_reason is not None and not self.stopped:
            self.stopped = True
            log.error("stopping training at step %d: %s", step, stop_reason)
            return Due(reason=HEALTH_STOP, save=step != self.last_saved_step, blocking=True, never_skip=True, stop=True)
        if step <= 0 or step == self.last_saved_step:
            return None
        every = self.options.every_n_train_steps
        every = max(1, round(every * interval_factor)) if every else None  # lower_frequency while a rule fires
        # the fit-end save of a max_steps stop happens here, at the last batch: by the fit's end the
        # framework has marked the epoch finished, and a resume would skip the rest of it
        last_step = self.options.save_on_fit_end and max_steps not in (None, -1) and step >= max_steps
        if last_step:
            return Due(reason=FIT_END, never_skip=True)
        if every and step % every == 0:
            return Due(reason=STEPS)
        if self.options.every_n_minutes and agree(self.minutes_elapsed(interval_factor)):
            return Due(reason=MINUTES)
        return None

    def at_epoch_end(self, step: int) -> Due | None:
        if self.options.save_on_epoch_end and step != self.last_saved_step:
            return Due(reason=EPOCH_END)
        return None

    def at_fit_end(self, step: int) -> Due | None:
        if self.options.save_on_fit_end and step != self.last_saved_step and step > 0:
            return Due(reason=FIT_END, never_skip=True)  # the run's last state: waits for a slot even under skip
        return None
