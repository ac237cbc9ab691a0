"""Whether a state a front door saves will load again with trust off: told when it is saved, not at a resume.

A load unpickles what a checkpoint holds besides tensors through allow-lists (engine/format/safe_pickle.py): DCP's
object records as torch's weights_only loader would, a front door's pickled section (the Trainer's "lightning",
Fabric's "fabric", the Checkpointer's own) with Lightning's plain types too. A value of another class saves
fine and is refused only when the checkpoint is loaded, often by another job weeks later. `unloadable` unpickles
what a save holds the way a load would and names each value it would refuse, and the class, so the first save
holding it can say which option will load it.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..engine.format import safe_pickle
from .state_keys import check_keys, leaves, shown

log = logging.getLogger(__name__)

# what every load unpickles (torch's weights_only set): these builtin types exactly, not their subclasses (an IntEnum
# member is an int whose class a load refuses); frozenset is not among them
_PLAIN_SCALARS = frozenset({type(None), bool, int, float, complex, str, bytes, bytearray})
_PLAIN_CONTAINERS = frozenset({list, tuple, dict, set})
_MAX_PLAIN_DEPTH = 64  # deeper: the round trip through torch.save decides


def is_plain(value: Any, depth: int = 0) -> bool:
    """Whether `value` is builtin scalars in builtin containers only, which every load unpickles: told without
    pickling it, at C speed per container (`set(map(type, ...))`): a list of a million ints takes ~20 ms here, the
    round trip through torch.save and the bounded unpickler ~3 s, on the training thread, at every save."""
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return True
    if kind not in _PLAIN_CONTAINERS or depth >= _MAX_PLAIN_DEPTH:
        return False
    for part in (value.keys(), value.values()) if kind is dict else (value,):
        kinds = set(map(type, part))
        if kinds <= _PLAIN_SCALARS:
            continue
        if not kinds <= _PLAIN_SCALARS | _PLAIN_CONTAINERS:
            return False
        if not all(is_plain(item, depth + 1) for item in part if type(item) in _PLAIN_CONTAINERS):
            return False
    return True


def unloadable(state: Mapping[str, Any], pickled_sections: Mapping[str, Iterable[str]]) -> list[tuple[str, str]]:
    """(what, blocked `module.qualname`) for each value of the DCP `state` a load with trust off would refuse.

    `pickled_sections`: top-level keys whose bytes a front door unpickles itself, with the globals it allows there."""
    found = []
    for path, value in leaves(state):
        section = path[0] if len(path) == 1 and path[0] in pickled_sections else None
        if section is not None and isinstance(value, (bytes, bytearray)):
            blocked = _blocked_in_pickle(bytes(value), pickled_sections[section])
            what = f"the pickled section {section!r} (state the front door keeps beside the tensors)"
        elif isinstance(value, torch.Tensor) or is_plain(value):
            continue
        else:
            blocked = _blocked_in_object(value)
            what = shown(path)
        if blocked:
            found.append((what, blocked))
    return found


def _blocked_in_pickle(data: bytes, allowed: Iterable[str]) -> str | None:
    try:
        safe_pickle.loads(data, allowed)
    except safe_pickle.OversizedAllocation:
        return None  # not a class the user can allow; a load says what is wrong
    except safe_pickle.BlockedGlobal as err:
        return err.name
    return None


def _blocked_in_object(value: Any) -> str | None:
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)  # what DCP writes for an object
    except Exception:  # noqa: BLE001 - not picklable at all: the save itself reports it
        return None
    return _blocked_in_record(buffer.getvalue())


def _blocked_in_record(data: bytes) -> str | None:
    try:
        safe_pickle.load_torch_record(data)
    except safe_pickle.OversizedAllocation:
        return None
    except safe_pickle.BlockedGlobal as err:
        return err.name
    return None


def warn_unloadable(found: list[tuple[str, str]], *, trust_option: str) -> None:
    """One warning per class a load would refuse, naming where it is and the two options that load it."""
    by_class: dict[str, list[str]] = {}
    for what, blocked in found:
        by_class.setdefault(blocked, []).append(what)
    for blocked, places in by_class.items():
        log.warning(
            "%s holds a %s, which a load refuses unless it trusts the checkpoint (the class is not on the allow-list "
            "of what a checkpoint may hold: unpickling it could run code). This checkpoint saves, but loads only with "
            "%s, or with the class allowed in every process that loads it (resume, drills): "
            "torch.serialization.add_safe_globals([%s]). Or save plain values (its state_dict()) instead",
            ", ".join(places[:3]) + (f" and {len(places) - 3} more" if len(places) > 3 else ""),
            blocked,
            trust_option,
            blocked.rsplit(".", 1)[-1],
        )


class SaveChecks:
    """What a front door checks of the DCP state at each save, before anything is written: names that collide
    (refused on every rank, training/state_keys.py) and values a load would refuse (a warning on rank 0, once per
    value and class: at the first save that holds it)."""

    def __init__(self, *, trust_option: str, pickled_sections: Mapping[str, Iterable[str]]) -> None:
        self.trust_option = trust_option
        self.pickled_sections = dict(pickled_sections)
        self.warned: set[tuple[str, str]] = set()

    def __call__(self, state: Mapping[str, Any], *, trust: bool, rank: int) -> None:
        check_keys(state)  # the same state, so the same verdict, on every rank
        if rank == 0 and not trust:
            new = [found for found in unloadable(state, self.pickled_sections) if found not in self.warned]
            self.warned.update(new)
            warn_unloadable(new, trust_option=self.trust_option)
