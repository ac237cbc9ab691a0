"""The plug-in lifecycle of a checkpointing run: retention, tiers, drills and health are plug-ins.

A front door (lightning/trainer/callback.py) holds one `PluginList` and calls each hook at its point of the
loop; every hook has a no-op default in `Plugin`, so a plug-in implements only what it does. Nothing
here knows a framework: what a plug-in sees of the run is a `PluginContext` the front door fills in
(ranks, the saver, a `Reporter` for metrics and alerts, the collectives it may run).

Order matters where plug-ins add saver listeners (tiers' replication before retention before health):
the list calls them in the order given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.storage.fsio import Location

log = logging.getLogger(__name__)


class Reporter:
    """Where plug-ins send what the run's loggers show; the no-op default for runs without loggers."""

    def log_metrics(self, values: dict[str, float]) -> None:
        pass

    def alert(self, title: str, text: str, level: str, wait_s: float) -> None:
        """`level`: INFO, WARN or ERROR. The log line and the event under ROOT/events/ are the alert otherwise."""

    def checkpoints_deleted(self, deleted: list[dict[str, Any]]) -> None:
        """Retention deleted these checkpoints (rank 0, training thread): whatever references them (a W&B
        artifact) says so, so nobody follows a dead reference. Each: checkpoint, step, uri, deleted_at."""


@dataclass
class PluginContext:
    """What plug-ins see of the run at a hook (the front door refreshes it; framework-free)."""

    location: Location | None = None  # the checkpoint root
    storage_options: dict[str, Any] = field(default_factory=dict)  # of the root (drill processes open it too)
    stage: str | None = None  # setup: "fit", "validate", ...
    run_id: str | None = None
    is_global_zero: bool = True
    world_size: int = 1
    saver: Any = None  # the saver saves go to now (CheckpointSaver)
    strategy: Any = None  # saver_for / existing_saver / replace_saver / save_config / checkpoint_group / any_rank
    reporter: Reporter = field(default_factory=Reporter)
    all_reduce_max: Callable[[list[float]], list[float]] = lambda values: values  # over the training group
    allow_shared_root: bool = False
    fault_hook: Any = None  # tests only: the strategy's fault injection, passed on to background copies
    resume_event: dict[str, Any] | None = None  # train start after a resume: the resume's event document
    publish: Callable[[dict[str, Any]], None] = lambda event: None  # hand an event document to every plug-in
    request_drill: Callable[[str], None] = lambda path: None  # drill this checkpoint now (a health rule)
    spare: Callable[[int | None], set[str]] = lambda keep_last: set()  # what retention must keep (every plug-in's)


class Plugin:
    """One policy of a checkpointing run. Every hook is optional; threads are named per hook."""

    state_key: str | None = None  # its entry in the callback's checkpointed state; None: stateless

    def shape_plan(self, plan: Any, placement: Any) -> Any:
        """Set-up, before the strategy gets the plan (training/plan.py): return it changed or as is."""
        return plan

    def setup(self, context: PluginContext) -> None:
        """Every set-up (each stage), every rank, after the plan is in force."""

    def start(self, context: PluginContext) -> None:
        """Train start, every rank at the same point, after the saver exists (saver listeners go here)."""

    def sync(self, preempted: bool, context: PluginContext) -> bool | None:
        """Batch end, every rank: a plug-in that runs its own all-reduce carries the preemption flag in it
        and returns the verdict; None: it runs none (the front door then agrees on the flag itself)."""
        return None

    def apply_control(self, saver: Any, when_busy: str) -> None:
        """Batch end, every rank, after `sync`: apply control state every rank now shares to the saver."""

    def interval_factor(self) -> float:
        """Multiplies the save intervals (steps and minutes)."""
        return 1.0

    def stop_reason(self) -> str | None:
        """Why training must stop now (every rank answers alike after `sync`); None: go on."""
        return None

    def before_save(self, context: PluginContext) -> None:
        """Every rank, before each save (collectives allowed: every rank calls it at the same step)."""

    def saver_override(self) -> Any:
        """A saver saves go to instead of the root's (tiers' degraded mode); None: the root's."""
        return None

    def save_extra(self, module: Any, rank: int) -> dict[str, Any] | None:
        """Every rank, at a save: entries for the manifest's `extra` (rank 0's are written)."""
        return None

    def owns(self, checkpoint_path: str) -> bool:
        """A checkpoint of a root this plug-in writes too (a resume from it continues this run)."""
        return False

    def spare(self, keep_last: int | None) -> set[str]:
        """Checkpoint directory names retention must keep although outside its window (saver thread)."""
        return set()

    def on_event(self, event: dict[str, Any]) -> None:
        """An event document (an attempt, a drill, a copy, a resume) as written under ROOT/events/; any thread."""

    def drain(self, context: PluginContext) -> None:
        """Rank 0, training thread, each batch end: log and act on what finished in the background."""

    def on_commit(self, record: Any) -> None:
        """Rank 0, training thread: a checkpoint committed (its record, logged just before)."""

    def drill_now(self, checkpoint_path: str) -> None:
        """Drill this checkpoint now, whatever the schedule."""

    def counters(self) -> dict[str, int]:
        """Counters logged with every checkpoint record."""
        return {}

    def flush(self) -> None:
        """Fit end, every rank, before the last records are logged: bounded finish of background work."""

    def close(self, context: PluginContext, *, finished: bool) -> None:
        """Fit end (`finished`, after the last records are logged) or an exception (not `finished`)."""

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any) -> None:
        pass


