"""A plain loop's state dict, to and from the DCP state the engine saves.

The loop hands the Checkpointer the objects it trains, by name: `{"model": model, "optim": optimizer,
"sched": scheduler, "step": 0}`. Each value becomes DCP state by its kind:

- a `torch.nn.Module` (plain, DDP, FSDP2): its model state dict (`get_model_state_dict`: sharded stays sharded);
- a `torch.optim.Optimizer`: its state keyed by parameter names (`get_optimizer_state_dict` with the state's
  one module), so it reshards and loads into a fresh optimizer;
- anything with `state_dict()` and `load_state_dict()` (an LR scheduler, your own counters): its state dict;
- anything else (tensors, numbers, nested dicts): as is.

A load fills the same structure in place (DCP reshards onto the current world size), then applies it: the
module and optimizer through `set_*_state_dict`, the others through `load_state_dict`, plain values back
into the user's dict. Dicts with keys other than strings (`{0: 11}`) travel under their `str()` and come back
under their own keys (training/state_keys.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from ..errors import ConfigError
from .door_targets import DoorTarget
from .state_keys import restore_keys, str_keyed

RESERVED_KEY = "checkpointer"  # the Checkpointer's own section (data position, RNG, plug-ins)


def check_state(state: Any) -> None:
    """A dict of named objects, without the Checkpointer's own key; an optimizer needs exactly one module."""
    if not isinstance(state, dict) or not state:
        raise ConfigError(
            f"the checkpoint state must be a non-empty dict of named objects, got {type(state).__name__}; "
            "pass e.g. {'model': model, 'optim': optimizer}"
        )
    if RESERVED_KEY in state:
        raise ConfigError(f"state[{RESERVED_KEY!r}] is the Checkpointer's own entry; rename yours")
    optimizers = [key for key, value in state.items() if isinstance(value, torch.optim.Optimizer)]
    if optimizers:
        _module_of(state, optimizers[0])


def _module_of(state: dict[str, Any], optimizer_key: str) -> torch.nn.Module:
    modules = [value for value in state.values() if isinstance(value, torch.nn.Module)]
    if len(modules) != 1:
        raise ConfigError(
            f"state[{optimizer_key!r}] is an optimizer and the state holds {len(modules)} modules: its state is saved "
            "by parameter name, which needs exactly one module; put the model in the state next to it (or wrap several "
            "models in one torch.nn.ModuleDict)"
        )
    return modules[0]


def door_target(state: dict[str, Any], *, strict: bool) -> DoorTarget:
    """What a Checkpointer load fills: the user's entries by name (live tensors fill in place), its own section."""
    entries: dict[tuple[str, ...], Any] = {(key,): value for key, value in to_dcp(state).items()}
    entries[(RESERVED_KEY,)] = b""
    modules = [key for key, value in state.items() if is_module(value)]
    return DoorTarget(
        entries,
        model=(modules[0],) if len(modules) == 1 else None,
        optimizers=tuple((key,) for key, value in state.items() if is_optimizer(value)),
        own=(RESERVED_KEY,),
        strict=strict,
        strict_hint="load(state, strict=False)",
    )


def is_module(value: Any) -> bool:
    return isinstance(value, torch.nn.Module)


def is_optimizer(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer)


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def to_dcp(state: dict[str, Any]) -> dict[str, Any]:
    """The DCP state of the user's objects: live tensors, no copies (the saver stages them; a load fills them)."""
    dcp_state: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            dcp_state[key] = get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            dcp_state[key] = get_optimizer_state_dict(_module_of(state, key), value)
        elif is_stateful(value):
            dcp_state[key] = str_keyed(value.state_dict(), (key,))
        else:
            dcp_state[key] = str_keyed(value, (key,))
    return dcp_state


def apply_loaded(state: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Put what a load filled into `loaded` (from `to_dcp(state)`) into the user's objects; an entry `loaded`
    lacks (a partial load: the checkpoint had nothing for it) keeps its value."""
    for key, value in state.items():
        if key not in loaded:
            continue
        if isinstance(value, torch.nn.Module):
            set_model_state_dict(value, loaded[key])
        elif isinstance(value, torch.optim.Optimizer):
            set_optimizer_state_dict(_module_of(state, key), value, loaded[key])
        elif is_stateful(value):
            value.load_state_dict(_own_keys(value, loaded[key]))
        else:
            state[key] = restore_keys(value, loaded[key])  # a dict refilled in place; a number or tensor replaced


def _own_keys(stateful: Any, loaded: Any) -> Any:
    """What a load filled for `stateful`, under the keys of its own state dict where those are not strings."""
    template = stateful.state_dict()
    return restore_keys(template, loaded) if str_keyed(template) is not template else loaded


def deferrable(state: dict[str, Any]) -> Callable[[str], bool]:
    """Flattened keys whose tensors change only in the optimizer step (parameters, optimizer state): their
    staging copy may overlap the next forward and backward, fenced before the step. Buffers (BatchNorm
    statistics) change in forward: copied at the request."""
    parameters = {
        f"{key}.{name}"
        for key, value in state.items()
        if isinstance(value, torch.nn.Module)
        for name, _ in _unwrapped(value).named_parameters()
    }
    optimizers = tuple(f"{key}." for key, value in state.items() if isinstance(value, torch.optim.Optimizer))
    return lambda fqn: fqn in parameters or fqn.startswith(optimizers)


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The module whose parameter names the model state dict uses (DDP's `module.`, compile's `_orig_mod.` go)."""
    while True:
        inner = getattr(module, "module", None) if isinstance(module, DistributedDataParallel) else None
        inner = inner if inner is not None else getattr(module, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner


def optimizers_of(state: dict[str, Any]) -> list[torch.optim.Optimizer]:
    return [value for value in state.values() if isinstance(value, torch.optim.Optimizer)]
