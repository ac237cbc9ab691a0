"""What a restore drill may unpickle: the same as the run whose checkpoint it restores.

A run that resumes a checkpoint holding the user's own class does so with `trust_checkpoint=True`, or with
the class in `torch.serialization.add_safe_globals` (engine/format/safe_pickle.py adds those to every
allow-list). A drill runs in fresh processes, which have neither: without the run's trust every drill
of such a checkpoint fails and none of the run's checkpoints ever becomes known-good.

So the drill carries the trust over: the flag, and each safe global by the name the drill process
imports it by (`module:qualname`, plus `=name` when it was added under another name). The drill
process imports and adds them before it loads (`allow_in_this_process`), and the drill record names
the trust it used (`label`): "allow-list", "allow-list+N globals" or "trusted".
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from ...errors import ConfigError

ALLOW_LIST, TRUSTED = "allow-list", "trusted"
MAIN = "__main__"  # a class of the script being run: a drill process runs another script, and cannot import it


def label(trust_checkpoint: bool, safe_globals: tuple[str, ...]) -> str:
    """How a drill unpickled, for its record."""
    if trust_checkpoint:
        return TRUSTED
    return f"{ALLOW_LIST}+{len(safe_globals)} globals" if safe_globals else ALLOW_LIST


def process_safe_globals() -> tuple[str, ...]:
    """The `torch.serialization.add_safe_globals` entries of this process, as specs a drill process imports.

    Only the ones the run added: torch registers its own classes (DTensor, NestedTensor, ...) in the same list
    when their modules are imported; they are torch's allow-list, which a drill process has as well.
    """
    import torch  # here: the `shardckpt drill` starter hands the drill to the pool and needs no torch

    specs = []
    for entry in torch.serialization.get_safe_globals():
        value, name = entry if isinstance(entry, tuple) else (entry, None)
        if value.__module__.split(".")[0] == "torch":
            continue
        spec = f"{value.__module__}:{value.__qualname__}"
        if name and name != f"{value.__module__}.{value.__qualname__}":
            spec += f"={name}"
        specs.append(spec)
    return tuple(sorted(set(specs)))


def spec_of(name: str) -> str:
    """`module.Qualname` (as a refused class is named) or `module:qualname` -> the `module:qualname` to import.

    Raises ConfigError naming the class and the fix when no prefix of the name imports as a module.
    """
    if ":" in name:
        module, _, qualname = name.partition(":")
        if _importable(module) and qualname:
            return name
    else:
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
            module = ".".join(parts[:cut])
            if _importable(module):
                return f"{module}:{'.'.join(parts[cut:])}"
    raise ConfigError(_not_importable(name))


def check_importable(specs: tuple[str, ...]) -> None:
    """Before drilling: every spec's module imports from here (drill processes get this process's sys.path)."""
    for spec in specs:
        module = spec.partition(":")[0]
        if module == MAIN or not _importable(module):
            raise ConfigError(_not_importable(spec.partition("=")[0].replace(":", ".")))


def allow_in_this_process(specs: tuple[str, ...] | list[str]) -> None:
    """In a drill process: import each spec's class and add it to torch's safe globals, as the run did."""
    import torch

    entries: list[Any] = []
    for spec in specs:
        target, _, alias = spec.partition("=")
        module, _, qualname = target.partition(":")
        value: Any = importlib.import_module(module)
        for part in qualname.split("."):
            value = getattr(value, part)
        entries.append((value, alias) if alias else value)
    torch.serialization.add_safe_globals(entries)


def _importable(module: str) -> bool:
    if module == MAIN:
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _not_importable(name: str) -> str:
    return (
        f"safe global {name}: its module cannot be imported from here, so a drill process could not allow it "
        "(a class defined in the training script's __main__ never can); move the class to a module on "
        "PYTHONPATH, or drill with trust_checkpoint (`shardckpt drill --trust`) if you trust the checkpoint"
    )
