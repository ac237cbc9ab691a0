"""SaveSchedule (training/schedule.py): when a save is due and why, from plain inputs; and the rooms that
plug-ins and the schedule live in import without Lightning."""

from __future__ import annotations

from lightning_shardckpt.training.callback_options import CallbackConfig
from lightning_shardckpt.training.schedule import (
    EPOCH_END,
    FIT_END,
    HEALTH_STOP,
    MINUTES,
    PREEMPTION,
    STEPS,
    SaveSchedule,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def schedule(**options) -> tuple[SaveSchedule, Clock]:
    clock = Clock()
    return SaveSchedule(CallbackConfig(**options), clock=clock), clock


def reasons(plan: SaveSchedule, steps, **kwargs) -> dict[int, str]:
    """Run the schedule over `steps`, saving whatever it asks for; the reasons by step."""
    out = {}
    for step in steps:
        due = plan.at_batch_end(step, **{"max_steps": None, **kwargs})
        if due is not None and due.save:
            plan.saving(step)
            plan.saved()
            out[step] = due.reason
    return out


def test_every_n_train_steps_is_due_on_multiples_of_n_only():
    plan, _ = schedule(every_n_train_steps=3, save_on_fit_end=False)
    assert reasons(plan, range(0, 10)) == {3: STEPS, 6: STEPS, 9: STEPS}


def test_a_health_interval_factor_stretches_the_step_interval():
    plan, _ = schedule(every_n_train_steps=2, save_on_fit_end=False)
    assert reasons(plan, range(1, 13), interval_factor=3.0) == {6: STEPS, 12: STEPS}
    # the product is rounded and never below one step
    plan, _ = schedule(every_n_train_steps=2, save_on_fit_end=False)
    assert reasons(plan, range(1, 4), interval_factor=0.1) == {1: STEPS, 2: STEPS, 3: STEPS}


def test_a_step_already_saved_is_never_saved_twice_and_step_zero_never():
    plan, _ = schedule(every_n_train_steps=1)
    plan.started(resumed_step=4)  # a resume of step 4 counts as saved
    assert plan.at_batch_end(4, max_steps=None) is None
    assert plan.at_batch_end(0, max_steps=None) is None
    assert plan.at_batch_end(5, max_steps=None).reason == STEPS


def test_the_max_steps_last_step_is_the_fit_end_save_and_never_skipped():
    plan, _ = schedule(every_n_train_steps=4)
    due = plan.at_batch_end(8, max_steps=8)  # also a multiple of every_n_train_steps: still the last state
    assert (due.reason, due.never_skip, due.stop) == (FIT_END, True, False)
    plan, _ = schedule(every_n_train_steps=4, save_on_fit_end=False)
    assert plan.at_batch_end(7, max_steps=7) is None
    plan, _ = schedule()
    assert plan.at_batch_end(7, max_steps=-1) is None  # no max_steps: the fit end saves at on_train_end


def test_every_n_minutes_reads_the_clock_and_asks_every_rank_to_agree():
    plan, clock = schedule(every_n_minutes=1.0, save_on_fit_end=False)
    asked: list[bool] = []

    def agree(local: bool) -> bool:
        asked.append(local)
        return local

    assert plan.at_batch_end(1, max_steps=None, agree=agree) is None
    clock.now += 61
    assert plan.at_batch_end(2, max_steps=None, agree=agree).reason == MINUTES
    assert asked == [False, True]
    plan.saving(2)
    plan.saved()
    clock.now += 61
    # rank 0's clock decides: a rank-local True is overruled by the agreement
    assert plan.at_batch_end(3, max_steps=None, agree=lambda local: False) is None
    clock.now += 61  # 122 s since the save at step 2: the health factor doubles the interval to 120 s
    assert plan.at_batch_end(4, max_steps=None, interval_factor=2.0).reason == MINUTES


def test_no_clock_collective_when_minutes_are_off_or_a_step_save_is_already_due():
    plan, clock = schedule(every_n_train_steps=2, every_n_minutes=1.0, save_on_fit_end=False)
    clock.now += 3600

    def refuse(local: bool) -> bool:
        raise AssertionError("agree called although the steps decided")

    assert plan.at_batch_end(2, max_steps=None, agree=refuse).reason == STEPS
    plan, _ = schedule(every_n_train_steps=2, save_on_fit_end=False)
    assert plan.at_batch_end(3, max_steps=None, agree=refuse) is None


def test_preemption_saves_blocking_even_an_already_saved_step_and_stops():
    plan, _ = schedule(every_n_train_steps=1)
    plan.saving(5)
    due = plan.at_batch_end(5, max_steps=None, preempted=True)
    assert (due.reason, due.save, due.blocking, due.never_skip, due.stop) == (PREEMPTION, True, True, True, True)


def test_a_stop_request_saves_once_unless_the_step_is_saved_and_is_answered_once():
    plan, _ = schedule(every_n_train_steps=100)
    due = plan.at_batch_end(7, max_steps=None, stop_reason="a rule asked")
    assert (due.reason, due.save, due.blocking, due.stop) == (HEALTH_STOP, True, True, True)
    assert plan.at_batch_end(8, max_steps=None, stop_reason="a rule asked") is None  # answered already
    plan, _ = schedule()
    plan.saving(7)
    due = plan.at_batch_end(7, max_steps=None, stop_reason="a rule asked")
    assert (due.save, due.stop) == (False, True)


def test_epoch_end_and_fit_end_saves_skip_a_saved_step():
    plan, _ = schedule(save_on_epoch_end=True)
    assert plan.at_epoch_end(3).reason == EPOCH_END
    plan.saving(3)
    assert plan.at_epoch_end(3) is None and plan.at_fit_end(3) is None
    due = plan.at_fit_end(4)
    assert (due.reason, due.never_skip) == (FIT_END, True)
    assert plan.at_fit_end(0) is None
    assert schedule(save_on_epoch_end=False)[0].at_epoch_end(3) is None
    assert schedule(save_on_fit_end=False)[0].at_fit_end(3) is None


def test_a_skipped_save_restores_the_last_saved_step():
    plan, _ = schedule()
    previous = plan.saving(4)
    plan.skipped(previous)
    assert plan.last_saved_step is None and plan.at_fit_end(4).reason == FIT_END
