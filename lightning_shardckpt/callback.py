"""ShardedCheckpoint: when to save, what to keep, what to log, and where to resume from.

Add it to the Trainer's callbacks together with a ShardedStrategy:

    Trainer(strategy=ShardedStrategy(parallelism="fsdp"),
            callbacks=[ShardedCheckpoint(dirpath="s3://bucket/run-7", every_n_train_steps=500, keep_last=3)])
    trainer.fit(model, datamodule, ckpt_path="latest")
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint

from . import fsio, retention
from .checksum import checksum
from .config import CallbackConfig, LoadConfig, save_config_from
from .errors import ConfigError
from .manifest import to_bytes
from .metrics import CheckpointRecord
from .strategy import ShardedStrategy
from .wandb_artifacts import log_checkpoint_artifact

log = logging.getLogger(__name__)


class ShardedCheckpoint(Checkpoint):
    """Asynchronous, committed, verified checkpoints of a Lightning run, resumable on any world size.

    A `Checkpoint` subclass, so Lightning runs it after every other callback: their batch-end updates
    are in the snapshot.
    """

    def __init__(
        self,
        dirpath: str,
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
    ) -> None:
        if not dirpath:
            raise ConfigError("dirpath is empty; set it to a local directory or an fsspec URL such as s3://bucket/run")
        self.dirpath = str(dirpath)
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
        self.verify_on_load = verify_on_load
        self.log_metrics = log_metrics
        self.log_artifact = log_artifact
        self.run_config = run_config
        self.last_saved_step: int | None = None
        self._last_save_time = time.monotonic()
        self._preempted = False
        self._previous_sigusr1: Any = None
        self._resume_logged = False

    @property
    def state_key(self) -> str:
        return f"ShardedCheckpoint{{'dirpath': {self.dirpath!r}}}"

    # --- set-up ---
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, ShardedStrategy):
            raise ConfigError(
                f"ShardedCheckpoint needs a ShardedStrategy, the Trainer has {type(strategy).__name__}; "
                "use Trainer(strategy=ShardedStrategy(parallelism='ddp' or 'fsdp')) or strategy='shardckpt_ddp'"
            )
        strategy.save_config = save_config_from(self.save_options, parallelism=strategy.parallelism)
        strategy.load_config = LoadConfig(verify_checksums=self.verify_on_load, storage_options=self.save_options.storage_options)
        strategy.checkpoint_root = self.dirpath
        strategy.resume_required = self.options.resume_required
        self._location = fsio.resolve(self.dirpath, self.save_options.storage_options)
        if stage == "fit" and self.options.save_on_preemption:
            self._install_signal_handler()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._previous_sigusr1 is not None:
            signal.signal(signal.SIGUSR1, self._previous_sigusr1)
            self._previous_sigusr1 = None

    # --- when to save ---
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_save_time = time.monotonic()
        self.last_saved_step = trainer.global_step if trainer.strategy.last_load is not None else self.last_saved_step
        self._log_resume(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._drain(trainer)
        if self._preemption_requested(trainer):
            log.warning("preemption signal: saving step %d before stopping", trainer.global_step)
            self._save(trainer, blocking=True)
            trainer.should_stop = True
            return
        step = trainer.global_step
        due_by_steps = bool(self.options.every_n_train_steps) and step % self.options.every_n_train_steps == 0
        if step > 0 and step != self.last_saved_step and (due_by_steps or self._due_by_time(trainer)):
            self._save(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.options.save_on_epoch_end and trainer.global_step != self.last_saved_step:
            self._save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # on_train_end, not on_fit_end: Lightning tears the strategy (and its savers) down in between
        if self.options.save_on_fit_end and trainer.global_step != self.last_saved_step and trainer.global_step > 0:
            self._save(trainer)
        self._saver(trainer).close()  # the run's last checkpoint commits before teardown
        self._drain(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        saver = trainer.strategy._savers.get(self.dirpath) if isinstance(trainer.strategy, ShardedStrategy) else None
        if saver is not None:
            saver.close()  # let in-flight saves commit; a half-finished one stays uncommitted

    # --- own state, carried in every checkpoint ---
    def state_dict(self) -> dict[str, Any]:
        return {"dirpath": self.dirpath, "last_saved_step": self.last_saved_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_saved_step = state_dict.get("last_saved_step")

    # --- internals ---
    def _saver(self, trainer: pl.Trainer):
        return trainer.strategy.saver(self.dirpath)

    def _save(self, trainer: pl.Trainer, blocking: bool = False) -> None:
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        self.last_saved_step = trainer.global_step  # recorded before the snapshot is staged, so it is in it too
        checkpoint["callbacks"][self.state_key] = self.state_dict()
        identity = {"config": {"resolved": self.run_config}} if self.run_config is not None else None
        pending = trainer.strategy.save_to_saver(self._saver(trainer), checkpoint, identity=identity)
        self._last_save_time = time.monotonic()
        if blocking:
            pending.result()
            self._drain(trainer)

    def _due_by_time(self, trainer: pl.Trainer) -> bool:
        if not self.options.every_n_minutes:
            return False
        due = time.monotonic() - self._last_save_time >= self.options.every_n_minutes * 60
        return bool(trainer.strategy.broadcast(due))  # rank 0's clock decides for all

    def _preemption_requested(self, trainer: pl.Trainer) -> bool:
        if not self.options.save_on_preemption:
            return False
        local = self._preempted or bool(getattr(trainer, "received_sigterm", False))
        return bool(trainer.strategy.reduce_boolean_decision(local, all=False))

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
        """Log finished saves and apply retention, on the training thread (rank 0 acts, all ranks drain)."""
        saver = trainer.strategy._savers.get(self.dirpath)
        if saver is None:
            return
        records = saver.poll_records()
        if not records or not trainer.is_global_zero:
            return
        counters = saver.counters.snapshot()
        for record in records:
            self._log_record(trainer, record, counters)
            if record.outcome == "committed" and self.options.keep_last is not None:
                retention.apply(self._location, self.options.keep_last, self.options.keep_every_n_steps)

    def _log_record(self, trainer: pl.Trainer, record: CheckpointRecord, counters: dict[str, int]) -> None:
        if record.outcome == "failed":
            log.error("checkpoint of step %d failed: %s", record.step, record.cause)
        if self.log_metrics:
            metrics = record.metrics()
            metrics.update({f"checkpoint/{name}": float(value) for name, value in counters.items()})
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        if self.log_artifact and record.outcome == "committed":
            manifest = record.manifest
            digest = checksum(to_bytes(manifest)) if manifest else None
            log_checkpoint_artifact(trainer.loggers, record, digest)

    def _log_resume(self, trainer: pl.Trainer) -> None:
        loaded = trainer.strategy.last_load
        if loaded is None or self._resume_logged or not trainer.is_global_zero:
            return
        self._resume_logged = True
        log.info("resumed from %s (step %d) in %.2fs", loaded.path, loaded.step, loaded.seconds)
        for logger in trainer.loggers:
            logger.log_metrics({"checkpoint/resume_s": loaded.seconds, "checkpoint/resumed_step": float(loaded.step)}, step=trainer.global_step)
            logger.log_hyperparams({"shardckpt/resumed_from": loaded.path})
