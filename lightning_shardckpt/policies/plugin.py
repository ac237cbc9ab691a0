"""The plug-in contract of a checkpointing run: retention, tiers, drills and health are plug-ins.

A front door holds one `PluginList` and tells it what happens (`Plugin`: set-up, train start, before each save,
events, the training thread's drain, commits, flush, close, and the plug-ins' own checkpointed state). What the
run then decides with the plug-ins' help (the plan, run control, what retention spares, which saver a save goes
to, manifest extras) are small Protocols in policies/decisions.py, each combined by one named rule. Nothing
here knows a framework: what a plug-in sees of the run is a `PluginContext` the door fills in (ranks, the saver,
the saver host, a `Reporter` for metrics and alerts, the collectives it may run). docs/ARCHITECTURE.md,
"Write a plug-in", has a complete example.

Order matters where plug-ins add saver listeners (tiers' replication before retention before health):
the list calls them in the order given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ..engine.metrics import CheckpointRecord
from ..errors import ConfigError
from . import decisions
from .context import PluginContext, Reporter, SaverHosting
from .decisions import (
    ControlApplier,
    ControlExchange,
    CounterSource,
    DrillTarget,
    IntervalScaler,
    ManifestExtras,
    PlanShaper,
    RetentionGuard,
    RunMembership,
    SaverRouter,
    StopDecider,
)
from .plugin_check import check_plugin

if TYPE_CHECKING:
    import torch

    from ..engine.save.saver import CheckpointSaver
    from .plan import CheckpointPlan, Placement

__all__ = [
    "Plugin",
    "PluginContext",
    "PluginList",
    "PluginState",
    "Reporter",
    "SaverHosting",
]  # the contract, in one import

log = logging.getLogger(__name__)

P = TypeVar("P")

# a plug-in's checkpointed state: a dict of plain values (Plugin.state_dict)
PluginState = dict[str, Any]


class Plugin:
    """One policy of a checkpointing run: it is told what happens. Every event is optional (a no-op here);
    threads are named per event. Decisions a plug-in takes part in are methods of policies/decisions.py's
    Protocols, which a plug-in adds only when it has an answer."""

    state_key: str | None = None  # its entry in the door's checkpointed state; None: stateless

    def setup(self, context: PluginContext) -> None:
        """Every set-up (each stage), every rank, after the plan is in force."""

    def start(self, context: PluginContext) -> None:
        """Train start (a plain loop: its first save), every rank at the same point, after the saver exists
        (saver listeners go here)."""

    def before_save(self, context: PluginContext) -> None:
        """Every rank, before each save (collectives allowed: every rank calls it at the same step)."""

    def on_event(self, event: dict[str, Any]) -> None:
        """An event document (an attempt, a drill, a copy, a resume) as written under ROOT/events/; any thread."""

    def drain(self, context: PluginContext) -> None:
        """Rank 0, training thread, each step end: log and act on what finished in the background."""

    def on_commit(self, record: CheckpointRecord) -> None:
        """Rank 0, training thread: a checkpoint committed (its record, logged just before)."""

    def flush(self) -> None:
        """Fit end, every rank, before the last records are logged: bounded finish of background work."""

    def close(self, context: PluginContext, *, finished: bool) -> None:
        """Fit end (`finished`, after the last records are logged) or an exception (not `finished`)."""

    def state_dict(self) -> PluginState | None:
        """Any thread a save runs on: this plug-in's state, saved under `state_key` in every checkpoint (plain
        values: str keys, numbers, strings, lists, dicts); None: nothing to save."""
        return None

    def load_state_dict(self, state: PluginState | None) -> None:
        """Resume, every rank: what `state_dict` returned when the checkpoint was saved; None when the
        checkpoint holds nothing under `state_key` (saved before this plug-in existed, or it returned None)."""


class PluginList:
    """The run's plug-ins: each event reaches every plug-in in order; each decision asks the plug-ins that
    answer it and combines their answers by its rule (policies/decisions.py). The door never branches per plug-in."""

    def __init__(self, plugins: list[Plugin]) -> None:
        self.plugins: list[Plugin] = []
        for plugin in plugins:
            self.add(plugin)

    def add(self, plugin: Plugin) -> None:
        """Register one more, after those already here; a plug-in whose events or decisions are misspelt (or take
        arguments the run does not pass) is refused now, before training (policies/plugin_check.py)."""
        if not isinstance(plugin, Plugin):
            raise ConfigError(
                f"plugins=[...] holds a {type(plugin).__name__}, not a lightning_shardckpt.Plugin; subclass Plugin "
                "(docs/ARCHITECTURE.md, 'Write a plug-in')"
            )
        check_plugin(plugin, Plugin)
        self.plugins.append(plugin)

    def get(self, kind: type[P]) -> P | None:
        """The plug-in of this type (tests and front doors inspecting one), or None."""
        return next((plugin for plugin in self.plugins if isinstance(plugin, kind)), None)

    def answering(self, decision: Callable[..., P]) -> list[P]:
        """The plug-ins that take part in `decision` (a Protocol of policies/decisions.py), in order."""
        # Callable, not type[P]: mypy takes a Protocol for an abstract class and refuses it as a type[P] argument
        # (python/mypy#4717); at run time it is the Protocol class, which isinstance accepts (runtime_checkable)
        return [plugin for plugin in self.plugins if isinstance(plugin, cast("type[P]", decision))]

    # --- events ---
    def setup(self, context: PluginContext) -> None:
        context.publish, context.request_drill = self.on_event, self.drill_now
        self._each("setup", context)

    def start(self, context: PluginContext) -> None:
        context.publish, context.request_drill, context.spare = self.on_event, self.drill_now, self.spare
        self._each("start", context)

    def before_save(self, context: PluginContext) -> None:
        self._each("before_save", context)

    def on_event(self, event: dict[str, Any]) -> None:
        for plugin in self.plugins:
            try:
                plugin.on_event(event)
            except Exception:  # one plug-in's failure never reaches the thread that published the event
                log.exception("%s failed on an event", type(plugin).__name__)

    def drain(self, context: PluginContext) -> None:
        context.request_drill = self.drill_now
        self._each("drain", context)

    def on_commit(self, record: CheckpointRecord) -> None:
        self._each("on_commit", record)

    def flush(self) -> None:
        self._each("flush")

    def close(self, context: PluginContext, *, finished: bool) -> None:
        for plugin in self.plugins:
            plugin.close(context, finished=finished)

    def state_dict(self) -> dict[str, PluginState | None]:
        return {plugin.state_key: plugin.state_dict() for plugin in self.plugins if plugin.state_key}

    def load_state_dict(self, state: dict[str, PluginState | None]) -> None:
        for plugin in self.plugins:
            if plugin.state_key:
                plugin.load_state_dict(state.get(plugin.state_key))

    # --- decisions, each by its rule ---
    def shape_plan(self, plan: CheckpointPlan, placement: Placement) -> CheckpointPlan:
        return decisions.in_order([shaping(s, placement) for s in self.answering(PlanShaper)], plan)

    def sync(self, preempted: bool, context: PluginContext) -> bool | None:
        return decisions.any_true([p.sync(preempted, context) for p in self.answering(ControlExchange)])

    def apply_control(self, saver: CheckpointSaver | None, when_busy: str) -> None:
        decisions.each(partial(p.apply_control, saver, when_busy) for p in self.answering(ControlApplier))

    def interval_factor(self) -> float:
        return decisions.product(p.interval_factor() for p in self.answering(IntervalScaler))

    def stop_reason(self) -> str | None:
        return decisions.first(p.stop_reason() for p in self.answering(StopDecider))

    def spare(self, keep_last: int | None) -> set[str]:
        return decisions.union(p.spare(keep_last) for p in self.answering(RetentionGuard))

    def saver_override(self) -> CheckpointSaver | None:
        return decisions.first(p.saver_override() for p in self.answering(SaverRouter))

    def save_extra(self, module: torch.nn.Module, rank: int) -> dict[str, Any] | None:
        return decisions.merged(p.save_extra(module, rank) for p in self.answering(ManifestExtras)) or None

    def owns(self, checkpoint_path: str) -> bool:
        return bool(decisions.any_true(p.owns(checkpoint_path) for p in self.answering(RunMembership)))

    def drill_now(self, checkpoint_path: str) -> None:
        decisions.each(partial(p.drill_now, checkpoint_path) for p in self.answering(DrillTarget))

    def counters(self) -> dict[str, int]:
        return decisions.merged(p.counters() for p in self.answering(CounterSource))

    def _each(self, event: str, *args: Any) -> None:
        for plugin in self.plugins:
            getattr(plugin, event)(*args)


def shaping(shaper: PlanShaper, placement: Placement) -> Callable[[CheckpointPlan], CheckpointPlan]:
    """One plug-in's step of the plan's shaping (decisions.in_order)."""
    return lambda plan: shaper.shape_plan(plan, placement)
