"""Checkpointer: asynchronous, committed, verified checkpoints of a plain PyTorch loop (no Lightning).

    ckpt = Checkpointer("s3://bucket/run-7", every_n_steps=500, keep_last=3, sampler=sampler)
    state = {"model": model, "optim": optimizer}
    start = ckpt.load(state) or 0                      # resumes the run (any world size), or None: fresh
    for step in range(start + 1, max_steps + 1):
        ...; optimizer.step(); sampler.mark_consumed(1, batch_size)
        ckpt.maybe_save(step, state)                   # when the schedule says so; commits in the background
    ckpt.close()                                       # waits for the last commit

The same door core as the Trainer's and Fabric's: the save loop (training/save_loop.py: schedule, plug-ins for
retention, tiers, drills and health, run ids), the saver host (training/savers.py) and the one resume
(training/resume.py). It owns the sampler's position and every rank's RNG (training/data.py), and, opt-in, the
preemption signals (training/preemption.py). How the user's objects become DCP state: training/checkpointer_state.py;
checkpoints of the other doors: training/door_targets.py. Docs: docs/howto/plain-pytorch.md.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from typing import Any

from ..engine.collectives import rank_and_world
from ..engine.config import CHECKPOINTER
from ..engine.format import safe_pickle
from ..engine.load.loader import LoadResult
from ..engine.save.saver import CheckpointSaver, PendingSave
from ..engine.validate import require_bool, require_type
from . import checkpointer_state
from .checkpoint_options import CheckpointOptions, DoorKeywords
from .checkpoint_setup import door_plan, placement_from_env
from .data import (
    ResumableDistributedSampler,
    gather_rng_states,
    restore_rng_state,
    rng_state_for_rank,
    samples_consumed,
)
from .door_targets import Layout
from .finished_saves import CallableReporter
from .loadable import SaveChecks
from .preemption import PreemptionRequests
from .resume_sequence import announce_resume, load_resumed
from .save_loop import SaveLoop
from .savers import ControlGroup, SaverHost

log = logging.getLogger(__name__)

# a plain loop has no epochs, no fit end (`max_steps` says which step is last) and no Trainer loggers
CHECKPOINTER_OPTIONS = DoorKeywords(
    "Checkpointer",
    (
        "every_n_train_steps",
        "every_n_minutes",
        "keep_last",
        "keep_every_n_steps",
        "save",
        "resume_required",
        "verify_on_load",
        "trust_checkpoint",
        "require_signature",
        "public_keys",
        "revoked_keys",
        "save_on_preemption",
        "preemption_grace_s",
        "drill",
        "health",
        "tiers",
        "plugins",
    ),
    spellings={"every_n_steps": "every_n_train_steps"},
    defaults={"save_on_preemption": False},  # opt-in: a plain loop's own signal handlers stay its own
    why_not="a plain loop has no epochs, no fit end (max_steps= names the last step) and no Trainer loggers",
)


class Checkpointer:
    """Checkpoints of a plain training loop. Construct it on every rank at the same point (collectives)."""

    @CHECKPOINTER_OPTIONS.derive
    def __init__(
        self,
        root: str | None = None,
        *,
        max_steps: int | None = None,
        sampler: ResumableDistributedSampler | None = None,
        restore_rng: bool = True,
        log_metrics: Callable[[dict[str, float], int], Any] | None = None,
        options: CheckpointOptions | None = None,
        **given: Any,
    ) -> None:
        """`max_steps`: the last step saves (never skipped). `log_metrics(values, step)`: rank 0's checkpoint
        metrics (e.g. `wandb.log`); they are also under ROOT/events/ (`read_events`). `options` (a
        CheckpointOptions) and the keywords: its fields a plain loop has (training/checkpoint_options.py;
        `every_n_steps` is its every_n_train_steps); `plugins`: your own, after retention, tiers, drills and health."""
        options = self.checkpoint_options = CHECKPOINTER_OPTIONS.build(given, options)  # validated now
        # the door's own flags, outside the option dataclasses (which check theirs): a string "false" is truthy
        require_type("Checkpointer.max_steps", max_steps, int | None)
        self.options = options.schedule(save_on_epoch_end=False, save_on_fit_end=max_steps is not None)
        self.max_steps, self.sampler = max_steps, sampler
        self.restore_rng = require_bool("Checkpointer.restore_rng", restore_rng)
        plugins, plan = door_plan(
            root,
            self.options,
            options.save,
            options.load_config(),
            tiers=options.tiers,
            drill=options.drill,
            health=options.health,
            placement=placement_from_env(),
            front_door=CHECKPOINTER,
            extra=options.plugins,
        )
        self.plan, self.plugins = plan, plugins
        self.rank, self.world_size = rank_and_world()
        self._control = ControlGroup(plan.save.collective_timeout_s)  # the training thread's agreements
        self.host = SaverHost(plan.save, self._control)
        self.loop = SaveLoop(
            plan=plan,
            plugins=plugins,
            options=self.options,
            host=self.host,
            reporter=CallableReporter(log_metrics, lambda: self.step),
            rank=self.rank,
            world_size=self.world_size,
        )
        self.step = 0  # the last step the loop reported (metrics are logged at it)
        self.last_load: LoadResult | None = None
        self.not_restored: tuple[str, ...] = ()  # after a load: what the checkpoint did not give back
        self._resume_event: dict[str, Any] | None = None  # rank 0, after a load: handed to the plug-ins at start
        self.should_stop = False  # a preemption save or a health rule's stop: leave the loop
        self._closed = False
        self._save_checks = SaveChecks(
            trust_option="Checkpointer(..., trust_checkpoint=True)",
            pickled_sections={checkpointer_state.RESERVED_KEY: ()},
        )
        self.loop.setup("fit")
        self._signal = PreemptionRequests(self.options.preemption_grace_s)
        if self.options.save_on_preemption:
            self._signal.install()

    @property
    def root(self) -> str:
        """This node's checkpoint root (with tiers: the fast tier's)."""
        return self.plan.root

    @property
    def run_id(self) -> str | None:
        """This run's id once known: the loaded checkpoint's (a resume) or a new one (at the first save)."""
        return self.loop.run_ids.current

    # --- resume ---
    def load(self, state: dict[str, Any], which: str | int = "latest", *, strict: bool = True) -> int | None:
        """Load a committed checkpoint into `state` in place, resharded onto this world size, with the sampler's
        position and the RNG; returns its step, or None when there is nothing to resume from (start fresh).

        `which`: "latest" (this run's root, or the tiers), "last-good", a step, a checkpoint id, or a path. A
        checkpoint of the Trainer or Fabric opens too (training/door_targets.py): the model from its "model", the
        optimizers from "optimizers.<i>"; what it does not give back (its data position, RNG) is logged once and
        listed in `not_restored`. `strict=False`: a state entry the checkpoint lacks keeps its value (listed too)."""
        checkpointer_state.check_state(state)
        target = checkpointer_state.door_target(state, strict=strict)
        resumed = load_resumed(
            self.plan,
            self.host,
            target,
            which,
            strict=strict,
            rank=self.rank,
            lacking=self._not_restored,
            spell=lambda key: f"state[{key!r}]",
        )
        if resumed is None:
            return None
        loaded = resumed.loaded
        own = self._own_section(target.own_section(), loaded.path)
        checkpointer_state.apply_loaded(state, {key[0]: value for key, value in target.restored().items()})
        if self.sampler is not None and own.get("sampler") is not None:
            self.sampler.load_state_dict(own["sampler"])
        if self.restore_rng and own.get("rng"):
            restore_rng_state(rng_state_for_rank(own["rng"], self.rank))
        self.plugins.load_state_dict(own.get("plugins") or {})
        self.not_restored = resumed.not_restored
        self.step, self.last_load = loaded.step, loaded
        self.loop.schedule.started(loaded.step)
        self._resume_event = announce_resume(
            resumed, plan=self.plan, loop=self.loop, rank=self.rank, world_size=self.world_size
        )
        return loaded.step

    # --- saving ---
    def maybe_save(self, step: int, state: dict[str, Any]) -> PendingSave | None:
        """After the optimizer step `step` (every rank, every step): save when the schedule says so. Returns the
        save (its `result()` waits for the commit), or None; sets `should_stop` after a preemption save."""
        self._start(state, step)
        outcome = self.loop.at_step_end(
            step,
            self._request_of(step, state),
            max_steps=self.max_steps,
            preemption_requested=self._signal.requested,
        )
        self.should_stop = self.should_stop or outcome.stop
        return outcome.pending

    def save(self, step: int, state: dict[str, Any], *, blocking: bool = False) -> PendingSave:
        """Save now (every rank, same step), whatever the schedule; `blocking` waits for the commit (so does
        the returned save's `result()`)."""
        self._start(state, step)
        self.loop.drain()
        return self.loop.save_now(step, self._request_of(step, state), blocking=blocking)

    def close(self) -> None:
        """Wait for in-flight saves to commit, finish the plug-ins' work (drills, copies), release everything."""
        if self._closed:
            return
        self._closed = True
        try:
            self.loop.finish()
        finally:
            self._release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if error is None:
            self.close()
            return
        self._closed = True  # training failed: let in-flight saves commit, save nothing more
        try:
            self.loop.abort()
        finally:
            self._release()

    # --- internals ---
    def _start(self, state: dict[str, Any], step: int) -> None:
        """The first save or maybe_save: saves no reader could load are refused (as at `load`, which a loop calls
        before its first step), the run id is settled and the root claimed (a root another run owns is refused
        here, before a checkpoint is written), then the plug-ins start."""
        if self._closed:
            raise RuntimeError("this Checkpointer is closed; create a new one to save again")
        self.step = step
        if not self.loop.started:
            checkpointer_state.check_state(state)
            self.loop.start(
                self.last_load, resume_event=self._resume_event, state=lambda: checkpointer_state.to_dcp(state)
            )

    def _request_of(self, step: int, state: dict[str, Any]) -> Callable[[CheckpointSaver, bool], PendingSave]:
        def request(saver: CheckpointSaver, never_skip: bool) -> PendingSave:
            """Every rank: the user's state and the Checkpointer's own section, handed to the saver."""
            own = {
                "sampler": self.sampler.state_dict() if self.sampler is not None else None,
                "rng": gather_rng_states(self._control.group),  # every rank's, so a resized run finds its own
                "plugins": self.plugins.state_dict(),  # health: rule counters and mitigations
            }
            dcp_state = {**checkpointer_state.to_dcp(state), checkpointer_state.RESERVED_KEY: pickle.dumps(own)}
            # keys that would collide (refused), values a load would refuse (a warning): before anything is written
            self._save_checks(dcp_state, trust=self.plan.load.trust_checkpoint, rank=self.rank)
            if saver.config.overlap_staging:
                self.host.guard(checkpointer_state.optimizers_of(state))
            models = [value for value in state.values() if checkpointer_state.is_module(value)]
            return saver.save(
                dcp_state,
                step,
                epoch=self.sampler.epoch if self.sampler is not None else None,
                samples_consumed=samples_consumed(self.sampler) if self.sampler is not None else None,
                extra=self.plugins.save_extra(models[0], self.rank) if len(models) == 1 else None,
                defer=checkpointer_state.deferrable(state),
                never_skip=never_skip,
            )

        return request

    def _release(self) -> None:
        try:
            if self.host.close():
                self._control.close()
        finally:
            self._signal.close()

    def _not_restored(self, layout: Layout) -> list[str]:
        """What the state (or the Checkpointer) asked for and this checkpoint did not give back (the resume
        sequence logs it once, never silently: the loop then runs on with its own values for them)."""
        lacking = [f"state[{path[0]!r}]" for path in layout.missing if path != (checkpointer_state.RESERVED_KEY,)]
        if not layout.native:
            lacking += ["the sampler's position"] if self.sampler is not None else []
            lacking += ["the RNG states"] if self.restore_rng else []
        return lacking

    def _own_section(self, data: bytes, where: str) -> dict[str, Any]:
        try:
            return safe_pickle.loads(data, (), trust=self.plan.load.trust_checkpoint) if data else {}
        except safe_pickle.BlockedGlobal as err:
            raise safe_pickle.untrusted(
                where, f"the Checkpointer's {checkpointer_state.RESERVED_KEY!r} entry", err.name
            ) from err
