"""Health rules for tests, built as conf/health/*.yaml writes them (the dicts `health_config_from` reads): one
builder instead of the same nested literal in every health test, so a test says only what it varies."""

from __future__ import annotations

from typing import Any


def static_rule(
    name: str,
    metric: str,
    *,
    low: float | None = None,
    high: float | None = None,
    fire_after: int | None = None,
    resolve_after: int | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A rule on `metric` whose normal range is the static band [`low`, `high`] (either edge may be left open);
    `fire_after`/`resolve_after` the persistence (left out: the rule's defaults); `fields` the rest as the YAML
    spells them (owner, slice, severity, mitigation, mitigation_options)."""
    rule: dict[str, Any] = {"name": name, "metric": metric, **fields}
    band = {edge: value for edge, value in (("min", low), ("max", high)) if value is not None}
    if band:
        rule["range"] = {"kind": "static", **band}
    persistence = {
        key: value for key, value in (("fire_after", fire_after), ("resolve_after", resolve_after)) if value is not None
    }
    if persistence:
        rule["persistence"] = persistence
    return rule
