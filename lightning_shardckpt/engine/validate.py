"""One check for every numeric option, so a bad number is refused before training, in one message form.

`require_number` refuses what cannot work and passes the value through unchanged:

- not a number: a string (`"abc"`, or YAML's quoted `"3"`), None where None is not allowed, a bool
  (`True` is an `int` to Python, never a count or a duration to a user);
- NaN or infinite: NaN compares False with everything (a NaN tolerance passes any probe, a NaN threshold
  never fires), and an infinite count or duration means "never" without saying so;
- a float where an integer is needed (`keep_last=1.5` passes `>= 1` and then breaks every retention pass);
- outside the option's range.

The message is always `NAME=VALUE <problem>; use <rule>[ (<hint>)]`, e.g.
`keep_last=1.5 is not an integer; use an integer >= 1, or null (keep all)`.

`did_you_mean` completes the other common message, an unknown option name, with the known name closest to it.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from numbers import Integral, Real
from typing import Any

from ..errors import ConfigError


def did_you_mean(unknown: Iterable[Any], known: Iterable[Any]) -> str:
    """` (did you mean 'async_save'?)` for the unknown names close to a known one (a typo); "" when none is."""
    names = [str(name) for name in known]
    close = [match for name in sorted(map(str, unknown)) for match in difflib.get_close_matches(name, names, n=1)]
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def require_number(
    name: str,
    value: Any,
    *,
    integer: bool = False,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    allow_none: bool = False,
    none_means: str = "off",
    too_small: str | None = None,
    hint: str = "",
) -> Any:
    """`value` when it is a finite number (an int with `integer`) in range; else ConfigError naming `name`.

    `at_least`/`at_most` are inclusive bounds, `above` an exclusive lower bound. `allow_none`: None is
    accepted and the rule says what it means (`none_means`). `too_small` replaces "is below N" when the
    value is under the lower bound (e.g. "would delete the checkpoint being written").
    """
    if value is None and allow_none:
        return value
    rule = _rule(integer, at_least, above, at_most, allow_none, none_means) + (f" ({hint})" if hint else "")
    problem = _problem(value, integer, at_least, above, at_most, too_small)
    if problem:
        raise ConfigError(f"{name}={value!r} {problem}; use {rule}")
    return value


def require_keep_last(value: Any) -> Any:
    """`keep_last`, the callback's or a tier's: one rule for a count of committed checkpoints to keep, since
    both feed the same retention pass (0 would delete the checkpoint that was just written)."""
    return require_number(
        "keep_last",
        value,
        integer=True,
        at_least=1,
        allow_none=True,
        none_means="keep all",
        too_small="would delete the checkpoint being written",
    )


def _problem(
    value: Any, integer: bool, at_least: float | None, above: float | None, at_most: float | None, too_small: str | None
) -> str | None:
    if isinstance(value, bool) or not isinstance(value, Real):
        return "is not a number" if not integer else "is not an integer"
    if not math.isfinite(value):
        return "is not a finite number"
    if integer and not isinstance(value, Integral):
        return "is not an integer"
    if at_least is not None and value < at_least:
        return too_small or f"is below {at_least:g}"
    if above is not None and value <= above:
        return too_small or f"is not above {above:g}"
    if at_most is not None and value > at_most:
        return f"is above {at_most:g}"
    return None


def _rule(
    integer: bool,
    at_least: float | None,
    above: float | None,
    at_most: float | None,
    allow_none: bool,
    none_means: str,
) -> str:
    bounds = []
    if at_least is not None:
        bounds.append(f">= {at_least:g}")
    if above is not None:
        bounds.append(f"> {above:g}")
    if at_most is not None:
        bounds.append(f"<= {at_most:g}")
    rule = ("an integer" if integer else "a finite number") + (" " + " and ".join(bounds) if bounds else "")
    return rule + (f", or null ({none_means})" if allow_none else "")
