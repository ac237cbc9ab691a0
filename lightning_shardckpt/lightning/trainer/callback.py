"""ShardedCheckpoint: the Lightning face of the save schedule, the checkpoint plan and the plug-ins.

Add it to the Trainer's callbacks together with a ShardedStrategy:

    Trainer(strategy=ShardedStrategy(parallelism="fsdp"),
            callbacks=[ShardedCheckpoint(dirpath="s3://bucket/run-7", every_n_train_steps=500, keep_last=3)])
    trainer.fit(model, datamodule, ckpt_path="latest")

When to save: training/schedule.py; the strategy's one plan: training/plan.py; plug-ins: policies/plugin.py.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint

from ...engine.config import LoadConfig, SaveConfig, save_config_from
from ...engine.tiers.config import TiersConfig, tiers_config_from
from ...identity.diff import IdentityPolicy
from ...policies.drills.plugin import DrillConfig, drill_config_from
from ...policies.health.rules import HealthConfig, health_config_from
from ...policies.plugin import PluginContext
from ...policies.tiers.plugin import tiered_dirpath
from ...training.callback_options import CallbackConfig
from ...training.checkpoint_setup import checkpoint_plan, checkpoint_plugins, placement_of
from ...training.plan import CheckpointPlan
from ...training.preemption import DEFAULT_GRACE_S
from ...training.preflight import preflight_on_every_rank
from ...training.run_ids import RunIds
from ...training.schedule import PREEMPTION, Due, SaveSchedule
from .checkpoint_logging import log_resume
from .ckpt_paths import forked_callback_state
from .data_position import DataPosition
from .plugin_context import plugin_context
from .preemption import PreemptionSignal
from .run_identity import RunIdentity
from .saving import log_finished, request_save
from .strategy import ShardedStrategy
from .user_state import UserState


class ShardedCheckpoint(Checkpoint):
    """Asynchronous, committed, verified checkpoints of a Lightning run, resumable on any world size.

    A `Checkpoint` subclass, so Lightning runs it after every other callback: their updates are in the snapshot.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        *,
        every_n_train_steps: int | None = None,
        every_n_minutes: float | None = None,
        save_on_epoch_end: bool = False,
        save_on_fit_end: bool = True,
        save_on_preemption: bool = True,
        preemption_grace_s: float | None = DEFAULT_GRACE_S,
        keep_last: int | None = None,
        keep_every_n_steps: int | None = None,
        resume_required: bool = False,
        save: SaveConfig = SaveConfig(),
        verify_on_load: bool = True,
        log_metrics: bool = True,
        log_artifact: bool = True,
        run_config: Any = None,
        identity_policy: IdentityPolicy = IdentityPolicy(),
        dataset_version: str | None = None,
        trust_checkpoint: bool = False,
        drill: DrillConfig = DrillConfig(),
        health: HealthConfig | dict | list | str | None = HealthConfig(),
        tiers: TiersConfig | None = None,
    ) -> None:
        self.tiers_config = tiers_config_from(tiers)  # a fast and a durable tier (policies/tiers/plugin.py)
        self.save_options = save_config_from(save)  # validated now: bad options fail before training starts
        # as given, or with tiers the fast tier's (a node-local one's template): the state key
        self.dirpath = tiered_dirpath(dirpath, self.tiers_config, self.save_options)
        self.root = self.dirpath  # this node's checkpoint root: the plan's, once set up
        self.options = CallbackConfig(
            every_n_train_steps=every_n_train_steps,
            every_n_minutes=every_n_minutes,
            save_on_epoch_end=save_on_epoch_end,
            save_on_fit_end=save_on_fit_end,
            save_on_preemption=save_on_preemption,
            preemption_grace_s=preemption_grace_s,
            keep_last=keep_last,
            keep_every_n_steps=keep_every_n_steps,
            resume_required=resume_required,
        )
        self.verify_on_load, self.trust_checkpoint = verify_on_load, trust_checkpoint
        self.load_options = LoadConfig(verify_checksums=verify_on_load, trust_checkpoint=trust_checkpoint)
        self.log_metrics, self.log_artifact = log_metrics, log_artifact
        self.identity = RunIdentity(run_config, dataset_version, identity_policy)  # validated now
        self.drill_options = drill_config_from(drill)  # restore drills of committed checkpoints
        self.health_config = health_config_from(health)  # health rules; validated now
        self.plugins = checkpoint_plugins(self.options, self.tiers_config, self.drill_options, self.health_config)
        self.schedule, self.run_ids = SaveSchedule(self.options), RunIds(self.save_options.run_id)
        self.plan: CheckpointPlan | None = None
        self._data, self._user = DataPosition(), UserState()  # user: torchmetrics, epoch aggregates, plateau steps
        self._signal = PreemptionSignal(self.options.preemption_grace_s)
        self._resume_logged = False
        self._trainer: pl.Trainer | None = None  # bound in on_fit_start, which Lightning runs before it restores

    @property
    def state_key(self) -> str:
        return f"ShardedCheckpoint{{'dirpath': {self.dirpath!r}}}"

    @property
    def last_saved_step(self) -> int | None:
        return self.schedule.last_saved_step

    @property
    def preempted(self) -> bool:
        """The last fit stopped for SIGTERM / SIGUSR1, after its final blocking save (rank 0 logs whether it committed)."""
        return self._signal.stopped_at is not None

    # --- set-up ---
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = ShardedStrategy.of(trainer)
        save = save_config_from(self.save_options, parallelism=strategy.parallelism)
        placement, required = placement_of(trainer), self.options.resume_required
        self.plan = checkpoint_plan(self.dirpath, save, self.load_options, required, self.plugins, placement)
        self.root = self.plan.root
        strategy.use_plan(self.plan)
        if stage == "fit":
            preflight_on_every_rank(self.plan.location)
        self.plugins.setup(self._context(trainer, stage=stage))
        if stage == "fit" and self.options.save_on_preemption:
            self._signal.install()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._signal.restore()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._signal.take_back()  # Lightning installed its SIGTERM handler just before: ours runs instead

    # --- the loop ---
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._signal.take_back()  # Lightning installed its SIGTERM handler just before: ours runs instead
        strategy, resumed = trainer.strategy, trainer.strategy.last_load
        self.schedule.started(trainer.global_step if resumed is not None else None)
        self._data.started(trainer)
        self.identity.forget()
        resume_event = None
        if resumed is not None:
            self._data.restore_rng()
            self._user.resumed(trainer)
            resume_event = self.identity.check_resume(trainer, pl_module, self.plan.location)  # may raise
        # after the restore, before any save: a resume of this run's checkpoint continues its id
        strategy.adopt_run_id(run_id := self.run_ids.for_fit(resumed, self.plan, self.plugins, strategy.broadcast))
        # the saver is created now: a root another run owns is refused before the first step, not at the first save
        saver = self._saver(trainer)
        self.plugins.start(self._context(trainer, saver=saver, run_id=run_id, resume_event=resume_event))
        if resumed is not None and trainer.is_global_zero and not self._resume_logged:
            self._resume_logged = True
            log_resume(trainer, self.plan.tier_restore)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._data.count_consumed(trainer)
        self._drain(trainer)
        if trainer.global_step >= 1:  # the optimizer state exists now: staging memory before the first save
            trainer.strategy.prepare_staging(self._saver(trainer))
        preempted = self._signal.agreed(trainer, self.options.save_on_preemption, self.plugins, self._context(trainer))
        self.plugins.apply_control(trainer.strategy.existing_saver(self.root), self.save_options.when_busy)
        due = self.schedule.at_batch_end(
            trainer.global_step,
            max_steps=trainer.max_steps,
            preempted=preempted,
            stop_reason=self.plugins.stop_reason(),
            interval_factor=self.plugins.interval_factor(),
            agree=lambda due: bool(trainer.strategy.broadcast(due)),  # rank 0's clock decides for all
        )
        self._save(trainer, due)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, self.schedule.at_epoch_end(trainer.global_step))
        self._user.epoch_ended(trainer)  # after the save: the uninterrupted run's snapshot precedes it too

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # on_train_end, not on_fit_end: Lightning tears the strategy (and its savers) down in between
        self._save(trainer, self.schedule.at_fit_end(trainer.global_step))
        self._saver(trainer).close()  # the run's last checkpoint commits before teardown
        self.plugins.flush()
        self._drain(trainer)
        self.plugins.close(self._context(trainer), finished=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(trainer.strategy, ShardedStrategy) and (saver := trainer.strategy.existing_saver(self.root)):
            saver.close()  # let in-flight saves commit; a half-finished one stays uncommitted
        self.plugins.close(PluginContext(is_global_zero=trainer.is_global_zero), finished=False)
        self._signal.restore()  # Lightning calls no teardown hook after an exception

    # --- own state, carried in every checkpoint ---
    def state_dict(self) -> dict[str, Any]:
        """Called on every rank by Lightning's dump_checkpoint: the RNG gather is a collective."""
        return {
            "dirpath": self.root,
            "last_saved_step": self.schedule.last_saved_step,
            **self._data.state(self._trainer),  # "sampler", "rng"
            **self._user.state(self._trainer),  # "user_state": metrics and epoch aggregates merged over ranks
            **self.plugins.state_dict(),  # "health": rank 0's (the one written) rule counters and mitigations
        }

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        # a fork (saved under another dirpath): Lightning hands over only a state saved under this dirpath
        if (forked := forked_callback_state(checkpoint, self.state_key)) is not None:
            self.load_state_dict(forked)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.schedule.last_saved_step = state_dict.get("last_saved_step")
        self.plugins.load_state_dict(state_dict)
        self._data.load(state_dict, getattr(self._trainer, "strategy", None))
        self._user.load(state_dict, self._trainer)

    # --- internals ---
    def _context(self, trainer: pl.Trainer, **fields: Any) -> PluginContext:
        return plugin_context(trainer, self.plan, **fields)

    def _saver(self, trainer: pl.Trainer, create: bool = True) -> Any:
        """Where saves go now: tiers' degraded mode overrides the root's saver (created unless `create` is False)."""
        strategy, override = trainer.strategy, self.plugins.saver_override()
        return override or (strategy.saver_for(self.root) if create else strategy.existing_saver(self.root))

    def _save(self, trainer: pl.Trainer, due: Due | None) -> None:
        """What the schedule asked for: a save (collectives: every rank at the same step), then maybe a stop."""
        result = None
        if due is not None and due.save:
            self.plugins.before_save(self._context(trainer))  # tiers: degraded mode when the fast tier failed
            previous = self.schedule.saving(trainer.global_step)  # before the dump, so the snapshot records it too
            saver = self._saver(trainer)
            pending = request_save(trainer, saver, self.identity, self.plugins, never_skip=due.never_skip)
            if pending.done() and pending.result().skipped:
                self.schedule.skipped(previous)  # nothing was saved: the fit-end save must still happen
            self.schedule.saved()
            if due.blocking:
                result = pending.result()
                self._drain(trainer)
        if due is not None and due.stop:
            trainer.should_stop = True
            if due.reason == PREEMPTION:
                self._signal.stopping(trainer, result is not None and result.committed, self.root)

    def _drain(self, trainer: pl.Trainer) -> None:
        """Log finished saves, on the training thread (rank 0 logs, all ranks drain); retention runs elsewhere."""
        saver, context = self._saver(trainer, create=False), self._context(trainer)
        log_finished(trainer, saver, self.plugins, context, self.log_metrics, self.log_artifact)
