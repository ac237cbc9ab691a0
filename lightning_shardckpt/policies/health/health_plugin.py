"""Health rules during training: evaluate on rank 0 as results arrive, act on every rank at the same step.

A plug-in (policies/plugin.py) of ShardedCheckpoint, free of any framework: the front door hands it a
`Reporter` (its loggers, the W&B alert) and an all-reduce over the training group. Rank 0 feeds it
every checkpoint attempt's event document (from the saver's background thread, right after the event
file is written) and every drill result (from the drill thread): evaluation costs microseconds and
never runs on the training thread. A rule that fires or resolves calls its mitigation
(policies/health/mitigations.py), writes a `health` event under ROOT/events/ and queues an alert. A user's
mitigation (it may page someone for seconds) runs on this watch's own mitigation thread, never under
the lock the batch-end exchange takes. At each batch end the training thread of every rank runs
`share_control`: one all-reduce that carries rank 0's control state (save-interval factor,
skip-when-busy, stop) together with the preemption flag the callback already exchanged there, so every
rank changes its schedule at the same step. The evaluator's state and the control state are saved in
every checkpoint.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ...engine import metrics
from ...engine.storage.fsio import Location
from ..plugin import Plugin, PluginContext, Reporter
from .evaluate import FIRED, HealthEvaluator, Transition
from .mitigations import DRILL, HealthControl, MitigationContext, MitigationWorker, edits_control_only, mitigation_for
from .observe import HEALTH_EVENT, RULES_EVENT
from .rules import HealthConfig

if TYPE_CHECKING:
    from ...engine.save.saver import CheckpointSaver

log = logging.getLogger(__name__)

_ALERT_LEVEL = {"info": "INFO", "warning": "WARN", "error": "ERROR", "critical": "ERROR"}
METRIC_PREFIX = "health/"
MITIGATIONS_WAIT_S = 60.0  # at fit end, how long the last user mitigations may still take before training exits


class HealthWatch(Plugin):
    """One run's health rules: evaluation and mitigations (rank 0), control applied on every rank."""

    state_key = "health"  # rule counters, learned baselines, mitigations in force: rank 0's is written

    def __init__(self, config: HealthConfig, location: Location | None = None) -> None:
        for rule in config.rules:
            mitigation_for(rule.mitigation)  # an unknown or unimportable mitigation fails before training starts
        self.config = config
        self._location = location
        self._lock = threading.Lock()
        self.evaluator = HealthEvaluator(config)
        self.context = MitigationContext(HealthControl())
        self._alerts: list[tuple[Transition, str | None]] = []
        self._metrics: list[tuple[int, dict[str, float]]] = []
        self._last_alert: dict[tuple[str, str], float] = {}
        self.newest_committed: str | None = None
        self.run_id: str | None = None
        self.applied = HealthControl().encode()  # what this rank applies: [interval factor, skip, stop]
        self.transitions: list[Transition] = []  # every transition of this fit, in order (tests, the final log)
        self._watched: weakref.WeakSet = weakref.WeakSet()  # savers whose events feed the rules
        self._worker = MitigationWorker(self._run_off_thread)  # user mitigations: off the lock, in order

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    # --- plug-in hooks ---
    def setup(self, context: PluginContext) -> None:
        self._location = context.location

    def start(self, context: PluginContext) -> None:
        if not self.enabled:
            return
        self.run_id = context.run_id
        self.forget_ranks(context.world_size)
        if context.is_global_zero:
            self.watch(context.saver, context.resume_event)

    def sync(self, preempted: bool, context: PluginContext) -> bool | None:
        if not self.enabled:
            return None
        return self.share_control(preempted, context.is_global_zero, context.all_reduce_max)

    def apply_control(self, saver: CheckpointSaver | None, when_busy: str) -> None:
        if self.enabled:
            self.apply_when_busy(saver, when_busy)

    def stop_reason(self) -> str | None:
        return self.why_stop if self.stop_requested else None

    def drain(self, context: PluginContext) -> None:
        self.report(context.reporter, context.request_drill)

    def flush(self) -> None:
        self.finish_mitigations(MITIGATIONS_WAIT_S)

    def finish_mitigations(self, timeout_s: float = MITIGATIONS_WAIT_S) -> bool:
        """Wait (bounded) for user mitigations still running; their events and alerts are then queued."""
        return self._worker.wait(timeout_s)

    def close(self, context: PluginContext, *, finished: bool) -> None:
        if finished and context.is_global_zero:
            self.report(context.reporter, request_drill=None)  # the final verdicts' alerts; no new drills now

    @property
    def root(self) -> Location:
        """The run's root, where health events go: set at set-up (every door sets up its plug-ins first)."""
        if self._location is None:
            raise ValueError("HealthWatch wrote an event before set-up gave it the run's root")
        return self._location

    # --- rank 0, any thread ---
    def record_rules(self) -> None:
        """Write the rules into the root once per fit, so `shardckpt health ROOT` replays with them."""
        if self.enabled:
            metrics.write_json_event(
                self.root,
                f"health-rules-{self.run_id or 'run'}",
                {
                    "event": RULES_EVENT,
                    "run_id": self.run_id,
                    "alert_every_s": self.config.alert_every_s,
                    "rules": [rule.as_dict() for rule in self.config.rules],
                },
            )

    def watch(self, saver: Any, resume_event: dict[str, Any] | None) -> None:
        """Rank 0, at train start: record the rules, evaluate each attempt's event as the saver writes it."""
        if saver in self._watched:
            return
        self._watched.add(saver)
        self.record_rules()
        saver.add_listener(
            lambda record: self.on_event(
                metrics.event_payload(record, saver.counters.snapshot(), saver.counters.notes())
            )
        )
        if resume_event is not None:
            self.on_event(resume_event)  # a real resume's time is a health metric (resume_s)

    def on_event(self, event: dict[str, Any]) -> None:
        """Evaluate one event document (a checkpoint attempt, a drill, a resume) as written to ROOT/events/."""
        if not self.enabled:
            return
        with self._lock:
            if event.get("outcome") == metrics.COMMITTED and event.get("path"):
                self.newest_committed = event["path"]
            transitions = self.evaluator.observe_event(event)
            self._metrics.append((int(event.get("step") or 0), self._firing_metrics()))
            for transition in transitions:
                self._act(transition)

    def _act(self, transition: Transition) -> None:
        """Under the lock: a built-in edits the control state now; a user's mitigation goes to the worker."""
        self.transitions.append(transition)
        if edits_control_only(transition.rule.mitigation):
            self._record(transition, self._call(transition))
        else:
            self._worker.submit(transition)

    def _run_off_thread(self, transition: Transition) -> None:
        changed = self._call(transition)  # not under the lock: the training thread's share_control never waits
        with self._lock:
            self._record(transition, changed)

    def _call(self, transition: Transition) -> str | None:
        try:
            return mitigation_for(transition.rule.mitigation)(self.context, transition)
        except Exception as err:  # a user's mitigation must not take the run down; the alert still goes out
            log.exception("mitigation %s of health rule %s failed", transition.rule.mitigation, transition.rule.name)
            return f"mitigation failed: {err}"

    def _record(self, transition: Transition, changed: str | None) -> None:
        text = transition.describe() + (f"; done: {changed}" if changed else "")
        (log.warning if transition.kind == FIRED else log.info)("%s", text)
        metrics.write_json_event(
            self.root,
            f"health-{transition.rule.name}-{transition.kind}-step-{transition.step:09d}",
            {
                "event": HEALTH_EVENT,
                **transition.as_dict(),
                "created_at": time.time(),
                "mitigation_result": changed,
                "run_id": self.run_id,
            },
        )
        self._alerts.append((transition, changed))

    def _firing_metrics(self) -> dict[str, float]:
        return {
            f"{METRIC_PREFIX}{name}/firing": float(any(state.firing for state in series.values()))
            for name, series in self.evaluator.series.items()
            if series
        }

    # --- the training thread, every rank ---
    def share_control(
        self, preempted: bool, is_global_zero: bool, all_reduce_max: Callable[[list[float]], list[float]]
    ) -> bool:
        """One all-reduce (MAX, the training group: every rank runs it at every batch end): any rank's
        preemption flag, and rank 0's control state. Returns the preemption verdict."""
        with self._lock:
            control = self.context.control.encode() if is_global_zero else [0.0, 0.0, 0.0]
        values = all_reduce_max([1.0 if preempted else 0.0, *control])
        self.applied = [max(values[1], 1.0), values[2], values[3]]
        return bool(values[0])

    def interval_factor(self) -> float:
        return self.applied[0]

    @property
    def skip_when_busy(self) -> bool:
        return bool(self.applied[1])

    @property
    def stop_requested(self) -> bool:
        return bool(self.applied[2])

    @property
    def why_stop(self) -> str:
        return self.context.control.stop_reason or "a health rule asked to stop training (see rank 0's log)"

    def apply_when_busy(self, saver: Any, configured: str) -> None:
        """`skip_when_busy` in force: the saver skips a save due while one is in flight (every rank, same step)."""
        wanted = "skip" if self.skip_when_busy else configured
        if saver is not None and saver.config.when_busy != wanted:
            log.warning("health: when_busy %s -> %s", saver.config.when_busy, wanted)
            saver.config = replace(saver.config, when_busy=wanted)

    def report(self, reporter: Reporter, request_drill: Callable[[str], None] | None) -> None:
        """Rank 0, training thread: send queued alerts, log firing metrics, start requested drills."""
        with self._lock:
            alerts, self._alerts = self._alerts, []
            logged, self._metrics = self._metrics, []
            actions, self.context.actions = self.context.actions, []
        for _step, values in logged:
            if values:
                reporter.log_metrics(values)
        for transition, changed in alerts:
            self._send_alert(reporter, transition, changed)
        for kind, _transition, _text in actions:
            if kind == DRILL and self.newest_committed and request_drill is not None:
                request_drill(self.newest_committed)

    def _send_alert(self, reporter: Reporter, transition: Transition, changed: str | None) -> None:
        key = (transition.rule.name, transition.key)
        now = time.monotonic()
        if key in self._last_alert and now - self._last_alert[key] < self.config.alert_every_s:
            log.info("alert for %s on %s rate-limited (alert_every_s=%s)", *key, self.config.alert_every_s)
            return
        self._last_alert[key] = now
        verb = "firing" if transition.kind == FIRED else "resolved"
        title = f"shardckpt health: {transition.rule.name} {verb}"
        text = transition.describe() + (f"; done: {changed}" if changed else "")
        level = _ALERT_LEVEL[transition.rule.severity] if transition.kind == FIRED else "INFO"
        reporter.alert(title, text, level, self.config.alert_every_s)

    # --- carried in every checkpoint (rank 0's state is the one written) ---
    def state_dict(self) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        with self._lock:
            return {"evaluator": self.evaluator.state_dict(), "control": self.context.control.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        with self._lock:
            self.evaluator.load_state_dict(state.get("evaluator"))
            self.context.control.load_state_dict(state.get("control"))
            self._release_unless_firing()

    def forget_ranks(self, world_size: int) -> None:
        """After a resize: per-rank series of ranks that no longer exist would fire forever; drop them."""
        with self._lock:
            for name, series in self.evaluator.series.items():
                for key in [key for key in series if (rank := _rank_of(key)) is not None and rank >= world_size]:
                    log.info(
                        "health rule %s: dropping the series of %s (the run now has %d ranks)", name, key, world_size
                    )
                    del series[key]
                    self.context.control.release(name, key)
            self._release_unless_firing()

    def _release_unless_firing(self) -> None:
        """A mitigation stays in force only while a series of its rule still fires."""
        firing = {(rule.name, key) for rule, key, _ in self.evaluator.firing()}
        control = self.context.control
        for rule, keys in list(control.holders.items()):
            for key in list(keys):
                if (rule, key) not in firing:
                    control.release(rule, key)
        held = set(control.holders)
        control.factors = {rule: factor for rule, factor in control.factors.items() if rule in held}
        control.skip_rules &= held


def _rank_of(key: str) -> int | None:
    return int(key[4:]) if key.startswith("rank") and key[4:].isdigit() else None
