"""Between a Fabric state dict (`fabric.save(path, state)`) and the DCP state we save.

A Fabric state holds live objects next to plain values: {"model": module, "optimizer": opt, "iter_num": 3,
"train_dataloader": loader, ...}. What becomes what, in the Trainer's layout (lightning/lightning_state.py), so
either front door reads the other's weights and optimizer states:

- the one `nn.Module` (whatever its key)            -> "model"          (Trainer: the LightningModule's state_dict)
- the optimizers, in the state's order              -> "optimizers.0.." (Trainer: optimizers in configure_optimizers order)
- everything else, pickled as one blob              -> "fabric"         (Trainer: "lightning", loops, callbacks, ...)
  - plain values (ints, floats, strings, tensors, containers): as they are
  - objects with `state_dict` / `load_state_dict` (LR schedulers, a ResumableDistributedSampler, a loader whose
    sampler is one): their `state_dict()`, given back through `load_state_dict`
  - every rank's RNG state, under a reserved name, restored per rank (training/data.py's rule on a resize)

The blob is read back through the safe_pickle allow-list (torch's weights_only set plus Lightning's plain types):
a checkpoint from elsewhere cannot run code on load; `trust_checkpoint=True` lifts that for trusted ones.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from ...engine.format import safe_pickle
from ...errors import ConfigError, IncompatibleCheckpoint
from ...training.data import ResumableDistributedSampler
from ...training.door_targets import DoorTarget
from ..lightning_state import LIGHTNING_KEY, MODEL_KEY, OPTIMIZERS_KEY, lightning_rest

FABRIC_KEY = "fabric"  # the pickled rest of a Fabric state
BLOB_VERSION = 1
STEP_KEYS = ("step", "global_step", "step_count", "iter_num")  # a state's step, first found (LitGPT: step_count)


@dataclass
class FabricParts:
    """A Fabric state split by how each entry is saved (keys are the state's own)."""

    module_key: str | None = None
    module: torch.nn.Module | None = None
    optimizers: dict[str, Optimizer] = field(default_factory=dict)  # in the state's order: optimizers.0, .1, ...
    stateful: dict[str, Any] = field(default_factory=dict)  # objects restored through load_state_dict
    values: dict[str, Any] = field(default_factory=dict)  # plain values, handed back as they were saved


def split(state: dict[str, Any]) -> FabricParts:
    """Sort a (Fabric-unwrapped) state; a ConfigError names an entry that cannot be saved and the fix."""
    parts = FabricParts()
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            if parts.module is not None:
                raise ConfigError(
                    f"the state holds two models ({parts.module_key!r} and {key!r}); a sharded checkpoint holds one "
                    "model and its optimizers: save the other model to a root of its own"
                )
            parts.module_key, parts.module = key, value
        elif isinstance(value, Optimizer):
            parts.optimizers[key] = value
        elif isinstance(value, DataLoader):
            sampler = resumable_sampler(value)
            if sampler is None:
                raise ConfigError(
                    f"state[{key!r}] is a DataLoader whose sampler is a {type(value.sampler).__name__}: its position "
                    "cannot be saved. Set it up with fabric.setup_dataloaders under ShardedFabricStrategy (which gives "
                    "it a ResumableDistributedSampler), or leave it out of the state"
                )
            parts.stateful[key] = sampler
        elif callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            parts.stateful[key] = value
        else:
            parts.values[key] = value
    if parts.optimizers and parts.module is None:
        raise ConfigError(
            f"the state holds optimizer(s) {sorted(parts.optimizers)} but no model; their state is keyed by the "
            "model's parameter names: add the model, e.g. state={'model': model, 'optimizer': optimizer}"
        )
    return parts


def resumable_sampler(loader: Any) -> ResumableDistributedSampler | None:
    """The loader's ResumableDistributedSampler (as its sampler, or its batch sampler's), else None."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(sampler, ResumableDistributedSampler):
            return sampler
    return None


def step_of(parts: FabricParts, step_key: str | None) -> int | None:
    """The step a save is named by: `step_key`'s value, else the first of STEP_KEYS the state holds."""
    for key in (step_key,) if step_key is not None else STEP_KEYS:
        value = parts.values.get(key)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        if step_key is not None:
            raise ConfigError(
                f"step_key={step_key!r} but state[{step_key!r}] is {value!r}; it must be an int >= 0 in every saved state"
            )
    return None


def samples_consumed(parts: FabricParts) -> int | None:
    """Samples consumed since the start (epochs x dataset + position) of the first resumable sampler, if any."""
    for value in parts.stateful.values():
        if isinstance(value, ResumableDistributedSampler):
            return value.epoch * value.dataset_length + value.global_position
    return None


def inner_module(module: torch.nn.Module) -> torch.nn.Module:
    """The user's module under Fabric's DDP wrapper (FSDP2 shards in place and has none)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def to_dcp_state(
    parts: FabricParts, rng: list[dict[str, Any]] | None, plugins: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What DCP saves; the tensors are live (the saver stages a copy), the blob is pickled now. `plugins`: the
    plug-ins' states by state_key (PluginList.state_dict), which a Fabric resume gives back to them."""
    state: dict[str, Any] = {}
    if parts.module is not None:
        state[MODEL_KEY] = get_model_state_dict(parts.module)
        state[OPTIMIZERS_KEY] = {
            str(index): get_optimizer_state_dict(parts.module, optimizer)
            for index, optimizer in enumerate(parts.optimizers.values())
        }
    blob = {
        "version": BLOB_VERSION,
        "module_key": parts.module_key,
        "optimizer_keys": list(parts.optimizers),
        "values": parts.values,
        "stateful": {key: value.state_dict() for key, value in parts.stateful.items()},
        "rng": rng,
        "plugins": plugins or {},
    }
    # whether a load will unpickle it is checked as it is saved (training/loadable.py: the strategy's SaveChecks)
    state[FABRIC_KEY] = pickle.dumps(blob, protocol=pickle.HIGHEST_PROTOCOL)
    return state


def door_target(parts: FabricParts, *, strict: bool) -> DoorTarget:
    """What `fabric.load` fills (training/door_targets.py): live model tensors (loaded in place), fresh optimizer states,
    its own section; a Trainer checkpoint's "lightning" section is read in its place."""
    entries: dict[tuple[str, ...], Any] = {}
    if parts.module is not None:
        entries[(MODEL_KEY,)] = get_model_state_dict(parts.module)
        for index, optimizer in enumerate(parts.optimizers.values()):
            entries[(OPTIMIZERS_KEY, str(index))] = get_optimizer_state_dict(parts.module, optimizer)
    entries[(FABRIC_KEY,)] = b""
    return DoorTarget(
        entries,
        model=(MODEL_KEY,) if parts.module is not None else None,
        optimizers=tuple((OPTIMIZERS_KEY, str(index)) for index in range(len(parts.optimizers))),
        own=(FABRIC_KEY,),
        reads_own=(LIGHTNING_KEY,),
        strict=strict,
        strict_hint="fabric.load(path, state, strict=False)",
    )


@dataclass
class SavedRest:
    """What a checkpoint holds besides tensors, whichever front door wrote it."""

    values: dict[str, Any]  # by the names a Fabric state asks for
    stateful: dict[str, Any]  # state dicts by name
    rng: list[dict[str, Any]] | None
    sampler: dict[str, Any] | None  # a Trainer checkpoint's sampler position (ShardedCheckpoint's state)
    # the plug-ins' states by state_key (PluginList.load_state_dict); a Trainer checkpoint keeps them in
    # ShardedCheckpoint's state, beside the sampler position
    plugins: dict[str, Any] = field(default_factory=dict)


def saved_rest(loaded: dict[str, Any], blob_key: str, *, trust: bool, where: str) -> SavedRest:
    """The non-tensor part of a loaded checkpoint: a Fabric blob, or a Trainer's Lightning dict mapped onto names."""
    if blob_key == LIGHTNING_KEY:
        rest = lightning_rest(loaded, trust=trust, where=where)
        data_position = _trainer_data_position(rest)
        return SavedRest(
            values=rest,
            stateful={},
            rng=data_position.get("rng"),
            sampler=data_position.get("sampler") or None,
            plugins=data_position,
        )
    try:
        blob = safe_pickle.loads(loaded[FABRIC_KEY], safe_pickle.LIGHTNING_STATE_GLOBALS, trust=trust)
    except safe_pickle.BlockedGlobal as err:
        raise safe_pickle.untrusted(where, f"the Fabric state ({FABRIC_KEY!r}: plain values)", err.name) from err
    if not isinstance(blob, dict) or blob.get("version") != BLOB_VERSION:
        raise IncompatibleCheckpoint(
            f"{where}: the Fabric state has version {getattr(blob, 'get', lambda _: None)('version')!r}, this "
            f"lightning_shardckpt reads version {BLOB_VERSION}; load it with the version that wrote it"
        )
    return SavedRest(
        values=blob["values"],
        stateful=blob["stateful"],
        rng=blob.get("rng"),
        sampler=None,
        plugins=blob.get("plugins") or {},  # none in a checkpoint saved before the plug-ins' state was
    )


def _trainer_data_position(rest: dict[str, Any]) -> dict[str, Any]:
    """ShardedCheckpoint's state in a Trainer checkpoint ({"sampler", "rng", ...}); {} without one."""
    for name, state in (rest.get("callbacks") or {}).items():
        if str(name).startswith("ShardedCheckpoint") and isinstance(state, dict):
            return state
    return {}
