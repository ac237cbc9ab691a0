"""Restore drills during training: which checkpoints to drill, the probe value at save time, and metrics.

A plug-in (policies/plugin.py) of ShardedCheckpoint, free of any framework. At a save it records the probe's value (when a probe is
configured) in the manifest's `extra`. `mode: training`: when a checkpoint commits, rank 0 hands every N-th one
to a background `DrillRunner` (ranks forked from warm workers at low priority; policies/drills/runner.py).
`mode: external`: a drill follower outside training drills them (`shardckpt drill --follow ROOT`) and rank 0
only watches its records (policies/drills/external.py). Either way, when a drill finishes its result is logged
through the run's `Reporter` on the training thread and written as an event under ROOT/events/. Nothing here
touches training state: a drill reads storage only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ...engine import metrics
from ...engine.format.drill_records import DRILLED, FAILED, NOT_DRILLED, PASSED
from ...engine.metrics import CheckpointRecord
from ...engine.storage.fsio import Location
from ...engine.validate import require_number, typed_options
from ...errors import ConfigError
from ..config_blocks import options_from
from ..plan import CheckpointPlan, Placement
from ..plugin import Plugin, PluginContext, Reporter
from . import trust as drill_trust
from .external import FollowerWatch
from .leases import DrillLeases
from .runner import DrillOptions, DrillRunner
from .worker import PROBE_EXTRA, load_callable

log = logging.getLogger(__name__)

TRAINING, EXTERNAL = "training", "external"  # who drills: rank 0 of the run, or a drill follower
DRILL_LAG_EVENT = "drill_lag"  # policies/health/observe.py: the lag alone, after commits a follower has not drilled


@dataclass(frozen=True, kw_only=True)
@typed_options("drill")
class DrillConfig:
    """`ShardedCheckpoint(drill=...)` / `checkpoint.drill` in YAML."""

    every_n_checkpoints: int | None = None  # drill every N-th committed checkpoint; None: no drills during training
    # training: rank 0 drills (every_n_checkpoints); external: a drill follower does (`shardckpt drill --follow
    # ROOT`) and the run only watches its records: drill metrics, events and health rules as if it drilled
    mode: str = TRAINING
    poll_s: float = 10.0  # mode external: seconds between the run's looks at the follower's records
    world_size: int | None = None  # drill ranks; None: differs from the writer's (1, or 2 for a 1-rank run)
    probe: str | None = (
        None  # "module:function" of the model's state dict -> float; recorded at save, compared in the drill
    )
    tolerance: float = 1e-4  # relative tolerance of the probe comparison
    timeout_s: float = 600.0  # a drill still running then is killed and recorded as failed
    threads: int = 1  # torch threads per drill rank: bounds the CPU a drill takes from training
    # GiB of destination memory the drill ranks keep between drills (all ranks together): a drill that fits
    # reuses the last drill's rank processes, their process group and tensors; 0: fork fresh ranks per drill
    keep_memory_gib: float = 2.0
    keep_last_drilled: int = (
        1  # retention keeps the newest K drilled checkpoints (the last known-good) on top of keep_last
    )
    fallback_to_last_good: bool = (
        False  # ckpt_path="latest" that fails to load resumes from the last known-good instead
    )

    def __post_init__(self) -> None:
        if self.mode not in (TRAINING, EXTERNAL):
            raise ConfigError(
                f"drill.mode={self.mode!r} is unknown; use 'training' (rank 0 drills every_n_checkpoints) or "
                "'external' (a follower drills: shardckpt drill --follow ROOT)"
            )
        require_number("drill.every_n_checkpoints", self.every_n_checkpoints, integer=True, at_least=1, allow_none=True)
        require_number("drill.poll_s", self.poll_s, above=0, hint="seconds")
        require_number(
            "drill.keep_last_drilled",
            self.keep_last_drilled,
            integer=True,
            at_least=0,
            hint="0 lets retention delete the last known-good",
        )
        self.options()  # validates world_size, timeout_s, threads, tolerance, probe, keep_memory_gib

    @property
    def enabled(self) -> bool:
        """Rank 0 drills during training."""
        return self.mode == TRAINING and self.every_n_checkpoints is not None

    @property
    def external(self) -> bool:
        return self.mode == EXTERNAL

    def options(
        self,
        storage_options: dict[str, Any] | None = None,
        *,
        trust_checkpoint: bool = False,
        safe_globals: tuple[str, ...] = (),
        public_keys: tuple[Any, ...] = (),
        revoked_keys: tuple[str, ...] = (),
    ) -> DrillOptions:
        """How one drill runs; `trust_checkpoint` and `safe_globals` are the run's (policies/drills/trust.py), and
        `public_keys` the run's signature policy (a checkpoint the run's resume would refuse never passes a drill)."""
        return DrillOptions(
            public_keys=public_keys,
            revoked_keys=revoked_keys,
            world_size=self.world_size,
            timeout_s=self.timeout_s,
            threads=self.threads,
            keep_memory_gib=self.keep_memory_gib,
            probe=self.probe,
            tolerance=self.tolerance,
            trust_checkpoint=trust_checkpoint,
            safe_globals=safe_globals,
            storage_options=dict(storage_options or {}),
        )


def drill_config_from(value: Any) -> DrillConfig:
    return options_from(DrillConfig, value, "drill")


@dataclass
class DrillCounters:
    passed: int = 0
    failed: int = 0
    not_drilled: int = 0
    committed_since_drilled: int = 0  # drill lag, in committed checkpoints
    results: list[dict[str, Any]] = field(default_factory=list)  # finished, not yet logged


class TrainingDrills(Plugin):
    """The callback's drills: probe values at save time, drill requests after commits, metrics after drills."""

    def __init__(
        self, config: DrillConfig, location: Location | None = None, storage_options: dict[str, Any] | None = None
    ) -> None:
        self.config = config
        self._location = location
        self._storage_options = dict(storage_options or {})
        self._trust_checkpoint = False  # the run's LoadConfig.trust_checkpoint, from the plan (shape_plan)
        self._public_keys: tuple[Any, ...] = ()  # the run's signature policy (LoadConfig), from the plan (shape_plan)
        self._revoked_keys: tuple[str, ...] = ()
        self._runner: DrillRunner | None = None
        self._watch: FollowerWatch | None = None  # mode external: the follower's records, seen from here
        self._committed = 0
        self._lock = threading.Lock()
        self.tally = DrillCounters()  # not `counters`: that is the plug-in hook
        self.run_id: str | None = None  # recorded in drill events, so health rules can slice by run
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # called with each drill event (the drill thread)

    # --- plug-in hooks ---
    def shape_plan(self, plan: CheckpointPlan, placement: Placement) -> CheckpointPlan:
        """The fallback option goes to the strategy; no drills where no node holds a whole checkpoint."""
        tiers = plan.tier_restore
        self._trust_checkpoint = plan.load.trust_checkpoint  # a drill unpickles what the run's resume does
        self._public_keys = plan.load.public_keys if plan.load.require_signature else ()  # and accepts what it does
        self._revoked_keys = plan.load.revoked_keys if plan.load.require_signature else ()
        if plan.save.node_local and placement.num_nodes > 1 and self.config.every_n_checkpoints:
            # a drill restores from the coordinator's node, whose fast directory holds only its own ranks' shards
            log.warning(
                "restore drills are off: the fast tier %s is node-local on %d nodes, so no node holds a whole "
                "checkpoint; drill the durable tier with `shardckpt drill %s`",
                tiers.config.fast.dirpath if tiers is not None else plan.root,
                placement.num_nodes,
                tiers.config.durable.dirpath if tiers is not None and tiers.config.durable else "<durable root>",
            )
            self.config = replace(self.config, every_n_checkpoints=None)
        return replace(plan, fallback_to_last_good=self.config.fallback_to_last_good)

    def setup(self, context: PluginContext) -> None:
        self._location = context.location
        self._storage_options = dict(context.storage_options)
        if context.publish not in self.listeners:
            self.listeners.append(context.publish)  # drill events feed the health rules

    def start(self, context: PluginContext) -> None:
        self.run_id = context.run_id

    def save_extra(self, module: torch.nn.Module, rank: int) -> dict[str, Any] | None:
        return self.probe_extra(module, rank)

    def drain(self, context: PluginContext) -> None:
        self.log(context.reporter)  # drills that finished since the last batch

    def on_commit(self, record: CheckpointRecord) -> None:
        if self.config.external and record.path:
            self._follower_watch().committed(record.path.rstrip("/").rsplit("/", 1)[-1])
            return
        self.on_committed(record.path)  # a queue put: the drill runs on its own thread and processes

    def drill_now(self, checkpoint_path: str) -> None:
        if self.config.external:  # the run drills nothing itself; the alert that asked says the follower is behind
            log.warning(
                "drill of %s requested, but drills are external: is `shardckpt drill --follow %s` running?",
                checkpoint_path,
                self._location.url if self._location is not None else "ROOT",
            )
            return
        self.request_now(checkpoint_path)

    def spare(self, keep_last: int | None) -> set[str]:
        if self.config.external and self._location is not None:
            return set(DrillLeases(self._location).held())  # what a follower is drilling right now
        return set(self.pending())

    def close(self, context: PluginContext, *, finished: bool) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
            self.log(context.reporter)
        if not finished:
            self.stop(self.config.timeout_s, finish_queued=False)
        elif context.is_global_zero:
            # training is over: let the requested drills finish, so the final checkpoint's verdict is known
            self.stop(self.config.timeout_s, finish_queued=True)
            self.log(context.reporter)

    # --- at a save (every rank) ---
    def probe_extra(self, module: torch.nn.Module, rank: int) -> dict[str, Any] | None:
        """The probe's value on the live model, for the manifest's `extra` (every rank: full tensors are collectives)."""
        if not (self.config.enabled or self.config.external) or not self.config.probe:
            return None  # external: the follower compares the probe too
        state = {name: _full(value) for name, value in module.state_dict().items()}
        if rank != 0:
            return None
        with torch.random.fork_rng(devices=[]):  # a probe that builds a model must not move training's RNG
            value = float(load_callable(self.config.probe)(state))
        return {PROBE_EXTRA: {"name": self.config.probe, "value": value}}

    # --- after a commit (rank 0) ---
    def on_committed(self, checkpoint_path: str | None) -> None:
        if not self.config.enabled or not checkpoint_path:
            return
        self._committed += 1
        with self._lock:
            self.tally.committed_since_drilled += 1
        every = self.config.every_n_checkpoints  # set: the config is enabled
        if every is None or self._committed % every:
            return
        self.request_now(checkpoint_path)

    def request_now(self, checkpoint_path: str) -> None:
        """Drill this checkpoint whatever the schedule (a health rule's `drill_now`); on the training thread."""
        if checkpoint_path.rstrip("/").rsplit("/", 1)[-1] in self.pending():
            return  # already queued: a second drill of it proves nothing new
        if self._runner is None:
            # the run's trust as it stands at its first drill: the user's add_safe_globals ran before fit
            options = self.config.options(
                self._storage_options,
                trust_checkpoint=self._trust_checkpoint,
                safe_globals=drill_trust.process_safe_globals(),
                public_keys=self._public_keys,
                revoked_keys=self._revoked_keys,
            )
            self._runner = DrillRunner(options, self.record_result)
        self._runner.request(checkpoint_path)

    def record_result(self, record: dict[str, Any], lag: dict[str, float] | None = None) -> None:
        """One finished drill (the drill thread), or one the follower filed (`lag`: the watch thread's)."""
        with self._lock:
            verdict = record.get("verdict")
            if verdict == PASSED:
                self.tally.passed += 1
                self.tally.committed_since_drilled = 0
            elif verdict == FAILED:
                self.tally.failed += 1
            else:
                self.tally.not_drilled += 1
            if lag is not None:
                self.tally.committed_since_drilled = int(lag["lag_checkpoints"])
            self.tally.results.append(record)
            lag_checkpoints = self.tally.committed_since_drilled
        event = {
            "event": "drill",
            **_summary(record),
            "lag_checkpoints": lag_checkpoints,
            "run_id": self.run_id,
            "created_at": time.time(),
        }
        if lag is not None:
            event["lag_s"] = lag["lag_s"]
        metrics.write_json_event(self.root, f"drill-step-{int(record.get('step') or 0):09d}", event)
        self._publish(event)

    def record_lag(self, lag: dict[str, float]) -> None:
        """Commits the follower has not drilled yet (the watch thread): the health rules' only sign of a
        follower that fell behind or stopped."""
        with self._lock:
            self.tally.committed_since_drilled = int(lag["lag_checkpoints"])
        event = {
            "event": DRILL_LAG_EVENT,
            "lag_checkpoints": lag["lag_checkpoints"],
            "lag_s": lag["lag_s"],
            "run_id": self.run_id,
            "created_at": time.time(),
        }
        metrics.write_json_event(self.root, "drill-lag", event)
        self._publish(event)

    @property
    def root(self) -> Location:
        """The run's root, where drill records go: set at set-up (every door sets up its plug-ins first)."""
        if self._location is None:
            raise ValueError("TrainingDrills recorded a drill before set-up gave it the run's root")
        return self._location

    def _follower_watch(self) -> FollowerWatch:
        if self._watch is None:
            self._watch = FollowerWatch(self.root, self.record_result, self.record_lag, poll_s=self.config.poll_s)
        return self._watch

    def _publish(self, event: dict[str, Any]) -> None:
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:
                log.exception("drill listener failed")

    # --- on the training thread (rank 0) ---
    def log(self, reporter: Reporter) -> list[dict[str, Any]]:
        """Log finished drills through the run's reporter; returns them."""
        with self._lock:
            results, self.tally.results = self.tally.results, []
            counters = {
                "drills_passed": self.tally.passed,
                "drills_failed": self.tally.failed,
                "drills_not_run": self.tally.not_drilled,
            }
            lag = self.tally.committed_since_drilled
        for record in results:
            values = {
                "drill/lag_checkpoints": float(lag),
                "drill/step": float(record.get("step") or 0),
                **{f"drill/{name}": float(value) for name, value in counters.items()},
            }
            # not-drilled (never ran, or its checkpoint went) proves nothing either way
            if record.get("verdict") in (PASSED, FAILED):
                values["drill/ok"] = 1.0 if record.get("verdict") == PASSED else 0.0
            for key in ("time_to_resume_s", "read_gbps"):
                if record.get(key) is not None:
                    values[f"drill/{key}"] = float(record[key])
            reporter.log_metrics(values)
            if record.get("verdict") != PASSED:
                log.warning(
                    "restore drill of %s: %s (%s)", record.get("checkpoint"), record.get("verdict"), record.get("cause")
                )
        return results

    def pending(self) -> set[str]:
        """Checkpoints (directory names) queued or being drilled: retention spares them."""
        return self._runner.pending() if self._runner is not None else set()

    def stop(self, timeout: float | None, *, finish_queued: bool) -> None:
        if self._runner is not None:
            self._runner.close(timeout, finish_queued=finish_queued)
            self._runner = None


def _full(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and hasattr(value, "full_tensor"):
        return value.full_tensor()
    return value


def _summary(record: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "checkpoint",
        "checkpoint_id",
        "step",
        "drill_id",
        "verdict",
        "cause",
        "world_size",
        "writer_world_size",
        "time_to_resume_s",
        "read_gbps",
        "bytes_read",
        "timings",
        "unpickle_trust",
    )
    out = {key: record.get(key) for key in keys if key in record}
    out["trust"] = {PASSED: DRILLED, FAILED: "drill-failed"}.get(str(record.get("verdict")), NOT_DRILLED)
    return out
