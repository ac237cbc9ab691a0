"""The rule engine: feeds observations through each rule's normal range and persistence, and says
when a rule fires and when it resolves.

Deterministic and free of I/O: the training run (policies/health/health_plugin.py) and `shardckpt health` (offline,
over ROOT/events/) run this same code on the same documents. Its state is plain JSON-able data, saved in
every checkpoint, so persistence counters and learned baselines survive a restart and a resize.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from .observe import ALL_SERIES, Observation, observe
from .rules import ABOVE, BELOW, LEARNED, HealthConfig, HealthRule

FIRED, RESOLVED = "fired", "resolved"
STATE_VERSION = 1


@dataclass
class SeriesState:
    """One rule on one series (a run, a rank, a cause): its baseline, counters and firing state."""

    baseline: list[float] = field(default_factory=list)  # the last `window` in-range values
    seen: int = 0
    out_count: int = 0  # consecutive out-of-range evaluations
    in_count: int = 0  # consecutive in-range evaluations
    out_since: float | None = None
    firing: bool = False
    firing_since_step: int | None = None
    firing_since_time: float | None = None
    last_value: float | None = None
    last_step: int | None = None
    low: float | None = None  # the normal range at the last evaluation (None: unbounded on that side)
    high: float | None = None
    history: list[list[Any]] = field(default_factory=list)  # [step, value, low, high, firing] for plots (offline)


@dataclass(frozen=True)
class Transition:
    """A rule started or stopped firing on one series."""

    rule: HealthRule
    key: str
    kind: str  # FIRED | RESOLVED
    value: float
    low: float | None
    high: float | None
    step: int
    time: float

    def describe(self) -> str:
        normal = range_text(self.low, self.high)
        verb = "fires" if self.kind == FIRED else "resolved"
        return (
            f"health rule {self.rule.name} {verb} on {self.rule.slice}={self.key}: {self.rule.metric}={self.value:.4g} "
            f"(normal {normal}) at step {self.step}; owner: {self.rule.owner}; mitigation: {self.rule.mitigation}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule.name,
            "metric": self.rule.metric,
            "slice": self.rule.slice,
            "key": self.key,
            "transition": self.kind,
            "value": self.value,
            "low": self.low,
            "high": self.high,
            "step": self.step,
            "time": self.time,
            "owner": self.rule.owner,
            "severity": self.rule.severity,
            "mitigation": self.rule.mitigation,
        }


class HealthEvaluator:
    """Every rule's state over every series it has seen."""

    def __init__(self, config: HealthConfig, *, keep_history: bool = False) -> None:
        self.config = config
        self.keep_history = keep_history
        self.series: dict[str, dict[str, SeriesState]] = {rule.name: {} for rule in config.rules}

    def observe_event(self, event: dict[str, Any]) -> list[Transition]:
        return self.observe(observe(event))

    def observe(self, observations: Iterable[Observation]) -> list[Transition]:
        transitions = []
        for observation in observations:
            for rule in self.config.rules:
                if rule.metric != observation.metric or rule.slice != observation.slice:
                    continue
                series = self.series[rule.name]
                keys = list(series) if observation.key is ALL_SERIES else [observation.key]
                for key in keys:
                    state = series.setdefault(key, SeriesState())
                    transition = self._evaluate(rule, key, state, observation)
                    if transition is not None:
                        transitions.append(transition)
        return transitions

    def firing(self) -> list[tuple[HealthRule, str, SeriesState]]:
        return [
            (rule, key, state)
            for rule in self.config.rules
            for key, state in self.series[rule.name].items()
            if state.firing
        ]

    def state_dict(self) -> dict[str, Any]:
        series = {
            name: {key: {k: v for k, v in asdict(state).items() if k != "history"} for key, state in by_key.items()}
            for name, by_key in self.series.items()
        }
        return {"version": STATE_VERSION, "series": series}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore counters and baselines of rules that still exist (a rule removed since is dropped)."""
        if not state or state.get("version") != STATE_VERSION:
            return
        known = set(SeriesState.__dataclass_fields__)
        for name, by_key in (state.get("series") or {}).items():
            if name in self.series:
                self.series[name] = {
                    key: SeriesState(**{k: v for k, v in fields.items() if k in known})
                    for key, fields in by_key.items()
                }

    # --- one evaluation ---
    def _evaluate(self, rule: HealthRule, key: str, state: SeriesState, observation: Observation) -> Transition | None:
        value = observation.value
        low, high = normal_range(rule, state)
        state.seen += 1
        state.last_value, state.last_step, state.low, state.high = value, observation.step, low, high
        transition = None
        if low is None and high is None:  # learning: no verdict yet, every value teaches the baseline
            _learn(rule, state, value)
        elif (low is None or value >= low) and (high is None or value <= high):
            state.in_count, state.out_count, state.out_since = state.in_count + 1, 0, None
            _learn(rule, state, value)
            if state.firing and state.in_count >= rule.persistence.resolve_after:
                state.firing, state.firing_since_step, state.firing_since_time = False, None, None
                transition = Transition(rule, key, RESOLVED, value, low, high, observation.step, observation.time)
        else:
            state.out_count, state.in_count = state.out_count + 1, 0
            state.out_since = observation.time if state.out_since is None else state.out_since
            long_enough = (
                rule.persistence.fire_after_s is not None
                and observation.time - state.out_since >= rule.persistence.fire_after_s
            )
            if not state.firing and (state.out_count >= rule.persistence.fire_after or long_enough):
                state.firing, state.firing_since_step, state.firing_since_time = (
                    True,
                    observation.step,
                    observation.time,
                )
                transition = Transition(rule, key, FIRED, value, low, high, observation.step, observation.time)
        if self.keep_history:
            state.history.append([observation.step, value, low, high, state.firing])
        return transition


def normal_range(rule: HealthRule, state: SeriesState) -> tuple[float | None, float | None]:
    """(low, high) a value must stay within; (None, None) while a learned range is still warming up."""
    spec = rule.range
    low, high = spec.min, spec.max
    if spec.kind == LEARNED and len(state.baseline) >= spec.warmup:
        center = statistics.median(state.baseline)
        mad = statistics.median(abs(value - center) for value in state.baseline)
        half = max(spec.k * mad, spec.floor, spec.relative_floor * abs(center))
        if spec.direction != ABOVE:  # a low value is bad; every metric watched is >= 0, so is its learned floor
            low = max(center - half, 0.0) if low is None else max(low, center - half)
        if spec.direction != BELOW:  # a high value is bad
            high = center + half if high is None else min(high, center + half)
    return low, high


def _learn(rule: HealthRule, state: SeriesState, value: float) -> None:
    if rule.range.kind == LEARNED:
        state.baseline.append(value)
        del state.baseline[: -rule.range.window]


def range_text(low: float | None, high: float | None) -> str:
    if low is None and high is None:
        return "learning"
    if low is None:
        return f"<= {high:.4g}"
    if high is None:
        return f">= {low:.4g}"
    return f"[{low:.4g}, {high:.4g}]"
