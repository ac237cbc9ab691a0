"""The save loop every front door runs: when a run saves, and what goes with each save, written once.

A door (the Trainer's ShardedCheckpoint, Fabric's strategy, the plain loop's Checkpointer) holds one `SaveLoop`
and calls it at its framework's points: `setup`, `start` (train start, after a resume), `at_step_end` (after
each optimizer step), `at_epoch_end`, `save_now` (a save the loop asks for), `finish` (fit end: the last commit,
the plug-ins' last work) or `abort` (an exception). The loop agrees on preemption across ranks, applies the
plug-ins' run control, asks the schedule (training/schedule.py) whether a save is due, picks the saver (the
root's, or a plug-in's override), drains finished saves on the training thread and tells the plug-ins
(policies/plugin.py). What a save holds is the door's: it passes a `request(saver, never_skip)` that hands its
state to the saver and returns the `PendingSave`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, overload

from ..engine import ownership
from ..engine.load.loader import LoadResult
from ..engine.save.saver import CheckpointSaver, PendingSave
from ..policies.plan import CheckpointPlan
from ..policies.plugin import PluginContext, PluginList, Reporter
from .callback_options import CallbackConfig
from .finished_saves import LogRecord, drain_finished, record_logger
from .preflight import preflight_on_every_rank, refuse_unloadable_saves
from .run_ids import RunIds
from .savers import SaverHost
from .schedule import MANUAL, PREEMPTION, Due, SaveSchedule

log = logging.getLogger(__name__)

Request = Callable[[CheckpointSaver, bool], PendingSave]  # (saver, never_skip) -> the save


@dataclass(frozen=True)
class StepEnd:
    """What happened at one step end."""

    pending: PendingSave | None = None  # the save requested now, if one was due
    stop: bool = False  # training stops after this step (preemption, a health rule's stop)
    preempted: bool = False  # every rank agreed on a preemption signal


class SaveLoop:
    """One run's save loop over its plan, plug-ins, schedule and saver host."""

    def __init__(
        self,
        *,
        plan: CheckpointPlan,
        plugins: PluginList,
        options: CallbackConfig,
        host: SaverHost,
        reporter: Reporter,
        rank: int,
        world_size: int,
        log_record: LogRecord | None = None,
        schedule: SaveSchedule | None = None,
        run_ids: RunIds | None = None,
    ) -> None:
        """`schedule` and `run_ids`: a door whose loop is rebuilt per set-up (the Trainer's, per fit) keeps them
        across fits: the last saved step and the run's id outlive one fit."""
        self.plan, self.plugins, self.options, self.host = plan, plugins, options, host
        self.reporter, self.rank, self.world_size = reporter, rank, world_size
        self.schedule = schedule or SaveSchedule(options)
        self.run_ids = run_ids or RunIds(plan.save.run_id)
        self.started = False
        self._log_record = log_record or record_logger(reporter)

    @property
    def root(self) -> str:
        return self.plan.root

    def context(self, **fields: Any) -> PluginContext:
        """What the plug-ins see of the run now."""
        return PluginContext(
            location=self.plan.location,
            storage_options=dict(self.plan.save.storage_options),
            is_global_zero=self.rank == 0,
            world_size=self.world_size,
            host=self.host,
            reporter=self.reporter,
            all_reduce_max=self.host.all_reduce_max,
            allow_shared_root=self.plan.save.allow_shared_root,
            fault_hook=self.host.fault_hook,
            **fields,
        )

    @overload
    def saver(self, create: Literal[True] = True) -> CheckpointSaver: ...

    @overload
    def saver(self, create: bool) -> CheckpointSaver | None: ...

    def saver(self, create: bool = True) -> CheckpointSaver | None:
        """Where saves go now: a plug-in's override (tiers' degraded mode), else the root's (created unless not
        `create`: creating one is collective)."""
        override = self.plugins.saver_override()
        if override is not None:
            return override
        return self.host.saver_for(self.root) if create else self.host.existing_saver(self.root)

    # --- the run's lifecycle ---
    def setup(self, stage: str = "fit") -> None:
        """Every rank, before training: a save configuration no reader could load at this world size is refused
        and the root is checked on every rank (a fit), then the plug-ins set up."""
        if stage == "fit":
            refuse_unloadable_saves(self.plan.save, self.world_size)  # the world size alone: before any state exists
            preflight_on_every_rank(self.plan.location)
        self.plugins.setup(self.context(stage=stage))

    def start(
        self,
        resumed: LoadResult | None,
        *,
        resume_event: dict[str, Any] | None = None,
        state: Callable[[], Mapping[str, Any]] = dict,
    ) -> str:
        """Train start, every rank at the same point, after any resume: saves of `state()` (what the door will
        save, as far as it exists now) that no reader could load are refused, then this run's id (a resume of this
        run's checkpoint continues it), the root's saver (a root another run owns is refused here, before a
        checkpoint is written), then the plug-ins. Returns the run id."""
        # before the saver: making it claims the root (.owner.json) for this run
        refuse_unloadable_saves(self.plan.save, self.world_size, state)
        self.schedule.started(resumed.step if resumed is not None else None)
        run_id = self.run_ids.choose(resumed, self._continues_run, self._new_run_id, self._root_owner)
        self.host.adopt_run_id(run_id)
        saver = self.saver()
        self.plugins.start(self.context(saver=saver, run_id=run_id, resume_event=resume_event))
        self.started = True
        return run_id

    def continue_from(self, resumed: LoadResult) -> str:
        """A resume (training/resume_sequence.py): this run's id now, from the checkpoint it loaded (a resume of
        this run's checkpoint continues it). After train start, a resume that changes the id (a checkpoint of
        another run this root continues) starts the plug-ins again, on that run's saver, at the next save. Every
        rank. Returns the run id."""
        before = self.run_ids.current
        run_id = self.run_ids.choose(resumed, self._continues_run, self._new_run_id, self._root_owner)
        self.host.adopt_run_id(run_id)
        if self.started and run_id != before:
            self.started = False
        return run_id

    def at_step_end(self, step: int, request: Request, *, max_steps: int | None, preemption_requested: bool) -> StepEnd:
        """After the optimizer step `step`, every rank: finished saves drained, the ranks agree on preemption and
        run control, and a save happens when the schedule says so."""
        self.drain()
        preempted = self.agree_on_preemption(self.options.save_on_preemption and preemption_requested)
        self.plugins.apply_control(self.host.existing_saver(self.root), self.plan.save.when_busy)
        due = self.schedule.at_batch_end(
            step,
            max_steps=max_steps,
            preempted=preempted,
            stop_reason=self.plugins.stop_reason(),
            interval_factor=self.plugins.interval_factor(),
            agree=lambda due: bool(self.host.broadcast(due)),  # rank 0's clock decides for all
        )
        return self._act(step, due, request, preempted=preempted)

    def at_epoch_end(self, step: int, request: Request) -> StepEnd:
        return self._act(step, self.schedule.at_epoch_end(step), request)

    def at_fit_end(self, step: int, request: Request) -> StepEnd:
        return self._act(step, self.schedule.at_fit_end(step), request)

    def save_now(self, step: int, request: Request, *, blocking: bool = False) -> PendingSave:
        """A save the loop asks for (every rank, the same step), whatever the schedule."""
        pending = self._act(step, Due(reason=MANUAL, blocking=blocking, never_skip=True), request).pending
        assert pending is not None
        return pending

    def agree_on_preemption(self, requested_here: bool) -> bool:
        """Any rank's request, agreed by every rank in one collective: a plug-in's own all-reduce (the health
        rules' control state) carries it, else the host's agreement."""
        verdict = self.plugins.sync(requested_here, self.context())
        if verdict is None:
            verdict = self.options.save_on_preemption and self.host.reduce_boolean_decision(requested_here, all=False)
        return bool(verdict)

    def drain(self) -> None:
        """Finished saves, on the training thread: every rank drains, rank 0 logs each and tells the plug-ins."""
        drain_finished(self.saver(create=False), self.plugins, self.context(), self._log_record)

    def finish(self) -> None:
        """Fit end, every rank: the run's last checkpoint commits, the plug-ins finish their work (drills,
        copies, mitigations), the last records are logged."""
        saver = self.saver(create=False)
        if saver is not None:
            saver.close()  # a failure under on_error="raise" is raised here
        self.plugins.flush()
        self.drain()
        self.plugins.close(self.context(), finished=True)

    def abort(self) -> None:
        """Training failed: in-flight saves may still commit, nothing more is saved, the plug-ins stop."""
        saver = self.saver(create=False)
        try:
            if saver is not None:
                saver.close()  # a half-finished one stays uncommitted
        finally:
            self.plugins.close(PluginContext(is_global_zero=self.rank == 0), finished=False)

    # --- internals ---
    def _act(self, step: int, due: Due | None, request: Request, *, preempted: bool = False) -> StepEnd:
        """What the schedule asked for: a save (collectives: every rank at the same step), then maybe a stop."""
        pending = None
        if due is not None and due.save:
            self.plugins.before_save(self.context())  # tiers: degraded mode when the fast tier failed
            previous = self.schedule.saving(step)  # before the snapshot, so the snapshot records it too
            pending = request(self.saver(), due.never_skip)
            if pending.done() and pending.result().skipped:
                self.schedule.skipped(previous)  # nothing was saved: the fit-end save must still happen
            self.schedule.saved()
            if due.blocking:
                pending.result()
                self.drain()
        stop = due is not None and due.stop
        if due is not None and due.stop and due.reason == PREEMPTION and self.rank == 0:
            committed = pending is not None and pending.result().committed
            said = "is committed" if committed else "did NOT commit (see above)"
            log.warning("preempted: step %d %s under %s; training stops", step, said, self.root)
        return StepEnd(pending=pending, stop=stop, preempted=preempted)

    def _continues_run(self, checkpoint_path: str) -> bool:
        return self.plan.owns(checkpoint_path) or self.plugins.owns(checkpoint_path)

    def _new_run_id(self) -> str:
        return self.host.broadcast(ownership.new_run_id())

    def _root_owner(self) -> str | None:
        """The run id that owns this root (a broadcast: every rank alike); None without a readable marker."""
        owner = None
        if self.rank == 0:
            try:
                marker = ownership.read_owner(self.plan.location)
                owner = marker.get("run_id") if marker else None
            except Exception:  # noqa: BLE001 - asked before the owner check, which raises the real error
                owner = None
        return self.host.broadcast(owner)
