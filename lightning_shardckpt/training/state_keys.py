"""The keys of a state as a checkpoint names them, and the values whose keys it cannot name apart.

DCP names every value of a state by its keys joined with "." (`{"cfg": {"lr": {"decay": 2}}}` is `cfg.lr.decay`;
a list's items by their index), each key through `str()`. Two consequences a plain loop's state can run into:

- a dict with non-string keys (`{0: 11, 1: 22}`) is saved as `counts.0`, `counts.1`; loaded back into the
  same dict, DCP sets `counts["0"]`, so the dict ends up with both `0` and `"0"`. `str_keyed` hands DCP a copy
  with string keys and `restore_keys` puts the loaded values back under the dict's own keys: the state
  round-trips exactly;
- two values with one name (`{"lr.decay": 1, "lr": {"decay": 2}}`, or keys `0` and `"0"` in one dict) cannot
  both be saved: DCP fails the commit with "duplicated flatten key", in the background, save after save.
  `check_keys` refuses such a state at the first save instead, naming both keys and the fix.

The walk is DCP's (torch/distributed/checkpoint/_traverse.py): mappings always, lists only when they hold a
tensor or a mapping somewhere, anything else (a tuple too) is one value.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch

from ..errors import ConfigError

Path = tuple[Any, ...]


_SCALARS = frozenset({type(None), bool, int, float, complex, str, bytes})


def _is_value(value: Any) -> bool:
    """Whether DCP saves `value` whole (a leaf), as its traversal decides."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    if set(map(type, value)) <= _SCALARS:  # the usual list (a million ints: ~20 ms at C speed, ~0.3 s item by item)
        return True
    return not any(
        isinstance(entry, torch.Tensor) or (isinstance(entry, (Mapping, list)) and not _is_value(entry))
        for entry in value
    )


def leaves(state: Mapping[Any, Any], path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """(path of the state's own keys and list indices, value) of every value DCP saves, in order."""
    for key, value in state.items():
        yield from _leaves((*path, key), value)


def _leaves(path: Path, value: Any) -> Iterator[tuple[Path, Any]]:
    if isinstance(value, Mapping):
        yield from leaves(value, path)
    elif _is_value(value):
        yield path, value
    else:
        for index, item in enumerate(value):
            yield from _leaves((*path, index), item)


def dotted(path: Path) -> str:
    """The name DCP saves the value at `path` under."""
    return ".".join(str(part) for part in path)


def shown(path: Path) -> str:
    """`state['cfg']['lr.decay']`: the value as the user's code reaches it."""
    return "state" + "".join(f"[{part!r}]" for part in path)


def check_keys(state: Mapping[Any, Any]) -> None:
    """ConfigError naming the first two values of `state` that a checkpoint would save under one name."""
    named: dict[str, Path] = {}
    for path, _ in leaves(state):
        name = dotted(path)
        first = named.setdefault(name, path)
        if first != path:
            raise _collision(first, path, name)


def _collision(first: Path, second: Path, name: str) -> ConfigError:
    return ConfigError(
        f"{shown(first)} and {shown(second)} would both be saved as {name!r} (a checkpoint names each value by its "
        "keys joined with '.', each key as str()); rename one of the keys, e.g. without the '.'"
    )


def str_keyed(value: Any, path: Path = ()) -> Any:
    """`value` with string keys only, for DCP to load into: a copy where a dict has other keys (tensors and other
    leaves shared, so a load still fills them in place), `value` itself where nothing needs to change. Two keys
    of one dict with one str() (0 and "0") are a ConfigError naming both (`path`: where `value` is in the state)."""
    if isinstance(value, Mapping):
        items = {key: str_keyed(item, (*path, key)) for key, item in value.items()}
        if all(isinstance(key, str) and items[key] is value[key] for key in value):
            return value
        converted: dict[str, Any] = {}
        first: dict[str, Any] = {}
        for key, item in items.items():
            text = str(key)
            if text in converted:
                raise _collision((*path, first[text]), (*path, key), dotted((*path, key)))
            converted[text], first[text] = item, key
        return converted
    if isinstance(value, list) and not _is_value(value):
        listed = [str_keyed(item, (*path, index)) for index, item in enumerate(value)]
        return value if all(new is old for new, old in zip(listed, value)) else listed
    return value


def restore_keys(original: Any, loaded: Any) -> Any:
    """What a load filled into `str_keyed(original)`, put back under `original`'s own keys, in place where
    `original` is a dict or list (the loop keeps its references); returns the value to keep."""
    if loaded is original:
        return original
    if isinstance(original, MutableMapping) and isinstance(loaded, Mapping):
        own = {str(key): key for key in original}
        for text, value in loaded.items():
            key = own.get(text, text)
            original[key] = restore_keys(original[key], value) if key in original else value
        return original
    if isinstance(original, list) and isinstance(loaded, list) and len(original) == len(loaded):
        original[:] = [restore_keys(old, new) for old, new in zip(original, loaded)]
        return original
    return loaded
