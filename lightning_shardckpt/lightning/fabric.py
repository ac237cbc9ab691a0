"""ShardedFabricStrategy: `fabric.save(path, state)` / `fabric.load(path, state)` through the lightning_shardckpt engine.

`ShardedFabricStrategy(parallelism="ddp")` builds a Fabric DDPStrategy, `parallelism="fsdp"` a Fabric
ModelParallelStrategy (FSDP2 / DTensor, sharded by `parallelize_fn`); `Fabric(strategy="shardckpt_ddp")` and
`"shardckpt_fsdp"` name them in Fabric's registry (the Trainer's registry has its own entries of the same names).

- `fabric.save(path, state)`: `path` is a checkpoint root; each save becomes one committed checkpoint under it,
  named by the state's step (`step_key`, else the first of step / global_step / step_count / iter_num). It
  returns once the state is staged (copied); the write, read-back and commit run in the background. A save
  waits for the previous one of the same root; a save to another root first waits for the previous root's
  commits. `close()` (also at `teardown()` and at interpreter exit) waits for the last commit.
- `fabric.load(path, state)`: `path` is a root (its latest committed checkpoint), a checkpoint directory, or,
  relative to `root=`, "latest" (an empty root: nothing is restored, as the Trainer's resume), "last-good", a
  step, an id. Models and optimizers are restored resharded onto this world size, plain values and
  `load_state_dict` objects from the pickled rest (through the allow-list), the sampler's position and every
  rank's RNG. Checkpoints the Trainer wrote (ShardedStrategy) load too: see lightning/fabric_state.py.
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy, ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
from torch.optim import Optimizer

from ..engine.collectives import new_checkpoint_group, rank_and_world
from ..engine.config import LoadConfig, SaveConfig, save_config_from
from ..engine.format import safe_pickle
from ..engine.load.loader import LoadResult, load_checkpoint
from ..engine.save.saver import CheckpointSaver, PendingSave
from ..engine.storage import fsio
from ..errors import ConfigError
from ..training.data import ResumableDistributedSampler, gather_rng_states, restore_rng_state, rng_state_for_rank
from ..training.loadable import SaveChecks
from . import fabric_sources, fabric_state
from .fabric_sampler import use_fabric_sampler
from .lightning_state import MODEL_KEY, OPTIMIZERS_KEY
from .strategy import PARALLELISMS, mesh_sizes

log = logging.getLogger(__name__)


class ShardedFabricStrategy:
    """Base of the sharded Fabric strategies; calling it builds the one for `parallelism`.

    Options (keyword-only, besides the Fabric strategy's own): `root` (where "latest", steps and ids passed to
    `fabric.load` resolve), `save` (SaveConfig or dict), `load` (LoadConfig or dict), `resume_required`
    ("latest" on an empty root raises instead of starting fresh), `step_key` (the state entry that names a
    save's step), `restore_rng` (save every rank's RNG and restore it on load; default True).
    """

    parallelism: str = "unknown"

    def __new__(cls, *args: Any, parallelism: str = "fsdp", **kwargs: Any):
        if cls is ShardedFabricStrategy:
            if parallelism not in PARALLELISMS:
                raise ConfigError(
                    f"parallelism={parallelism!r} is unknown; use 'ddp' (replicated) or 'fsdp' (FSDP2 sharded)"
                )
            cls = ShardedFabricDDPStrategy if parallelism == "ddp" else ShardedFabricFSDPStrategy
        return super().__new__(cls)

    def _init_checkpointing(
        self,
        *,
        root: str | None,
        save: SaveConfig | dict | None,
        load: LoadConfig | dict | None,
        resume_required: bool,
        step_key: str | None,
        restore_rng: bool,
        fault_hook: Any,
    ) -> None:
        self.root = str(root) if root is not None else None
        self.save_config = save_config_from(save or {}, parallelism=self.parallelism)
        self.load_config = load if isinstance(load, LoadConfig) else LoadConfig(**(load or {}))
        self.resume_required = resume_required
        self.step_key = step_key
        self.restore_rng = restore_rng
        self.last_save: PendingSave | None = None
        self.last_load: LoadResult | None = None
        self._fault_hook = fault_hook
        self._group: Any = None
        self._saver: CheckpointSaver | None = None
        self._saver_path: str | None = None
        self._saver_outlived = False  # a closed saver's thread outlived its timeout: the group must stay
        self._guarded: dict[int, Any] = {}  # id(optimizer) -> its step pre-hook's handle
        self._run_id_given = self.save_config.run_id is not None
        self._resumed_run: tuple[str | None, str | None] = (None, None)  # (root path, run id) of the last load
        self._last_step = -1  # saved or loaded: a state without a step is saved as the next one
        self._save_checks = SaveChecks(
            trust_option="ShardedFabricStrategy(load={'trust_checkpoint': True})",
            pickled_sections={fabric_state.FABRIC_KEY: safe_pickle.LIGHTNING_STATE_GLOBALS},
        )
        reference = weakref.ref(self)
        atexit.register(lambda: (strategy := reference()) is not None and strategy.close())

    # --- what Fabric asks of a strategy ---
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Any] | None = None,  # noqa: A002 - Fabric's name
    ) -> None:
        """`fabric.save(path, state)`: stage `state` as the next checkpoint of root `path` and return."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported; pass "
                "save={'storage_options': ...} to the strategy"
            )
        if filter is not None:
            raise NotImplementedError(
                f"fabric.save(filter=...) is not supported by {type(self).__name__}: a sharded checkpoint is loaded "
                "by its full key set; save everything, and load with strict=False to skip what you do not need"
            )
        path = str(self.broadcast(str(path)))  # rank 0's, as Fabric's own strategies: every rank one root
        parts = fabric_state.split(state)
        step = fabric_state.step_of(parts, self.step_key)
        step = self._last_step + 1 if step is None else step
        saver = self._saver_for(path)
        rng = gather_rng_states() if self.restore_rng else None  # every rank's: a collective on the training group
        dcp_state = fabric_state.to_dcp_state(parts, rng)
        self._save_checks(dcp_state, trust=self.load_config.trust_checkpoint, rank=self.global_rank)
        if saver.config.overlap_staging:
            self._guard(parts.optimizers.values())
        updated_in_step = self._parameters_or_optimizer_state(parts)
        self.last_save = saver.save(
            dcp_state,
            step=step,
            epoch=_plain_int(parts.values.get("epoch")),
            samples_consumed=fabric_state.samples_consumed(parts),
            identical=updated_in_step,
            defer=updated_in_step,
        )
        self._last_step = step

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """`fabric.load(path, state)`: restore `state` in place; returns what the checkpoint holds besides it."""
        if os.path.isfile(str(path)):
            # a plain torch file, not a checkpoint of ours: Fabric's own loading (LitGPT's fine-tuning scripts
            # start from converted weights with fabric.load_raw("lit_model.pth", model))
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if isinstance(state, torch.nn.Module):  # fabric.load_raw(path, model)
            self.load_checkpoint(path, {"model": state}, strict=strict)
            return {}
        if isinstance(state, Optimizer) or not state:
            raise ValueError(
                f"{type(self).__name__} loads into a state dict, got state={state!r}: pass the objects to restore, "
                "e.g. fabric.load(path, {'model': model, 'optimizer': optimizer, 'step': 0})"
            )
        self.wait()  # the load's collectives share the checkpoint group with the saver's thread: one at a time
        root, which, fresh_if_empty = fabric_sources.resolve_source(str(self.broadcast(str(path))), self.root)
        picked = fabric_sources.pick(
            root,
            which,
            fresh_if_empty=fresh_if_empty,
            resume_required=self.resume_required,
            storage_options=self.load_config.storage_options,
            group=self.checkpoint_group(),
        )
        if picked is None:
            return {}
        checkpoint, step, blob_key = picked.path, picked.step, picked.blob_key
        parts = fabric_state.split(state)
        target = fabric_state.load_target(parts, blob_key)
        self.last_load = load_checkpoint(
            target, checkpoint, config=self.load_config, strict=strict, process_group=self.checkpoint_group()
        )
        self._apply_tensors(parts, target, strict)
        if blob_key is None:
            rest = fabric_state.SavedRest(values={}, stateful={}, rng=None, sampler=None)
        else:
            rest = fabric_state.saved_rest(target, blob_key, trust=self.load_config.trust_checkpoint, where=checkpoint)
        remainder = self._apply_rest(parts, rest, state, strict, checkpoint)
        self._last_step = step
        self._resumed_run = (picked.root_path, picked.run_id)
        return remainder

    def process_dataloader(self, dataloader: Any) -> Any:
        # the DistributedSampler Fabric put in becomes ours: same order, a position a checkpoint can carry
        return use_fabric_sampler(super().process_dataloader(dataloader))

    def teardown(self) -> None:
        try:
            self.close()
        finally:
            if self._group is not None and not self._saver_outlived:  # a worker still running keeps its group
                dist.destroy_process_group(self._group)
                self._group = None
            super().teardown()

    # --- for the training loop ---
    def wait_for_staging(self) -> float:
        """Block until the last save's state is copied (seconds blocked). Optimizer steps fence by themselves;
        code that changes parameters or optimizer state another way must call this first."""
        return self._saver.fence() if self._saver is not None else 0.0

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every save requested so far finished (committed or failed); False if `timeout` passed."""
        return self._saver.wait(timeout) if self._saver is not None else True

    def close(self) -> bool:
        """Wait (up to save.teardown_timeout_s) for the last save to commit and stop the saver; saving again
        starts a new one. Call it on every rank before the process group goes (teardown and exit call it).
        True when no saver thread runs any more (False: one outlived the timeout and still uses the group)."""
        saver, self._saver, self._saver_path = self._saver, None, None
        for handle in self._guarded.values():
            handle.remove()
        self._guarded = {}
        if saver is None:
            return not self._saver_outlived
        try:
            saver.close()  # may raise a background save's error (save.on_error="raise") once the worker stopped
        finally:
            self._saver_outlived = not saver.stopped
        return saver.stopped

    def checkpoint_group(self) -> Any:
        """The dedicated gloo group for checkpoint collectives (created once, on first use, on every rank)."""
        if self._group is None:
            self._group = new_checkpoint_group(self.save_config.collective_timeout_s)
        return self._group

    @property
    def fault_hook(self) -> Any:
        """Tests only: the constructor's `fault_hook`, failing saves at named points."""
        return self._fault_hook

    # --- internals ---
    def _saver_for(self, path: str) -> CheckpointSaver:
        if self._saver is not None and self._saver_path != path:
            log.info("saving to %s: waiting for the saves to %s to commit first", path, self._saver_path)
            self.close()  # one saver (one host copy of the state) at a time
        if self._saver is None:
            config = self.save_config
            resumed_root, resumed_run_id = self._resumed_run
            if (
                not self._run_id_given
                and resumed_run_id
                and fsio.resolve(path, config.storage_options).path == resumed_root
            ):
                # saving into the root this run resumed from continues that run: its id, so the root's owner
                # check lets it in and `latest` orders the new commits after the ones it resumed from
                config = self.save_config = save_config_from(config, run_id=resumed_run_id)
            self._saver = CheckpointSaver(path, config, group=self.checkpoint_group(), fault_hook=self._fault_hook)
            self._saver_path = path
            if self.save_config.run_id is None:  # every later root of this run records the same id
                self.save_config = save_config_from(self.save_config, run_id=self._saver.run_id)
        return self._saver

    def _guard(self, optimizers: Any) -> None:
        """Fence before each optimizer step: the staging copy of parameters and optimizer state overlaps the
        next forward and backward, and must be complete before the update changes them."""
        for optimizer in optimizers:
            if id(optimizer) not in self._guarded:
                self._guarded[id(optimizer)] = optimizer.register_step_pre_hook(self._fence_before_step)

    def _fence_before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.wait_for_staging()  # a step pre-hook returns None (or replacement arguments)

    @staticmethod
    def _parameters_or_optimizer_state(parts: fabric_state.FabricParts):
        """Flattened keys that only the optimizer step changes and that gradient sync keeps identical on every
        rank: written from any rank, copied while the next batch runs (buffers are not: rank 0's, at once)."""
        names = () if parts.module is None else fabric_state.inner_module(parts.module).named_parameters()
        parameters = {f"{MODEL_KEY}.{name}" for name, _ in names}
        optimizers = f"{OPTIMIZERS_KEY}."
        return lambda fqn: fqn in parameters or fqn.startswith(optimizers)

    def _apply_tensors(self, parts: fabric_state.FabricParts, target: dict[str, Any], strict: bool) -> None:
        if parts.module is None:
            return
        set_model_state_dict(parts.module, target[MODEL_KEY], options=StateDictOptions(strict=strict))
        manifest = self.last_load.manifest
        saved = [item["fqn"] for kind in ("objects", "tensors") for item in manifest.get(kind, [])]
        for index, optimizer in enumerate(parts.optimizers.values()):
            prefix = f"{OPTIMIZERS_KEY}.{index}.param_groups."  # flattened: one entry per group option
            if any(fqn.startswith(prefix) for fqn in saved):  # strict=False: one the checkpoint lacks stays as is
                set_optimizer_state_dict(parts.module, optimizer, target[OPTIMIZERS_KEY][str(index)])

    def _apply_rest(
        self,
        parts: fabric_state.FabricParts,
        rest: fabric_state.SavedRest,
        state: dict[str, Any],
        strict: bool,
        where: str,
    ) -> dict[str, Any]:
        """Plain values into `state`, states into their objects, RNG per rank; returns what was not asked for."""
        for key, obj in parts.stateful.items():
            if key in rest.stateful:
                obj.load_state_dict(rest.stateful[key])
            elif isinstance(obj, ResumableDistributedSampler) and rest.sampler is not None:
                obj.load_state_dict(rest.sampler)  # a Trainer checkpoint's data position
            elif strict:
                raise _missing(key, where)
        for key in parts.values:
            if key in rest.values:
                state[key] = rest.values[key]
            elif strict:
                raise _missing(key, where)
        if self.restore_rng and rest.rng:
            restore_rng_state(rng_state_for_rank(rest.rng, rank_and_world()[0]))
        remainder = {key: value for key, value in rest.values.items() if key not in parts.values}
        remainder.update({key: value for key, value in rest.stateful.items() if key not in parts.stateful})
        return remainder