class PluginList(Plugin):
    """Calls each hook on every plug-in in order: the front door holds one and never branches per plug-in."""

    def __init__(self, plugins: list[Plugin]) -> None:
        self.plugins = list(plugins)

    def get(self, kind: type) -> Any:
        """The plug-in of this type (tests and front doors inspecting one), or None."""
        return next((plugin for plugin in self.plugins if isinstance(plugin, kind)), None)

    def shape_plan(self, plan: Any, placement: Any) -> Any:
        for plugin in self.plugins:
            plan = plugin.shape_plan(plan, placement)
        return plan

    def setup(self, context: PluginContext) -> None:
        context.publish = self.on_event
        context.request_drill = self.drill_now
        self._each("setup", context)

    def start(self, context: PluginContext) -> None:
        context.publish, context.request_drill, context.spare = self.on_event, self.drill_now, self.spare
        self._each("start", context)

    def sync(self, preempted: bool, context: PluginContext) -> bool | None:
        verdict = None
        for plugin in self.plugins:
            answer = plugin.sync(preempted, context)
            verdict = answer if verdict is None else verdict or bool(answer)
        return verdict

    def apply_control(self, saver: Any, when_busy: str) -> None:
        self._each("apply_control", saver, when_busy)

    def interval_factor(self) -> float:
        factor = 1.0
        for plugin in self.plugins:
            factor *= plugin.interval_factor()
        return factor

    def stop_reason(self) -> str | None:
        return next((reason for plugin in self.plugins if (reason := plugin.stop_reason())), None)

    def before_save(self, context: PluginContext) -> None:
        self._each("before_save", context)

    def saver_override(self) -> Any:
        return next((saver for plugin in self.plugins if (saver := plugin.saver_override()) is not None), None)

    def save_extra(self, module: Any, rank: int) -> dict[str, Any] | None:
        extra: dict[str, Any] = {}
        for plugin in self.plugins:
            extra.update(plugin.save_extra(module, rank) or {})
        return extra or None

    def owns(self, checkpoint_path: str) -> bool:
        return any(plugin.owns(checkpoint_path) for plugin in self.plugins)

    def spare(self, keep_last: int | None) -> set[str]:
        return set().union(*(plugin.spare(keep_last) for plugin in self.plugins))

    def on_event(self, event: dict[str, Any]) -> None:
        for plugin in self.plugins:
            try:
                plugin.on_event(event)
            except Exception:  # one plug-in's failure never reaches the thread that published the event
                log.exception("%s failed on an event", type(plugin).__name__)

    def drain(self, context: PluginContext) -> None:
        context.request_drill = self.drill_now
        self._each("drain", context)

    def on_commit(self, record: Any) -> None:
        self._each("on_commit", record)

    def drill_now(self, checkpoint_path: str) -> None:
        self._each("drill_now", checkpoint_path)

    def counters(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for plugin in self.plugins:
            merged.update(plugin.counters())
        return merged

    def flush(self) -> None:
        self._each("flush")

    def close(self, context: PluginContext, *, finished: bool) -> None:
        for plugin in self.plugins:
            plugin.close(context, finished=finished)

    def state_dict(self) -> dict[str, Any]:
        return {plugin.state_key: plugin.state_dict() for plugin in self.plugins if plugin.state_key}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for plugin in self.plugins:
            if plugin.state_key:
                plugin.load_state_dict(state.get(plugin.state_key))

    def _each(self, hook: str, *args: Any) -> None:
        for plugin in self.plugins:
            getattr(plugin, hook)(*args)
