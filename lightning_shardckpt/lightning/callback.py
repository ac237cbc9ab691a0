"""ShardedCheckpoint: when to save, what to keep, what to log, and where to resume from.

Add it to the Trainer's callbacks together with a ShardedStrategy:

    Trainer(strategy=ShardedStrategy(parallelism="fsdp"),
            callbacks=[ShardedCheckpoint(dirpath="s3://bucket/run-7", every_n_train_steps=500, keep_last=3)])
    trainer.fit(model, datamodule, ckpt_path="latest")
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
import weakref
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint

from ..engine import metrics, ownership
from ..engine.collectives import all_gather_objects, rank_and_world
from ..engine.config import LoadConfig, save_config_from
from ..engine.format.outcomes import METRICS_EXTRA, encode_metrics
from ..engine.metrics import CheckpointRecord
from ..engine.storage import fsio
from ..engine.tiers.config import tiers_config_from
from ..errors import ConfigError, StorageUnavailable
from ..policies import retention
from ..policies.health_rules import health_config_from
from ..policies.tiers import CheckpointTiers
from ..training.data import gather_rng_states, restore_rng_state, rng_state_for_rank
from .callback_config import CallbackConfig
from .checkpoint_logging import log_record, log_resume
from .drills import TrainingDrills, drill_config_from
from .health import HealthWatch
from .run_identity import RunIdentity
from .sampler_injection import train_sampler
from .strategy import ShardedStrategy

log = logging.getLogger(__name__)


class ShardedCheckpoint(Checkpoint):
    """Asynchronous, committed, verified checkpoints of a Lightning run, resumable on any world size.

    A `Checkpoint` subclass, so Lightning runs it after every other callback: their batch-end updates
    are in the snapshot.
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
        keep_last: int | None = None,
        keep_every_n_steps: int | None = None,
        resume_required: bool = False,
        save: Any = None,
        verify_on_load: bool = True,
        log_metrics: bool = True,
        log_artifact: bool = True,
        run_config: Any = None,
        identity_policy: Any = None,
        dataset_version: str | None = None,
        trust_checkpoint: bool = False,
        drill: Any = None,
        health: Any = None,
        tiers: Any = None,
    ) -> None:
        # a fast tier + a durable tier (policies/tiers.py): dirpath is then the fast tier's (validated now)
        self.tiers_config = tiers_config_from(tiers)
        self._tiers: CheckpointTiers | None = None
        if self.tiers_config is not None:
            if dirpath and dirpath != self.tiers_config.fast.dirpath:
                raise ConfigError(
                    f"dirpath={dirpath!r} and tiers.fast.dirpath={self.tiers_config.fast.dirpath!r} differ; "
                    "with tiers, leave dirpath unset (the fast tier is where saves commit)"
                )
            dirpath = self.tiers_config.fast.dirpath
        if not dirpath:
            raise ConfigError("dirpath is empty; set it to a local directory or an fsspec URL such as s3://bucket/run")
        self.dirpath = str(dirpath)
        self._state_dirpath = self.dirpath  # with a node-local fast tier, the template: one state key on every node
        self.options = CallbackConfig(
            every_n_train_steps=every_n_train_steps,
            every_n_minutes=every_n_minutes,
            save_on_epoch_end=save_on_epoch_end,
            save_on_fit_end=save_on_fit_end,
            save_on_preemption=save_on_preemption,
            keep_last=keep_last,
            keep_every_n_steps=keep_every_n_steps,
            resume_required=resume_required,
        )
        self.save_options = save_config_from(save)  # validated now: bad options fail before training starts
        if self.tiers_config is not None and self.save_options.incremental:
            raise ConfigError(
                "save.incremental with tiers is not supported yet: the replicator copies a checkpoint's own "
                "files, not the earlier ones an incremental checkpoint references; use one or the other"
            )
        self.verify_on_load = verify_on_load
        # False: a resume unpickles only allow-listed classes and refuses others by name; True runs whatever
        # the checkpoint's pickles name, so only for checkpoints from a source you trust
        self.trust_checkpoint = trust_checkpoint
        self.log_metrics = log_metrics
        self.log_artifact = log_artifact
        self.identity = RunIdentity(run_config, dataset_version, identity_policy)  # validated now
        self.drill_options = drill_config_from(drill)  # restore drills of committed checkpoints (lightning/drills.py)
        self._drills: TrainingDrills | None = None
        self.health_config = health_config_from(health)  # health rules (lightning/health.py); validated now
        self._health: HealthWatch | None = None
        self._loaded_health_state: dict[str, Any] | None = None
        self._stopped_by_health = False
        self.last_saved_step: int | None = None
        self._pending_batches = 0  # trained on, not yet applied by an optimizer step
        self._step_at_last_batch = 0
        self._loaded_data_state: dict[str, Any] | None = None
        self._last_save_time = time.monotonic()
        self._preempted = False
        self._previous_sigusr1: Any = None
        self._resume_logged = False
        self._staging_prepared = False
        self._run_id: str | None = None  # this run's id, kept across fits of one callback (see _adopt_run_id)
        self._retention_savers: weakref.WeakSet = (
            weakref.WeakSet()
        )  # savers whose commits run retention (see _attach_retention)
        self._resume_event: dict[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return f"ShardedCheckpoint{{'dirpath': {self._state_dirpath!r}}}"

    # --- set-up ---
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, ShardedStrategy):
            raise ConfigError(
                f"ShardedCheckpoint needs a ShardedStrategy, the Trainer has {type(strategy).__name__}; "
                "use Trainer(strategy=ShardedStrategy(parallelism='ddp' or 'fsdp')) or strategy='shardckpt_ddp'"
            )
        if self.tiers_config is not None:
            self._setup_tiers(trainer)
        strategy.save_config = save_config_from(self.save_options, parallelism=strategy.parallelism)
        strategy.load_config = LoadConfig(
            verify_checksums=self.verify_on_load,
            storage_options=self.save_options.storage_options,
            trust_checkpoint=self.trust_checkpoint,
        )
        strategy.checkpoint_root = self.dirpath
        strategy.resume_required = self.options.resume_required
        self._location = fsio.resolve(self.dirpath, self.save_options.storage_options)
        strategy.fallback_to_last_good = self.drill_options.fallback_to_last_good
        if self._drills is None:
            self._drills = TrainingDrills(self.drill_options, self._location, self.save_options.storage_options)
        if self._health is None:
            self._health = HealthWatch(self.health_config, self._location)
            self._drills.listeners.append(self._health.on_event)
        if stage == "fit":
            self._preflight()
            if self._tiers is not None:
                self._tiers.preflight()
            if self.options.save_on_preemption:
                self._install_signal_handler()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._previous_sigusr1 is not None:
            signal.signal(signal.SIGUSR1, self._previous_sigusr1)
            self._previous_sigusr1 = None

    # --- when to save ---
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_save_time = time.monotonic()
        self._step_at_last_batch = trainer.global_step
        self.identity.forget()
        if trainer.strategy.last_load is not None:
            self.last_saved_step = trainer.global_step
            self._restore_rng_state(trainer)
            self._check_identity(trainer, pl_module)
        self._adopt_run_id(trainer)
        saver = self._saver(
            trainer
        )  # created now: a root another run owns is refused before the first step, not at the first save
        if self._tiers is not None:
            self._tiers.start(
                saver,
                self._run_id,
                self.save_options.allow_shared_root,
                trainer.is_global_zero,
                fault_hook=trainer.strategy.fault_hook,
            )
        self._attach_retention(trainer)
        self._start_health(trainer)
        if trainer.strategy.last_load is not None and trainer.is_global_zero and not self._resume_logged:
            self._resume_logged = True
            log_resume(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._count_consumed(trainer)
        self._drain(trainer)
        if not self._staging_prepared and trainer.global_step >= 1:
            # the optimizer state exists now: allocate staging memory in the background, before the first save
            self._staging_prepared = True
            self._saver(trainer).prepare(trainer.strategy.state_layout())
        if self._preemption_requested(trainer):
            log.warning("preemption signal: saving step %d before stopping", trainer.global_step)
            self._save(trainer, blocking=True)
            trainer.should_stop = True
            return
        if self._health_stop(trainer):
            return
        step = trainer.global_step
        every = self.options.every_n_train_steps
        if every and self._health is not None:
            every = max(1, round(every * self._health.interval_factor))  # lower_frequency while a rule fires
        due_by_steps = bool(every) and step % every == 0
        # the fit-end save of a max_steps stop happens here, at the last batch: by on_train_end Lightning
        # has marked the epoch finished, and a resume would skip the rest of it
        last_step = self.options.save_on_fit_end and trainer.max_steps not in (None, -1) and step >= trainer.max_steps
        if step > 0 and step != self.last_saved_step and (due_by_steps or last_step or self._due_by_time(trainer)):
            self._save(trainer, never_skip=last_step)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.options.save_on_epoch_end and trainer.global_step != self.last_saved_step:
            self._save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # on_train_end, not on_fit_end: Lightning tears the strategy (and its savers) down in between
        if self.options.save_on_fit_end and trainer.global_step != self.last_saved_step and trainer.global_step > 0:
            self._save(trainer, never_skip=True)  # the run's last state: waits for a slot even under when_busy=skip
        self._saver(trainer).close()  # the run's last checkpoint commits before teardown
        if self._tiers is not None:
            self._tiers.close()  # bounded flush (tiers.flush_timeout_s) of copies to the durable tier
        self._drain(trainer)
        if self._drills is not None and trainer.is_global_zero:
            # training is over: let the requested drills finish, so the final checkpoint's verdict is known
            self._drills.close(self.drill_options.timeout_s, finish_queued=True)
            self._drills.log(trainer)
            if self._health is not None:
                self._health.drain(trainer, request_drill=None)  # the final verdicts' alerts; no new drills now

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        saver = trainer.strategy._savers.get(self.dirpath) if isinstance(trainer.strategy, ShardedStrategy) else None
        if saver is not None:
            saver.close()  # let in-flight saves commit; a half-finished one stays uncommitted
        if self._tiers is not None:
            self._tiers.close()
        if self._drills is not None:
            self._drills.close(self.drill_options.timeout_s, finish_queued=False)

    # --- own state, carried in every checkpoint ---
    def state_dict(self) -> dict[str, Any]:
        """Called on every rank by Lightning's dump_checkpoint: the RNG gather is a collective."""
        sampler, _ = train_sampler(self._trainer) if self._trainer is not None else (None, None)
        return {
            "dirpath": self.dirpath,
            "last_saved_step": self.last_saved_step,
            "sampler": sampler.state_dict() if sampler is not None else None,
            "rng": gather_rng_states(),  # every rank's generators, so a resized run can apply the rule in data.py
            # rule counters, learned baselines, mitigations in force: rank 0's (the one written) evaluates
            "health": self._health.state_dict() if self._health is not None and self._health.enabled else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_saved_step = state_dict.get("last_saved_step")
        self._loaded_data_state = {"rng": state_dict.get("rng")}
        if self._health is not None:
            self._health.load_state_dict(state_dict.get("health"))
        trainer = self._trainer  # bound in on_fit_start, which Lightning runs before it restores
        if trainer is not None and isinstance(trainer.strategy, ShardedStrategy):
            # the strategy applies it as the training loader is built, before Lightning sizes the epoch
            trainer.strategy.resumed_sampler_state = state_dict.get("sampler")

    # --- internals ---
    def _adopt_run_id(self, trainer: pl.Trainer) -> None:
        """Give the strategy's save config this run's id, before its saver for our root exists.

        Resumed from a checkpoint in this root: that checkpoint's run id (a resumed run is the same run,
        so the root's owner check passes). Resumed from another root (a warm start, a fine-tune): a new
        run, with a new id. `save.run_id` set by the user wins over both. Runs after the restore
        (Lightning restores between on_fit_start and on_train_start) and before any save.
        """
        strategy = trainer.strategy
        loaded = strategy.last_load
        resumed_id = (loaded.manifest.get("run_id") if loaded is not None else None) or None
        if self.save_options.run_id:
            self._run_id = self.save_options.run_id
        elif resumed_id and self._in_our_root(loaded.path):
            self._run_id = resumed_id
        elif self._run_id is None:
            self._run_id = strategy.broadcast(ownership.new_run_id())  # rank 0's: one id for the whole run
        strategy.save_config = save_config_from(strategy.save_config, run_id=self._run_id)

    def _in_our_root(self, checkpoint_path: str) -> bool:
        root = fsio.resolve(checkpoint_path.rstrip("/").rsplit("/", 1)[0], self.save_options.storage_options)
        ours = root.same_place(self._location)
        return ours or (self._tiers is not None and self._tiers.owns(checkpoint_path))

    def _saver(self, trainer: pl.Trainer):
        if self._tiers is not None and self._tiers.degraded_saver is not None:
            return self._tiers.degraded_saver  # degraded mode: the fast tier failed, saves go to the durable tier
        return trainer.strategy.saver(self.dirpath)

    def _save(self, trainer: pl.Trainer, blocking: bool = False, never_skip: bool = False) -> None:
        if self._tiers is not None:
            self._tiers.before_save(trainer.strategy)  # collective: degraded mode when the fast tier failed
        previous, self.last_saved_step = (
            self.last_saved_step,
            trainer.global_step,
        )  # before the dump, so the snapshot records it too
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        sampler, _ = train_sampler(trainer)
        samples = sampler.epoch * sampler.dataset_length + sampler.global_position if sampler is not None else None
        current = self.identity.current(trainer, trainer.lightning_module) if trainer.is_global_zero else None
        extra = self._drills.probe_extra(trainer.lightning_module) if self._drills is not None else None  # every rank
        # the outcome next to the identity: what the run logged by the time it saved (floats only)
        extra = {**(extra or {}), METRICS_EXTRA: encode_metrics(trainer.callback_metrics)}
        pending = trainer.strategy.save_to_saver(
            self._saver(trainer),
            checkpoint,
            identity=current,
            samples_consumed=samples,
            extra=extra,
            never_skip=never_skip or blocking,
        )
        if pending.done() and pending.result().skipped:
            self.last_saved_step = previous  # nothing was saved: the fit-end save must still happen
        self._last_save_time = time.monotonic()
        if blocking:
            pending.result()
            self._drain(trainer)

    def _preflight(self) -> None:
        """Every rank writes its own shards: each checks the root, and all raise the first problem."""
        try:
            fsio.preflight(self._location)
            problem = None
        except StorageUnavailable as err:
            problem = str(err)
        problems = all_gather_objects("storage-preflight", problem, None)  # no rank may go on alone
        first = next((p for p in problems if p), None)
        if first is not None:
            raise StorageUnavailable(first)

    # --- data position and identity ---
    @property
    def _trainer(self) -> pl.Trainer | None:
        return getattr(self, "_bound_trainer", None)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._bound_trainer = trainer

    def _count_consumed(self, trainer: pl.Trainer) -> None:
        """Batches count as consumed once an optimizer step applied them (gradient accumulation aware)."""
        self._pending_batches += 1
        if trainer.global_step == self._step_at_last_batch:
            return
        self._step_at_last_batch = trainer.global_step
        sampler, batch_size = train_sampler(trainer)
        if sampler is not None and batch_size:
            sampler.mark_consumed(self._pending_batches, batch_size)
        self._pending_batches = 0

    def _restore_rng_state(self, trainer: pl.Trainer) -> None:
        state = self._loaded_data_state or {}
        self._loaded_data_state = None
        rank = rank_and_world()[0]
        if state.get("rng"):
            restore_rng_state(rng_state_for_rank(state["rng"], rank))
        # the sampler's position was restored earlier, as Lightning built the training loader
        # (ShardedStrategy.process_dataloader), so the epoch is sized and counted as an uninterrupted one

    def _check_identity(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before the first step of a resumed run (raises under policy `error`); rank 0 records the resume event."""
        event = self.identity.check_resume(trainer, pl_module)
        if event is not None:
            metrics.write_json_event(self._location, f"resume-step-{event['step']:09d}", event)
            self._resume_event = event  # evaluated by the health rules once they start (on_train_start)

    def _due_by_time(self, trainer: pl.Trainer) -> bool:
        if not self.options.every_n_minutes:
            return False
        factor = self._health.interval_factor if self._health is not None else 1.0
        due = time.monotonic() - self._last_save_time >= self.options.every_n_minutes * 60 * factor
        return bool(trainer.strategy.broadcast(due))  # rank 0's clock decides for all

    def _preemption_requested(self, trainer: pl.Trainer) -> bool:
        """Any rank's preemption signal; with health rules the same collective carries rank 0's control state."""
        local = self.options.save_on_preemption and (
            self._preempted or bool(getattr(trainer, "received_sigterm", False))
        )
        if self._health is not None and self._health.enabled:
            preempted = self._health.sync(trainer, local)
            self._health.apply_when_busy(trainer.strategy._savers.get(self.dirpath), self.save_options.when_busy)
            return preempted
        if not self.options.save_on_preemption:
            return False
        return bool(trainer.strategy.reduce_boolean_decision(local, all=False))

    # --- health rules (lightning/health.py) ---
    def _start_health(self, trainer: pl.Trainer) -> None:
        if self._health is not None and self._health.enabled:
            self._health.run_id = self._drills.run_id = self._run_id
            self._health.forget_ranks(trainer.world_size)
            resumed, self._resume_event = self._resume_event, None
            if trainer.is_global_zero:
                self._health.watch(self._saver(trainer), resumed)
                if (
                    self._tiers is not None and self._tiers.replicator is not None
                ):  # replication_ok, replication_lag_checkpoints
                    self._tiers.replicator.listeners.append(self._health.on_event)

    def _health_stop(self, trainer: pl.Trainer) -> bool:
        """A `stop_training` mitigation in force: one final blocking save, then a clean stop that says why."""
        if self._health is None or not self._health.stop_requested or self._stopped_by_health:
            return False
        self._stopped_by_health = True
        log.error("stopping training at step %d: %s", trainer.global_step, self._health.stop_reason)
        if trainer.global_step != self.last_saved_step:
            self._save(trainer, blocking=True)
        trainer.should_stop = True
        return True

    def _install_signal_handler(self) -> None:
        def on_signal(signum: int, frame: Any) -> None:
            self._preempted = True
            if callable(self._previous_sigusr1):
                self._previous_sigusr1(signum, frame)

        try:
            self._previous_sigusr1 = signal.signal(signal.SIGUSR1, on_signal)
        except ValueError:  # not the main thread: the trainer's SIGTERM flag still works
            self._previous_sigusr1 = None

    def _drain(self, trainer: pl.Trainer) -> None:
        """Log finished saves, on the training thread (rank 0 logs, all ranks drain); retention runs elsewhere."""
        saver = trainer.strategy._savers.get(self.dirpath)
        if self._tiers is not None and self._tiers.degraded_saver is not None:
            saver = self._tiers.degraded_saver
        if saver is None:
            return
        records = saver.poll_records()
        if not trainer.is_global_zero:
            return
        if self._drills is not None:
            self._drills.log(trainer)  # drills that finished since the last batch
        if self._health is not None and self._drills is not None:
            self._health.drain(trainer, self._drills.request_now)  # alerts, health/<rule>/firing, drill_now
        if not records:
            return
        counters = {
            **saver.counters.snapshot(),
            **saver.counters.notes(),
        }  # notes: failed_dirs_removed, retention_errors, ...
        if self._tiers is not None:
            counters.update(self._tiers.counters())  # replicated, replication_failed, replication_lag_checkpoints, ...
        for record in records:
            log_record(trainer, record, counters, log_metrics=self.log_metrics, log_artifact=self.log_artifact)
            if record.outcome == metrics.COMMITTED and self._drills is not None:
                self._drills.on_committed(record.path)  # a queue put: the drill runs on its own thread and processes

    def _attach_retention(self, trainer: pl.Trainer) -> None:
        """Run retention after each commit on the saver's background thread (rank 0), once per saver.

        Not on the training thread: a listing and deletes cost storage round trips (seconds on S3), and
        an error there (a manifest another writer just deleted, a transient listing error) must never
        reach `on_train_batch_end` and fail `fit`.
        """
        saver = self._saver(trainer)
        if self._keep_last() is None or not trainer.is_global_zero or saver in self._retention_savers:
            return
        self._retention_savers.add(saver)
        saver.add_listener(lambda record: self._apply_retention(saver, record))

    def _apply_retention(self, saver: Any, record: CheckpointRecord) -> None:
        """After a commit: delete what fell out of the window. Errors are logged and counted, never raised."""
        if record.outcome != metrics.COMMITTED:
            return
        just_committed = record.path.rstrip("/").rsplit("/", 1)[-1] if record.path else None
        try:
            spare = set(self._drills.pending()) if self._drills is not None else set()
            if (
                self._tiers is not None
            ):  # checkpoints not yet on the durable tier (bounded: tiers.fast.max_unreplicated)
                spare |= self._tiers.fast_spare(self._keep_last(), self._run_id)
            retention.apply(
                self._location,
                self._keep_last(),
                self.options.keep_every_n_steps,
                run_id=self._run_id,
                just_committed=just_committed,
                keep_last_drilled=self.drill_options.keep_last_drilled,
                spare=frozenset(spare),
            )
        except Exception:  # the next commit's pass deletes what this one could not
            saver.counters.note(metrics.RETENTION_ERRORS)
            log.warning(
                "retention after the checkpoint of step %d failed; the next commit retries it",
                record.step,
                exc_info=True,
            )

    def _keep_last(self) -> int | None:
        tier_keep = self.tiers_config.fast.keep_last if self.tiers_config is not None else None
        return tier_keep if tier_keep is not None else self.options.keep_last

    def _setup_tiers(self, trainer: pl.Trainer) -> None:
        """This node's fast root becomes the callback's root; the strategy's resume considers both tiers."""
        if self._tiers is None:
            self._tiers = CheckpointTiers(self.tiers_config, trainer.node_rank, trainer.local_rank)
        self.dirpath = self._tiers.fast_dirpath
        fast = self.tiers_config.fast
        self.save_options = save_config_from(
            self.save_options,
            node_local=fast.node_local,
            **({"storage_options": fast.storage_options} if fast.storage_options else {}),
        )
        trainer.strategy.tier_restore = self._tiers
        if fast.node_local and trainer.num_nodes > 1 and self.drill_options.every_n_checkpoints:
            # a drill restores from the coordinator's node, whose fast directory holds only its own ranks' shards
            log.warning(
                "restore drills are off: the fast tier %s is node-local on %d nodes, so no node holds a whole "
                "checkpoint; drill the durable tier with `shardckpt drill %s`",
                fast.dirpath,
                trainer.num_nodes,
                self.tiers_config.durable.dirpath if self.tiers_config.durable else "<durable root>",
            )
            self.drill_options = dataclasses.replace(self.drill_options, every_n_checkpoints=None)