def _missing(key: str, where: str) -> KeyError:
    return KeyError(
        f"the state asks for {key!r}, which {where} does not hold; load with strict=False to keep its current value"
    )


def _plain_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class ShardedFabricDDPStrategy(ShardedFabricStrategy, DDPStrategy):
    """Fabric DDP (replicated parameters) with sharded, asynchronous, committed checkpoints."""

    strategy_name = "shardckpt_ddp"
    parallelism = "ddp"

    def __init__(
        self,
        *args: Any,
        parallelism: str = "ddp",
        root: str | None = None,
        save: SaveConfig | dict | None = None,
        load: LoadConfig | dict | None = None,
        resume_required: bool = False,
        step_key: str | None = None,
        restore_rng: bool = True,
        fault_hook: Any = None,
        **kwargs: Any,
    ) -> None:
        DDPStrategy.__init__(self, *args, **kwargs)
        self._init_checkpointing(
            root=root,
            save=save,
            load=load,
            resume_required=resume_required,
            step_key=step_key,
            restore_rng=restore_rng,
            fault_hook=fault_hook,
        )

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        registry.register(cls.strategy_name, cls, description="Fabric DDP with lightning_shardckpt checkpoints")


class ShardedFabricFSDPStrategy(ShardedFabricStrategy, ModelParallelStrategy):
    """Fabric FSDP2 / DTensor (ModelParallelStrategy) with sharded, asynchronous, committed checkpoints.

    Without a `parallelize_fn`, every child module holding parameters and then the root are `fully_shard`-ed
    over all ranks (`shard_children`); pass your own for tensor parallelism or another wrapping.
    """

    strategy_name = "shardckpt_fsdp"
    parallelism = "fsdp"

    def __init__(
        self,
        parallelize_fn: Any = None,
        *args: Any,
        parallelism: str = "fsdp",
        root: str | None = None,
        save: SaveConfig | dict | None = None,
        load: LoadConfig | dict | None = None,
        resume_required: bool = False,
        step_key: str | None = None,
        restore_rng: bool = True,
        fault_hook: Any = None,
        **kwargs: Any,
    ) -> None:
        ModelParallelStrategy.__init__(self, parallelize_fn or shard_children, *args, **kwargs)
        self._init_checkpointing(
            root=root,
            save=save,
            load=load,
            resume_required=resume_required,
            step_key=step_key,
            restore_rng=restore_rng,
            fault_hook=fault_hook,
        )

    def teardown(self) -> None:
        try:
            super().teardown()
        except NotImplementedError:
            # Fabric's own ModelParallelStrategy.teardown ends by tearing down its checkpoint_io, which it refuses
            # to have (Fabric never calls it); what comes before that (ours, precision, accelerator) has run
            log.debug("ModelParallelStrategy.teardown: no checkpoint_io to tear down", exc_info=True)

    def setup_environment(self) -> None:
        # Fabric's "auto" sizes are data_parallel=num_nodes, tensor_parallel=devices (as the Trainer's, see
        # lightning/strategy.py): ours are data-parallel over every rank unless sizes are given
        self._data_parallel_size, self._tensor_parallel_size = mesh_sizes(
            self._data_parallel_size, self._tensor_parallel_size, self.num_nodes * self.num_processes
        )
        super().setup_environment()

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        registry.register(cls.strategy_name, cls, description="Fabric FSDP2 with lightning_shardckpt checkpoints")


def shard_children(module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
    """The default `parallelize_fn`: FSDP2 on each child module that holds parameters, then on the root."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def register() -> None:
    """`Fabric(strategy="shardckpt_ddp" / "shardckpt_fsdp")`: Fabric's registry, separate from the Trainer's."""
    for strategy in (ShardedFabricDDPStrategy, ShardedFabricFSDPStrategy):
        if strategy.strategy_name not in STRATEGY_REGISTRY:
            strategy.register_strategies(STRATEGY_REGISTRY)
