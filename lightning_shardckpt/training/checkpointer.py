"""Checkpointer: asynchronous, committed, verified checkpoints of a plain PyTorch loop (no Lightning).

    ckpt = Checkpointer("s3://bucket/run-7", every_n_steps=500, keep_last=3, sampler=sampler)
    state = {"model": model, "optim": optimizer}
    start = ckpt.load(state) or 0                      # resumes the run (any world size), or None: fresh
    for step in range(start + 1, max_steps + 1):
        ...; optimizer.step(); sampler.mark_consumed(1, batch_size)
        ckpt.maybe_save(step, state)                   # when the schedule says so; commits in the background
    ckpt.close()                                       # waits for the last commit

The same schedule (training/schedule.py), plan (training/plan.py), plug-ins (retention, tiers, drills,
health: policies/) and run ids (training/run_ids.py) as ShardedCheckpoint, the Lightning front door. It
owns the run id (a resume continues the loaded run, whatever was constructed first), the sampler's
position and every rank's RNG (training/data.py), and, opt-in, the preemption signals (training/preemption.py).
How the user's objects become DCP state: training/user_state.py. Docs: docs/howto/plain-pytorch.md.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from typing import Any

from ..engine import metrics, ownership
from ..engine.collectives import rank_and_world
from ..engine.config import CHECKPOINTER, LoadConfig, save_config_from
from ..engine.format import safe_pickle
from ..engine.load.loader import LoadResult
from ..engine.save.saver import CheckpointSaver, PendingSave
from ..engine.tiers.config import tiers_config_from
from ..policies.drill_plugin import drill_config_from
from ..policies.health_rules import health_config_from
from ..policies.plugin import PluginContext
from ..policies.tiers import tiered_dirpath
from . import front_doors, user_state
from .callback_options import CallbackConfig
from .checkpoint_setup import checkpoint_plan, checkpoint_plugins, placement_from_env
from .data import (
    ResumableDistributedSampler,
    gather_rng_states,
    restore_rng_state,
    rng_state_for_rank,
    samples_consumed,
)
from .finished_saves import CallableReporter, drain_finished, record_logger
from .loadable import SaveChecks
from .preemption import DEFAULT_GRACE_S, PreemptionRequests
from .preflight import preflight_on_every_rank
from .resume import resume
from .run_ids import RunIds
from .savers import SaverHost
from .schedule import PREEMPTION, Due, SaveSchedule

log = logging.getLogger(__name__)

MANUAL = "manual"  # a save the loop asked for with save()


class Checkpointer:
    """Checkpoints of a plain training loop. Construct it on every rank at the same point (collectives)."""

    def __init__(
        self,
        root: str | None = None,
        *,
        every_n_steps: int | None = None,
        every_n_minutes: float | None = None,
        max_steps: int | None = None,
        keep_last: int | None = None,
        keep_every_n_steps: int | None = None,
        save: Any = None,
        sampler: ResumableDistributedSampler | None = None,
        restore_rng: bool = True,
        resume_required: bool = False,
        verify_on_load: bool = True,
        trust_checkpoint: bool = False,
        save_on_preemption: bool = False,
        preemption_grace_s: float | None = DEFAULT_GRACE_S,
        log_metrics: Callable[[dict[str, float], int], Any] | None = None,
        drill: Any = None,
        health: Any = None,
        tiers: Any = None,
    ) -> None:
        """`max_steps`: the last step saves (never skipped). `save`: SaveConfig or dict. `log_metrics(values,
        step)`: rank 0's checkpoint metrics (e.g. `wandb.log`); they are also under ROOT/events/ (`read_events`)."""
        self.options = CallbackConfig(
            every_n_train_steps=every_n_steps,
            every_n_minutes=every_n_minutes,
            save_on_fit_end=max_steps is not None,
            save_on_preemption=save_on_preemption,
            preemption_grace_s=preemption_grace_s,
            keep_last=keep_last,
            keep_every_n_steps=keep_every_n_steps,
            resume_required=resume_required,
        )
        tiers_config = tiers_config_from(tiers)
        save_options = save_config_from(save)
        self.max_steps, self.sampler, self.restore_rng = max_steps, sampler, restore_rng
        self.schedule = SaveSchedule(self.options)
        self.plugins = checkpoint_plugins(
            self.options, tiers_config, drill_config_from(drill), health_config_from(health)
        )
        self.run_ids = RunIds(save_options.run_id)
        load = LoadConfig(verify_checksums=verify_on_load, trust_checkpoint=trust_checkpoint)
        root = tiered_dirpath(root, tiers_config, save_options)
        placement = placement_from_env()
        self.plan = checkpoint_plan(
            root, save_options, load, resume_required, self.plugins, placement, front_door=CHECKPOINTER
        )
        self.rank, self.world_size = rank_and_world()
        self.host = SaverHost(self.plan.save)
        self._reporter = CallableReporter(log_metrics, lambda: self.step)
        self.step = 0  # the last step the loop reported (metrics are logged at it)
        self.last_load: LoadResult | None = None
        self.not_restored: tuple[str, ...] = ()  # after a load: what the checkpoint did not give back
        self._resume_event: dict[str, Any] | None = None  # rank 0, after a load: handed to the plug-ins at start
        self.should_stop = False  # a preemption save or a health rule's stop: leave the loop
        self._started = False
        self._closed = False
        self._guarded: set[tuple[int, int]] = set()  # (saver, optimizer) pairs with a fence before the step
        self._save_checks = SaveChecks(
            trust_option="Checkpointer(..., trust_checkpoint=True)", pickled_sections={user_state.RESERVED_KEY: ()}
        )
        preflight_on_every_rank(self.plan.location)
        self.plugins.setup(self._context(stage="fit"))
        self._signal = PreemptionRequests(self.options.preemption_grace_s)
        if save_on_preemption:
            self._signal.install()

    @property
    def root(self) -> str:
        """This node's checkpoint root (with tiers: the fast tier's)."""
        return self.plan.root

    @property
    def run_id(self) -> str | None:
        """This run's id once known: the loaded checkpoint's (a resume) or a new one (at the first save)."""
        return self.run_ids.current

    # --- resume ---
    def load(self, state: dict[str, Any], which: str | int = "latest", *, strict: bool = True) -> int | None:
        """Load a committed checkpoint into `state` in place, resharded onto this world size, with the sampler's
        position and the RNG; returns its step, or None when there is nothing to resume from (start fresh).

        `which`: "latest" (this run's root, or the tiers), "last-good", a step, a checkpoint id, or a path. A
        checkpoint of the Trainer or Fabric opens too (training/front_doors.py): the model from its "model", the
        one optimizer from "optimizers.0"; what it does not give back (its data position, RNG) is logged once and
        listed in `not_restored`. `strict=False`: a state entry the checkpoint lacks keeps its value (listed too)."""
        user_state.check_state(state)
        self.host.fence()
        self.host.wait()  # one thread at a time on the checkpoint group
        target = front_doors.CheckpointTarget(state, strict=strict)
        loaded = resume(self.plan, target, which, self.host.checkpoint_group(), strict=strict)
        if loaded is None:
            return None
        layout = target.layout
        assert layout is not None  # the loader shaped the target for the checkpoint it loaded
        own = self._own_section(target.own_section(), loaded.path) if layout.native else {}
        user_state.apply_loaded(state, target.restored())
        if self.sampler is not None and own.get("sampler") is not None:
            self.sampler.load_state_dict(own["sampler"])
        if self.restore_rng and own.get("rng"):
            restore_rng_state(rng_state_for_rank(own["rng"], self.rank))
        self.plugins.load_state_dict(own.get("plugins") or {})
        self.not_restored = self._report_not_restored(layout, loaded.path)
        self.schedule.started(loaded.step)
        self.step, self.last_load = loaded.step, loaded
        run_id = self.run_ids.choose(loaded, self._continues_run, self._new_run_id)
        if self._started and self.host.save_config.run_id != run_id:
            self._started = False  # saved as another run before this load: the plug-ins start again on its saver
        self.host.adopt_run_id(run_id)  # a saver of another id is closed; the next save makes this run's
        self._resume_event = self._resumed(loaded)
        log.info("resumed from %s (step %d) in %.2fs, run %s", loaded.path, loaded.step, loaded.seconds, run_id)
        return loaded.step

    # --- saving ---
    def maybe_save(self, step: int, state: dict[str, Any]) -> PendingSave | None:
        """After the optimizer step `step` (every rank, every step): save when the schedule says so. Returns the
        save (its `result()` waits for the commit), or None; sets `should_stop` after a preemption save."""
        self._start(state, step)
        local = self.options.save_on_preemption and self._signal.requested
        preempted = self.plugins.sync(local, self._context())
        if preempted is None:
            preempted = self.options.save_on_preemption and self.host.reduce_boolean_decision(local, all=False)
        self.plugins.apply_control(self.host.existing_saver(self.root), self.plan.save.when_busy)
        due = self.schedule.at_batch_end(
            step,
            max_steps=self.max_steps,
            preempted=bool(preempted),
            stop_reason=self.plugins.stop_reason(),
            interval_factor=self.plugins.interval_factor(),
            agree=lambda due: bool(self.host.broadcast(due)),  # rank 0's clock decides for all
        )
        return self._save(step, state, due)

    def save(self, step: int, state: dict[str, Any], *, blocking: bool = False) -> PendingSave:
        """Save now (every rank, same step), whatever the schedule; `blocking` waits for the commit."""
        self._start(state, step)
        pending = self._save(step, state, Due(reason=MANUAL, blocking=blocking, never_skip=True))
        assert pending is not None
        return pending

    def close(self) -> None:
        """Wait for in-flight saves to commit, finish the plug-ins' work (drills, copies), release everything."""
        if self._closed:
            return
        self._closed = True
        try:
            saver = self.host.existing_saver(self.root)
            if saver is not None:
                saver.close()  # the run's last checkpoint commits; a failure under on_error="raise" is raised
            self.plugins.flush()
            self._drain()
            self.plugins.close(self._context(), finished=True)
        finally:
            self.host.close()
            self._signal.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if error is None:
            self.close()
            return
        self._closed = True  # training failed: let in-flight saves commit, save nothing more
        try:
            self.plugins.close(PluginContext(is_global_zero=self.rank == 0), finished=False)
        finally:
            self.host.close()
            self._signal.close()

    # --- internals ---
    def _start(self, state: dict[str, Any], step: int) -> None:
        """The first save or maybe_save: the run id is settled and the root claimed (a root another run owns is
        refused here, before a checkpoint is written), then the plug-ins start."""
        if self._closed:
            raise RuntimeError("this Checkpointer is closed; create a new one to save again")
        self.step = step
        if self._started:
            self._drain()
            return
        user_state.check_state(state)
        self._started = True
        self.schedule.started(self.last_load.step if self.last_load is not None else None)
        run_id = self.run_ids.choose(None, self._continues_run, self._new_run_id)
        self.host.adopt_run_id(run_id)
        saver = self.host.saver_for(self.root)
        self.plugins.start(self._context(saver=saver, run_id=run_id, resume_event=self._resume_event))

    def _save(self, step: int, state: dict[str, Any], due: Due | None) -> PendingSave | None:
        pending = None
        if due is not None and due.save:
            self.plugins.before_save(self._context())  # tiers: degraded mode when the fast tier failed
            previous = self.schedule.saving(step)
            saver = self.plugins.saver_override() or self.host.saver_for(self.root)
            pending = self._request(saver, step, state, due.never_skip)
            if pending.done() and pending.result().skipped:
                self.schedule.skipped(previous)
            self.schedule.saved()
            if due.blocking:
                pending.result()
                self._drain()
        if due is not None and due.stop:
            self.should_stop = True
            if due.reason == PREEMPTION and self.rank == 0:
                committed = pending is not None and pending.result().committed
                log.warning(
                    "preempted: step %d %s under %s", step, "committed" if committed else "NOT committed", self.root
                )
        return pending

    def _request(self, saver: CheckpointSaver, step: int, state: dict[str, Any], never_skip: bool) -> PendingSave:
        """Every rank: the user's state and the Checkpointer's own section, handed to the saver."""
        own = {
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "rng": gather_rng_states(self.host.control_group),  # every rank's, so a resized run finds its own
            "plugins": self.plugins.state_dict(),  # health: rule counters and mitigations
        }
        dcp_state = {**user_state.to_dcp(state), user_state.RESERVED_KEY: pickle.dumps(own)}
        # keys that would collide (refused), values a load would refuse (a warning): before anything is written
        self._save_checks(dcp_state, trust=self.plan.load.trust_checkpoint, rank=self.rank)
        if saver.config.overlap_staging:
            self._guard(saver, state)
        models = [value for value in state.values() if user_state.is_module(value)]
        return saver.save(
            dcp_state,
            step,
            epoch=self.sampler.epoch if self.sampler is not None else None,
            samples_consumed=samples_consumed(self.sampler) if self.sampler is not None else None,
            extra=self.plugins.save_extra(models[0], self.rank) if len(models) == 1 else None,
            defer=user_state.deferrable(state),
            never_skip=never_skip,
        )

    def _guard(self, saver: CheckpointSaver, state: dict[str, Any]) -> None:
        """Overlapped staging copies parameters and optimizer state while the loop goes on: every optimizer's
        step waits for that copy first (a step pre-hook), once per optimizer and saver."""
        for optimizer in user_state.optimizers_of(state):
            if (id(saver), id(optimizer)) not in self._guarded:
                self._guarded.add((id(saver), id(optimizer)))
                saver.guard(optimizer)

    def _drain(self) -> None:
        saver = self.host.existing_saver(self.root)
        drain_finished(saver, self.plugins, self._context(), record_logger(self._reporter))

    def _report_not_restored(self, layout: front_doors.Layout, where: str) -> tuple[str, ...]:
        """What the state (or the Checkpointer) asked for and this checkpoint did not give back: logged once
        (rank 0), never silently: the loop then runs on with its own values for them."""
        lacking = [f"state[{key!r}]" for key in layout.missing]
        if not layout.native:
            lacking += ["the sampler's position"] if self.sampler is not None else []
            lacking += ["the RNG states"] if self.restore_rng else []
        mapped = ", ".join(f"state[{key!r}] <- {section!r}" for key, section in layout.mapped().items())
        if lacking and self.rank == 0:
            log.warning(
                "%s was written by %s%s; not restored (they keep their current values): %s",
                where,
                layout.writer,
                f" (loaded {mapped})" if mapped else "",
                ", ".join(lacking),
            )
        return tuple(lacking)

    def _own_section(self, data: bytes, where: str) -> dict[str, Any]:
        try:
            return safe_pickle.loads(data, (), trust=self.plan.load.trust_checkpoint) if data else {}
        except safe_pickle.BlockedGlobal as err:
            raise safe_pickle.untrusted(
                where, f"the Checkpointer's {user_state.RESERVED_KEY!r} entry", err.name
            ) from err

    def _continues_run(self, checkpoint_path: str) -> bool:
        return self.plan.owns(checkpoint_path) or self.plugins.owns(checkpoint_path)

    def _new_run_id(self) -> str:
        return self.host.broadcast(ownership.new_run_id())

    def _resumed(self, loaded: LoadResult) -> dict[str, Any] | None:
        """Rank 0: the resume's event (`shardckpt timeline`, the health rules' resume_s) under ROOT/events/."""
        if self.rank != 0:
            return None
        event = {
            "event": "resume",
            "from": loaded.path,
            "step": loaded.step,
            "seconds": loaded.seconds,
            "from_id": loaded.checkpoint_id,
            "world_size": self.world_size,
            "from_world_size": (loaded.manifest.get("topology") or {}).get("world_size"),
            "run_id": loaded.manifest.get("run_id"),
            "created_at": time.time(),
        }
        if self.plan.save.write_events:
            metrics.write_json_event(self.plan.location, f"resume-step-{loaded.step:09d}", event)
        return event

    def _context(self, **fields: Any) -> PluginContext:
        return PluginContext(
            location=self.plan.location,
            storage_options=dict(self.plan.save.storage_options),
            stage=fields.pop("stage", "fit"),
            is_global_zero=self.rank == 0,
            world_size=self.world_size,
            strategy=self.host,
            reporter=self._reporter,
            all_reduce_max=self.host.all_reduce_max,
            allow_shared_root=self.plan.save.allow_shared_root,
            **fields,
        )
