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

`typed_options` checks the type of every bool, int and float field of an options dataclass, from its annotations,
before the class's own `__post_init__` reads any value: a quoted YAML value or an environment variable arrives as a
string, and `"false"` is truthy (`trust_checkpoint="false"` would unpickle an untrusted checkpoint's code). A field
added later is covered without new code; `OPTION_CLASSES` lists the classes it guards (the tests walk it).

`did_you_mean` completes the other common message, an unknown option name, with the known name closest to it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Callable, Iterable
from numbers import Integral, Real
from typing import Any, TypeVar

from ..errors import ConfigError

Options = TypeVar("Options", bound=type)

# every options dataclass whose field types `typed_options` checks, in the order they were defined
OPTION_CLASSES: list[type] = []
# per class: the fields another options class checks for it (`typed_options(checked_by_parts=...)`)
_PARTS_CHECK: dict[type, frozenset[str]] = {}

# the annotations `require_type` checks; any other (str, Literal, a dataclass, dict, Any) is its class's own rule
CHECKED_TYPES = (bool, int, float)
_BOOL_WORDS = {"false": False, "0": False, "no": False, "off": False, "true": True, "1": True, "yes": True, "on": True}


def typed_options(label: str | None = None, *, checked_by_parts: Iterable[str] = ()) -> Callable[[Options], Options]:
    """Class decorator, placed under `@dataclass`: each instance's bool/int/float fields are type-checked
    (`require_type`) before the class's own `__post_init__` runs. `label` is how messages name the class's options
    (`"drill"` gives `drill.threads=...`); None: the class's name (`LoadConfig.trust_checkpoint=...`).

    `checked_by_parts`: fields the class's own `__post_init__` hands to another options class that checks them
    (CheckpointOptions' schedule goes to CallbackConfig, its `verify_on_load` to LoadConfig.verify_checksums): the
    part's message names the field where it is documented and checked, once, so this guard leaves them to it."""

    def guard(cls: Options) -> Options:
        own = cls.__dict__.get("__post_init__")
        prefix = label if label is not None else cls.__name__
        _PARTS_CHECK[cls] = frozenset(checked_by_parts)

        def __post_init__(self: object) -> None:
            # types first: the class's own checks compare and branch on values a string would fool
            cls_of_self: type = type(self)  # as `type`: mypy finds type[object] not Hashable, as functools.cache asks
            for name, annotation in _checked_fields(cls_of_self).items():
                require_type(f"{prefix}.{name}", getattr(self, name), annotation)
            if own is not None:
                own(self)

        __post_init__.__doc__ = own.__doc__ if own is not None else None
        cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
        OPTION_CLASSES.append(cls)
        return cls

    return guard


def checked_fields(cls: type) -> dict[str, Any]:
    """The fields of options dataclass `cls` whose type `require_type` checks, with their annotations."""
    return dict(_checked_fields(cls))


@functools.cache
def _checked_fields(cls: type) -> dict[str, Any]:
    # resolved once per class, at its first instance: `from __future__ import annotations` leaves strings
    hints = typing.get_type_hints(cls)
    parts = _PARTS_CHECK.get(cls, frozenset())
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if f.name not in parts and _simple_types(hints[f.name]) is not None
    }


def _simple_types(annotation: Any) -> tuple[tuple[type, ...], bool] | None:
    """(the checked types an annotation allows, whether it allows None); None when it is not one we check."""
    if annotation in CHECKED_TYPES:
        return (annotation,), False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = typing.get_args(annotation)
        allowed = tuple(member for member in members if member is not type(None))
        if allowed and all(member in CHECKED_TYPES for member in allowed):
            return allowed, len(allowed) < len(members)
    return None


def require_type(name: str, value: Any, annotation: Any) -> Any:
    """`value` when its type fits `annotation` (bool, int, float, or a union of them with None); else ConfigError
    naming `name`. A bool accepts only True/False; an int any integer but a bool; a float any real number but a bool
    (range and finiteness are `require_number`'s). Other annotations pass `value` through unchecked."""
    simple = _simple_types(annotation)
    if simple is None:
        return value
    allowed, optional = simple
    if value is None and optional:
        return value
    if any(_fits(value, kind) for kind in allowed):
        return value
    raise ConfigError(_type_message(name, value, allowed, optional))


def require_bool(name: str, value: Any) -> bool:
    """`value` when it is True or False; else ConfigError naming `name` (a door's own flag, outside a dataclass)."""
    return require_type(name, value, bool)


def _fits(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):  # True is an int to Python, never a count or a duration to a user
        return False
    return isinstance(value, Integral if kind is int else Real)


def _type_message(name: str, value: Any, allowed: tuple[type, ...], optional: bool) -> str:
    """`NAME=VALUE <problem>; use <rule>`, with the YAML spelling when a quoted value is the likely cause."""
    if bool in allowed:
        # "false", "0", "off": what the user meant is plain, only its type is wrong
        meant = _BOOL_WORDS.get(value.strip().lower()) if isinstance(value, str) else None
        example = "false" if meant is False else "true"
        rule = f"the boolean {example}" if meant is not None else "true or false"
        problem = "must be true or false, " + ("not a string" if isinstance(value, str) else f"not {_kind(value)}")
    else:
        rule, example = ("a number", "0.5") if float in allowed else ("an integer", "3")
        example = value.strip() if isinstance(value, str) and _is_number(value) else example
        if isinstance(value, str):
            problem = "is a string"
        elif isinstance(value, bool):
            problem = "is a boolean"
        elif isinstance(value, Real):  # a float where only an int fits
            problem = "is not an integer"
        else:
            problem = f"is {_kind(value)}"
    rule += ", or null" if optional else ""
    if isinstance(value, str):
        rule += f' (YAML: {name.rsplit(".", 1)[-1]}: {example}, not "{example}")'
    return f"{name}={value!r} {problem}; use {rule}"


def _kind(value: Any) -> str:
    return f"of type {type(value).__name__}"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


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
    # as a float (isfinite above converted it already): typeshed's Real declares no order against a float
    value = float(value)
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
