"""`shardckpt health`: the run's health rules replayed offline over a root's event history.

Which rules: a file given with `--rules`, else the rules the run itself recorded when it started
(a `health_rules` event), so an operator sees the verdicts the run saw without knowing its config.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ..engine.metrics import read_events
from ..engine.storage.fsio import Location
from ..errors import ConfigError
from ..policies.health.evaluate import FIRED, HealthEvaluator, Transition, range_text
from ..policies.health.observe import HEALTH_EVENT, RULES_EVENT
from ..policies.health.rules import HealthConfig, health_config_from


@dataclass
class HealthReport:
    config: HealthConfig
    evaluator: HealthEvaluator  # with per-series history, for plots
    transitions: list[Transition]
    actions: dict[tuple[str | None, str | None], dict[str, Any]]  # (rule, key) -> the run's newest health event for it
    rules_source: str

    @property
    def firing(self) -> bool:
        return bool(self.evaluator.firing())

    def rows(self) -> list[dict[str, Any]]:
        """One row per rule and series (a rule never observed gets one row saying so)."""
        rows: list[dict[str, Any]] = []
        for rule in self.config.rules:
            series = self.evaluator.series[rule.name]
            if not series:
                rows.append(
                    {
                        "rule": rule.name,
                        "metric": rule.metric,
                        "owner": rule.owner,
                        "slice": rule.slice,
                        "key": None,
                        "severity": rule.severity,
                        "normal": "no data",
                        "value": None,
                        "firing": False,
                        "firing_since_step": None,
                        "firing_since": None,
                        "mitigation": rule.mitigation,
                        "mitigation_taken": None,
                        "evaluations": 0,
                    }
                )
                continue
            for key, state in sorted(series.items()):
                action = self.actions.get((rule.name, key))
                taken = (
                    action.get("mitigation_result")
                    if action and action.get("transition") == FIRED and state.firing
                    else None
                )
                rows.append(
                    {
                        "rule": rule.name,
                        "metric": rule.metric,
                        "owner": rule.owner,
                        "slice": rule.slice,
                        "key": key,
                        "severity": rule.severity,
                        "normal": range_text(state.low, state.high),
                        "low": state.low,
                        "high": state.high,
                        "value": state.last_value,
                        "firing": state.firing,
                        "firing_since_step": state.firing_since_step,
                        "firing_since": _iso(state.firing_since_time),
                        "mitigation": rule.mitigation,
                        "mitigation_taken": taken,
                        "evaluations": state.seen,
                    }
                )
        return rows

    def as_dict(self) -> dict[str, Any]:
        return {
            "rules_source": self.rules_source,
            "firing": self.firing,
            "rules": self.rows(),
            "transitions": [transition.as_dict() for transition in self.transitions],
        }


def evaluate_root(location: Location, config: HealthConfig | None = None) -> HealthReport:
    """Replay every event of the root, oldest first, through the rules."""
    events = read_events(location)
    source = "--rules"
    if config is None:
        recorded = [event for event in events if event.get("event") == RULES_EVENT]
        if not recorded:
            raise ConfigError(
                f"{location.url} has no recorded health rules (the run had none, or predates them); "
                "pass the rules to evaluate, e.g. --rules conf/health/default.yaml"
            )
        config = health_config_from(
            {"rules": recorded[-1]["rules"], "alert_every_s": recorded[-1].get("alert_every_s", 600.0)}
        )
        source = f"recorded by run {recorded[-1].get('run_id')} at {_iso(recorded[-1].get('created_at'))}"
    evaluator = HealthEvaluator(config, keep_history=True)
    transitions: list[Transition] = []
    actions: dict[tuple[str | None, str | None], dict[str, Any]] = {}  # (rule, key): a rule without slices has none
    for event in events:
        if event.get("event") == HEALTH_EVENT:
            actions[(event.get("rule"), event.get("key"))] = event
        elif event.get("event") != RULES_EVENT:
            transitions.extend(evaluator.observe_event(event))
    return HealthReport(config, evaluator, transitions, actions, source)


def _iso(stamp: float | None) -> str | None:
    if stamp is None:
        return None
    return datetime.fromtimestamp(stamp, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
