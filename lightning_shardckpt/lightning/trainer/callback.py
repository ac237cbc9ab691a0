"""ShardedCheckpoint: the Lightning face of the save loop, the checkpoint plan and the plug-ins.

Add it to the Trainer's callbacks together with a ShardedStrategy:

    Trainer(strategy=ShardedStrategy(parallelism="fsdp"),
            callbacks=[ShardedCheckpoint(dirpath="s3://bucket/run-7", every_n_train_steps=500, keep_last=3)])
    trainer.fit(model, datamodule, ckpt_path="latest")

It translates Lightning's hooks into the door core of training/: the save loop (save_loop.py: schedule,
preemption agreement, plug-ins, drain), run on the strategy's saver host; the plan (policies/plan.py) it hands
the strategy, whose resume is training/resume_sequence.py's (the strategy loads, this callback announces the resume
at train start). What stays here is Lightning's own: the checkpoint dict, identity, data position, the user's
metrics and logged aggregates, loggers and W&B.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint

from ...engine.config import save_config_from
from ...engine.save.saver import CheckpointSaver, PendingSave
from ...policies.plan import CheckpointPlan
from ...policies.tiers.tiers_plugin import tiered_dirpath
from ...training.checkpoint_options import ALL_OPTIONS, CheckpointOptions, DoorKeywords
from ...training.checkpoint_setup import checkpoint_plan, door_plugins, placement_of
from ...training.resume import resume_metrics
from ...training.resume_sequence import announce_resume
from ...training.run_ids import RunIds
from ...training.save_loop import Request, SaveLoop, StepEnd
from ...training.schedule import SaveSchedule
from .checkpoint_logging import log_record, log_resumed_from
from .ckpt_paths import LATEST_REFERENCE, callback_state_key, forked_callback_state
from .data_position import DataPosition
from .merged_user_state import UserState
from .plugin_context import TrainerReporter
from .preemption import PreemptionSignal
from .run_identity import RunIdentity
from .saving import request_save
from .strategy import ShardedStrategy

# every option: the Trainer's door is the one the YAML (conf/checkpoint/) describes
CALLBACK_OPTIONS = DoorKeywords("ShardedCheckpoint", ALL_OPTIONS, defaults={"save_on_preemption": True})


class ShardedCheckpoint(Checkpoint):
    """Asynchronous, committed, verified checkpoints of a Lightning run, resumable on any world size.

    A `Checkpoint` subclass, so Lightning runs it after every other callback: their updates are in the snapshot.

    Being a `Checkpoint`, it is `trainer.checkpoint_callback` (without a `ModelCheckpoint` before it), from which
    Lightning reads `ckpt_path="best"` and its loggers read the checkpoints to upload. It monitors nothing, so it
    has no best by a score: `best_model_path` and `last_model_path` are the reference `"latest"`, the newest
    committed checkpoint of its root, which the strategy resolves at the load (the one reference every door
    reads). Not `"last-good"`: that needs restore drills, which are off by default, and it would make
    `validate(ckpt_path="best")` evaluate older weights than the run has committed; ask for `"last-good"` by
    name. `best_model_score` and `current_score` are None, `best_k_models` is empty.
    """

    @CALLBACK_OPTIONS.derive
    def __init__(
        self,
        dirpath: str | None = None,
        *,
        run_config: Any = None,
        options: CheckpointOptions | None = None,
        **given: Any,
    ) -> None:
        """`dirpath`: the checkpoint root; `run_config`: the run's resolved config, recorded in every manifest;
        `options` (a CheckpointOptions) and the keywords, its fields (training/checkpoint_options.py)."""
        options = self.checkpoint_options = CALLBACK_OPTIONS.build(given, options)  # validated now
        self.save_options = options.save
        self.options = options.schedule()
        self.drill_options = options.drill  # restore drills of committed checkpoints
        self.health_config = options.health  # health rules
        # retention, tiers (a fast and a durable tier), restore drills, health rules
        self.plugins, self.tiers_config = door_plugins(
            self.options, options.tiers, self.drill_options, self.health_config, options.plugins
        )
        # as given, or with tiers the fast tier's (a node-local one's template): the state key
        self.dirpath = tiered_dirpath(dirpath, self.tiers_config)
        self.root = self.dirpath  # this node's checkpoint root: the plan's, once set up
        self.verify_on_load, self.trust_checkpoint = options.verify_on_load, options.trust_checkpoint
        self.load_options = options.load_config()
        self.log_metrics, self.log_artifact = options.log_metrics, options.log_artifact
        self.identity = RunIdentity(run_config, options.dataset_version, options.identity_policy)
        # kept across fits (the loop is rebuilt at each set-up): the last saved step and the run's id
        self.schedule, self.run_ids = SaveSchedule(self.options), RunIds(self.save_options.run_id)
        self.plan: CheckpointPlan | None = None
        self.loop: SaveLoop | None = None
        self._data, self._user = DataPosition(), UserState()  # user: torchmetrics, epoch aggregates, plateau steps
        self._signal = PreemptionSignal(self.options.preemption_grace_s)
        self._trainer: pl.Trainer | None = None  # bound in on_fit_start, which Lightning runs before it restores
        # what Lightning reads from `trainer.checkpoint_callback` (ckpt_path="best", loggers): see the docstring;
        # attributes, not properties, as Lightning's spawn launcher writes `best_model_path` back
        self.best_model_path = self.last_model_path = LATEST_REFERENCE
        self.best_model_score: Any = None
        self.current_score: Any = None
        self.best_k_models: dict[str, Any] = {}

    @property
    def state_key(self) -> str:
        return callback_state_key(self.dirpath)

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
        self.loop = SaveLoop(
            plan=self.plan,
            plugins=self.plugins,
            options=self.options,
            host=strategy.host,
            reporter=TrainerReporter(trainer),
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            log_record=lambda record, counters: log_record(
                trainer, record, counters, log_metrics=self.log_metrics, log_artifact=self.log_artifact
            ),
            schedule=self.schedule,
            run_ids=self.run_ids,
        )
        self.loop.setup(stage)
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
        resumed = ShardedStrategy.of(trainer).last_resumed
        self._data.started(trainer)
        self.identity.forget()
        resume_event = None
        if resumed is not None:
            self._data.restore_rng()
            self._user.resumed(trainer)
            identity = self.identity.check_resume(trainer, pl_module, resumed.loaded)  # may raise
            first = not resumed.announced
            resume_event = announce_resume(
                resumed,
                plan=self._set_up.plan,
                loop=self._set_up,
                rank=trainer.global_rank,
                world_size=trainer.world_size,
                identity=identity,
                metrics=resume_metrics,  # the Trainer's loggers get the resume's time and step too
            )
            if first and trainer.is_global_zero:
                log_resumed_from(trainer, resumed.loaded)
        # after the restore, before any save: a resume of this run's checkpoint continues its id, and the root's
        # saver is created now (a root another run owns is refused before the first step, not at the first save)
        # (and before it, saves no reader could load are refused: training/preflight.py)
        self._set_up.start(
            resumed.loaded if resumed is not None else None,
            resume_event=resume_event,
            state=ShardedStrategy.of(trainer).state_at_start,
        )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._data.count_consumed(trainer)
        if trainer.global_step >= 1:  # the optimizer state exists now: staging memory before the first save
            ShardedStrategy.of(trainer).prepare_staging(self._set_up.saver())
        # Lightning's flag counts too: a SIGTERM in the moment before `take_back` reached Lightning's handler
        requested = self._signal.requested or bool(getattr(trainer, "received_sigterm", False))
        outcome = self._set_up.at_step_end(
            trainer.global_step, self._request(trainer), max_steps=trainer.max_steps, preemption_requested=requested
        )
        self._after(trainer, outcome)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._after(trainer, self._set_up.at_epoch_end(trainer.global_step, self._request(trainer)))
        self._user.epoch_ended(trainer)  # after the save: the uninterrupted run's snapshot precedes it too

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # on_train_end, not on_fit_end: Lightning tears the strategy (and its savers) down in between
        self._after(trainer, self._set_up.at_fit_end(trainer.global_step, self._request(trainer)))
        self._set_up.finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            if self.loop is not None:
                self.loop.abort()  # in-flight saves may commit; a half-finished one stays uncommitted
        finally:
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

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # a fork (saved under another dirpath): Lightning hands over only a state saved under this dirpath
        if (forked := forked_callback_state(checkpoint, self.state_key)) is not None:
            self.load_state_dict(forked)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.schedule.last_saved_step = state_dict.get("last_saved_step")
        self.plugins.load_state_dict(state_dict)
        self._data.load(state_dict, getattr(self._trainer, "strategy", None))
        self._user.load(state_dict, self._trainer)

    # --- internals ---
    @property
    def _set_up(self) -> SaveLoop:
        """The save loop `setup` built: Lightning calls setup before any hook of the loop."""
        if self.loop is None:
            raise RuntimeError(
                f"{type(self).__name__}.setup has not run: Lightning calls it at the start of trainer.fit; "
                "pass the callback to Trainer(callbacks=[...]) rather than calling its hooks yourself"
            )
        return self.loop

    def _request(self, trainer: pl.Trainer) -> Request:
        """A save of this step: Lightning's snapshot and what goes with it (every rank)."""

        def request(saver: CheckpointSaver, never_skip: bool) -> PendingSave:
            return request_save(trainer, saver, self.identity, self.plugins, never_skip=never_skip)

        return request

    def _after(self, trainer: pl.Trainer, outcome: StepEnd) -> None:
        if outcome.preempted:
            self._signal.stopped_at = trainer.global_step
        if outcome.stop:
            trainer.should_stop = True
