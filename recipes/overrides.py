"""Command-line overrides checked before Hydra applies them: a typo gets "did you mean", not Hydra's hint.

Hydra answers `checkpoint.every_n_train_step=5` with "Could not override … To append to your config use
+checkpoint.every_n_train_step=5", and following that hint fails later with "unexpected keyword argument".
`unknown_keys` composes the config as Hydra will and names every override whose key does not exist with
the closest keys that do; `unexpected_argument` does the same for a `+key` that reached a constructor.
"""

from __future__ import annotations

import difflib
import inspect
import re
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, HydraException
from omegaconf import DictConfig, OmegaConf

NOT_A_KEY = re.compile(r"Could not override '([^']+)'")
_ABSENT = object()
# Python's own refusal, and a door's (CheckpointOptions.refuse_unknown) for a keyword it does not take
UNEXPECTED = re.compile(r"(?:unexpected keyword argument|\): unknown option) '([^']+)'")


def unknown_keys(config_dir: str, config_name: str, overrides: list[str]) -> list[str]:
    """One problem per override whose key the composed config lacks, with "did you mean"; [] when all exist.

    Composes up to once per bad key (each ~0.1 s); an override Hydra rejects for another reason (a sweep,
    a missing group option) is left for Hydra itself to report."""
    problems, remaining = [], list(overrides)
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        while True:
            try:
                config = compose(config_name, overrides=remaining)
                break
            except ConfigCompositionException as err:
                match = NOT_A_KEY.search(str(err))
                if match is None:
                    return []  # not ours to explain: Hydra reports it
                key = match.group(1)
                remaining = [o for o in remaining if _key_of(o) != key]
                problems.append((key, str(err.__cause__ or "").split("\n")[0]))
            except HydraException:  # a malformed override (`trainer.devices=[`): Hydra's message says where
                return []
    return [_explained(key, cause, config) for key, cause in problems]


def _explained(key: str, cause: str, config: DictConfig) -> str:
    """A key the config has was refused for what the override gives it (a dict given twice keeps the first's keys:
    `tiers.fast.peers={factor:2}` then `tiers.fast.peers={...,scan_local_roots:false}`); else "did you mean"."""
    try:
        exists = OmegaConf.select(config, key, throw_on_missing=False, default=_ABSENT) is not _ABSENT
    except Exception:  # noqa: BLE001 - a path through a value: not a key
        exists = False
    if not exists:
        return _did_you_mean(key, config)
    return f"{key}: Hydra could not apply it ({cause}); give {key} once, in one override with every key it needs"


def unexpected_argument(err: BaseException, target: Any, group: str) -> str | None:
    """For a refusal of an unexpected keyword of `target` (a class or function): which key, and the
    closest parameters it has; None for any other error."""
    match = UNEXPECTED.search(str(err))
    if match is None or target is None:
        return None
    key = match.group(1)
    parameters = [name for name in inspect.signature(target).parameters if name not in ("self", "args", "kwargs")]
    return f"{group}.{key}: {target.__name__} has no option {key!r}{_suggestion(key, parameters, group)}"


def _did_you_mean(key: str, config: DictConfig) -> str:
    """At the first segment of `key` the config lacks: the closest keys there (`chekpoint.keep_last` -> checkpoint)."""
    node: Any = config
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return f"{key}: {'.'.join(parts[:depth])} is a value, not a group of options"
        if part not in node:
            parent = ".".join(parts[:depth])
            known = [str(name) for name in node.keys() if not str(name).startswith("_")]  # not _target_
            rest = "." + ".".join(parts[depth + 1 :]) if depth + 1 < len(parts) else ""
            return f"{key}: no such option{_suggestion(part, known, parent, rest)}"
        node = node[part]
    return f"{key}: no such option"


def _suggestion(leaf: str, known: list[str], parent: str, rest: str = "") -> str:
    prefix = f"{parent}." if parent else ""
    close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.75)
    if close:
        return f"; did you mean {prefix}{close[0]}{rest}?"
    return f"; {parent or 'the config'} has: {', '.join(sorted(known))}"


def _key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")
