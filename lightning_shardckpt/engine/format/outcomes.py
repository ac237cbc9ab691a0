"""Outcomes: the scalar metrics a training run had when it saved a checkpoint (manifest `extra.metrics`).

A checkpoint's identity says what went in (config, data, model, code); its outcome says what came out
(loss, learning rate, whatever the run logs), so both sit on one timeline and `bisect` can search by
either. Values are floats; NaN and ±Inf, which JSON cannot hold, are stored as the strings "nan",
"inf" and "-inf" (docs/FORMAT.md §5) and read back as floats.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

METRICS_EXTRA = "metrics"  # manifest["extra"]["metrics"]: {name: number | "nan" | "inf" | "-inf"}
NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode_metrics(values: dict[str, Any]) -> dict[str, float | str]:
    """Scalar metrics as the manifest stores them; what is not one number (a vector, a string) is left out."""
    encoded: dict[str, float | str] = {}
    for name, value in sorted(values.items()):
        number = scalar(value)
        if number is None:
            continue
        encoded[str(name)] = number if math.isfinite(number) else _non_finite_name(number)
    return encoded


def decode_metrics(manifest: dict[str, Any] | None) -> dict[str, float]:
    """The recorded metrics of a manifest as floats; {} for a checkpoint saved without them (old or not Lightning)."""
    recorded = ((manifest or {}).get("extra") or {}).get(METRICS_EXTRA) or {}
    return {name: NON_FINITE[value] if isinstance(value, str) else float(value) for name, value in recorded.items()}


def metrics_problems(extra: dict[str, Any]) -> list[str]:
    """What is wrong with `extra.metrics` (FORMAT.md §5); [] when absent or sound."""
    if METRICS_EXTRA not in extra:
        return []
    metrics = extra[METRICS_EXTRA]
    if not isinstance(metrics, dict):
        return [f"extra.{METRICS_EXTRA} is not an object"]
    return [
        f"extra.{METRICS_EXTRA}[{name!r}] is {value!r}, not a number or one of {sorted(NON_FINITE)}"
        for name, value in metrics.items()
        if not (isinstance(value, str) and value in NON_FINITE)
        and not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
    ]


def scalar(value: Any) -> float | None:
    """A Python number or a one-element tensor as a float; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, Real):
        return float(value)
    numel = getattr(value, "numel", None)
    if callable(numel) and numel() == 1 and (value.is_floating_point() or not value.is_complex()):
        return float(value.detach().cpu().item())
    return None


def _non_finite_name(number: float) -> str:
    if math.isnan(number):
        return "nan"
    return "inf" if number > 0 else "-inf"
