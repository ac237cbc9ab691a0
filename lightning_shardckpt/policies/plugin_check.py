"""A plug-in's methods checked when it is registered: a misspelt event or decision is refused, never ignored.

`PluginList` finds who answers a decision with `isinstance(plugin, Protocol)`, and `runtime_checkable` matches
method names only: a plug-in whose `spare` is spelt `spares` is silently never asked, and one whose `spare` takes
no argument fails only at the first retention, in the saver thread. So at registration every method of the
plug-in's own classes is compared with the contract (the events of `Plugin`, the methods of
policies/decisions.py's Protocols): a name a typo away from a contract name, or a contract method that cannot be
called the way the run calls it, raises a `ConfigError` that names the method and the right name and signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .decisions import DECISIONS

# a name this close to a contract name (edits, after lower-casing and dropping "_") is taken for a misspelling:
# one edit for a short name (`spares`), two for a long one (`interval_facter`); more would catch helpers
# (TrainingDrills.stop is two edits from `setup`)
MAX_EDITS_SHORT, MAX_EDITS_LONG, LONG_NAME = 1, 2, 8
# shorter contract names are left out of the near-name check: any short helper would be "close" to them
MIN_NAME_LENGTH = 5


def contract(plugin_base: type) -> dict[str, tuple[str, Callable[..., Any]]]:
    """Every method the run calls on a plug-in: name -> (where it is declared, its declared function)."""
    methods: dict[str, tuple[str, Callable[..., Any]]] = {
        name: (f"event of {plugin_base.__name__}", value)
        for name, value in vars(plugin_base).items()
        if not name.startswith("_") and inspect.isfunction(value)
    }
    for decision in DECISIONS:
        for name, value in vars(decision).items():
            if not name.startswith("_") and inspect.isfunction(value):
                methods[name] = (f"decision {decision.__name__}", value)
    return methods


def check_plugin(plugin: object, plugin_base: type) -> None:
    """Raise ConfigError for a misspelt event or decision, or one the run could not call; return otherwise."""
    methods = contract(plugin_base)
    cls = type(plugin)
    for name in own_method_names(cls, plugin_base):
        if name not in methods:
            near = [known for known in methods if len(known) >= MIN_NAME_LENGTH and is_misspelling(name, known)]
            if near:
                where, declared = methods[near[0]]
                raise ConfigError(
                    f"plug-in {cls.__name__} has a method {name!r}, which the run never calls: did you mean "
                    f"{near[0]}{signature_text(declared)} ({where})? Rename it (or, for a helper of your own, "
                    "choose a name further from the plug-in contract: docs/ARCHITECTURE.md, 'Write a plug-in')"
                )
    for name, (where, declared) in methods.items():
        method = getattr(plugin, name, None)
        if not callable(method) or getattr(cls, name, None) is getattr(plugin_base, name, None):
            continue  # not answered, or Plugin's own no-op
        if not callable_as(method, declared):
            raise ConfigError(
                f"plug-in {cls.__name__}.{name}{signature_text(method, bound=True)} cannot be called as the run "
                f"calls it: {name}{signature_text(declared)} ({where}); give it that signature"
            )


def own_method_names(cls: type, plugin_base: type) -> set[str]:
    """Public methods the plug-in's author wrote: those of its classes that are plug-ins, below `plugin_base`
    (a mixin's methods are that library's business)."""
    return {
        name
        for klass in cls.__mro__
        if issubclass(klass, plugin_base) and klass is not plugin_base
        for name, value in vars(klass).items()
        if not name.startswith("_") and callable(value)
    }


def callable_as(method: Callable[..., Any], declared: Callable[..., Any]) -> bool:
    """Whether `method` (bound) accepts the arguments the run passes to `declared` (unbound: first is self):
    positional parameters by position, keyword-only ones by name."""
    parameters = list(inspect.signature(declared).parameters.values())[1:]
    args = [None for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwargs = {p.name: None for p in parameters if p.kind == p.KEYWORD_ONLY}
    try:
        inspect.signature(method).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:  # a builtin without a signature: nothing to check
        return True
    return True


def signature_text(function: Callable[..., Any], bound: bool = False) -> str:
    """`(keep_last: int | None) -> set[str]`: the parameters after self, annotations as written."""
    parameters = list(inspect.signature(function).parameters.values())[0 if bound else 1 :]
    text, keyword_only = [], False
    for parameter in parameters:
        if parameter.kind == parameter.KEYWORD_ONLY and not keyword_only:
            text.append("*")
            keyword_only = True
        text.append(parameter.name + annotation_text(parameter.annotation) + default_text(parameter))
    returns = inspect.signature(function).return_annotation
    arrow = "" if returns is inspect.Signature.empty else f" -> {annotation_text(returns)[2:]}"
    return f"({', '.join(text)}){arrow}"


def annotation_text(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    return f": {annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)}"


def default_text(parameter: inspect.Parameter) -> str:
    return "" if parameter.default is inspect.Parameter.empty else f"={parameter.default!r}"


def is_misspelling(name: str, known: str) -> bool:
    a, b = name.lower().replace("_", ""), known.lower().replace("_", "")
    return edit_distance(a, b) <= (MAX_EDITS_LONG if len(b) >= LONG_NAME else MAX_EDITS_SHORT)


def edit_distance(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of two neighbours (optimal string alignment)."""
    rows = [list(range(len(b) + 1))] + [[i] + [0] * len(b) for i in range(1, len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            rows[i][j] = min(rows[i - 1][j] + 1, rows[i][j - 1] + 1, rows[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                rows[i][j] = min(rows[i][j], rows[i - 2][j - 2] + 1)
    return rows[len(a)][len(b)]
