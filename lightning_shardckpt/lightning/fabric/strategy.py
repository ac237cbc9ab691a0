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
  step, an id (training/resume.py, the resume of every door: tiers, fallbacks, the resume line). Models and
  optimizers are restored resharded onto this world size, plain values and `load_state_dict` objects from the
  pickled rest (through the allow-list), the sampler's position and every rank's RNG. Checkpoints the Trainer
  and the Checkpointer wrote load too (training/door_targets.py, lightning/fabric/fabric_state.py).
- Saves to the run's root (`root=`, else the first root saved to) run the save loop of every door
  (training/save_loop.py): retention (`keep_last`, `keep_every_n_steps`), `tiers`, restore `drill`s and `health`
  rules, with the options of ShardedCheckpoint and the Checkpointer.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy, ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ...engine.collectives import rank_and_world
from ...engine.config import FABRIC, LoadConfig, save_config_from
from ...engine.format import safe_pickle
from ...engine.load.loader import LoadResult
from ...engine.root import is_selector_file
from ...engine.save.saver import CheckpointSaver, PendingSave
from ...engine.storage import fsio
from ...engine.validate import require_bool
from ...policies.plan import CheckpointPlan, Placement
from ...policies.tiers.tiers_plugin import tiered_dirpath
from ...training.callback_options import CallbackConfig
from ...training.checkpoint_options import CheckpointOptions, DoorKeywords
from ...training.checkpoint_setup import checkpoint_plan, door_plugins
from ...training.data import ResumableDistributedSampler, gather_rng_states, restore_rng_state, rng_state_for_rank
from ...training.finished_saves import CallableReporter
from ...training.loadable import SaveChecks
from ...training.resume_sequence import announce_resume, load_resumed
from ...training.save_loop import SaveLoop
from ...training.savers import SaverHost, all_reduce_max_on_default_group
from ..lightning_state import MODEL_KEY, OPTIMIZERS_KEY
from ..parallelism import AllRanksDataParallel, register_in, shard_repeated_blocks, strategy_class
from . import fabric_state
from .sampler import use_fabric_sampler

if TYPE_CHECKING:
    # The base precedes Fabric's DDPStrategy or ModelParallelStrategy in both concrete classes (below), so every
    # instance is a Fabric ParallelStrategy: typed as one, its calls of broadcast, global_rank, super().teardown()
    # are checked against Fabric's signatures. At run time it is a plain mixin, ahead of the real one in the MRO.
    from lightning.fabric.strategies import ParallelStrategy as _FabricStrategy
else:
    _FabricStrategy = object

log = logging.getLogger(__name__)

# Fabric saves when the loop calls fabric.save (no schedule of ours), reads the load options from `load=`, and
# logs through `log_metrics=`
FABRIC_OPTIONS = DoorKeywords(
    "ShardedFabricStrategy",
    ("save", "resume_required", "keep_last", "keep_every_n_steps", "tiers", "drill", "health", "plugins"),
    why_not="Fabric saves when your loop calls fabric.save (no schedule), and takes the load options as "
    "load={'verify_checksums': ..., 'trust_checkpoint': ...}",
)


class ShardedFabricStrategy(_FabricStrategy):
    """Base of the sharded Fabric strategies; calling it builds the one for `parallelism`.

    Options (keyword-only, besides the Fabric strategy's own): `root` (the run's checkpoint root: where "latest",
    steps and ids passed to `fabric.load` resolve and where the plug-ins work), `save` (SaveConfig or dict), `load`
    (LoadConfig or dict), `resume_required` ("latest" on an empty root raises instead of starting fresh),
    `step_key` (the state entry that names a save's step), `restore_rng` (save every rank's RNG and restore it on
    load; default True), `keep_last` / `keep_every_n_steps` (retention), `tiers`, `drill`, `health` (as
    ShardedCheckpoint's), `log_metrics(values, step)` (rank 0's checkpoint metrics, e.g. `fabric.log_dict`),
    `plugins` (your own lightning_shardckpt.Plugin instances); or `options=CheckpointOptions(...)`. The checkpoint
    options are CheckpointOptions fields (training/checkpoint_options.py: FABRIC_OPTIONS says which).
    """

    parallelism: str = "unknown"
    num_nodes: int  # DDPStrategy's and ModelParallelStrategy's (Fabric's ParallelStrategy does not declare it)

    def __new__(cls, *args: Any, parallelism: str = "fsdp", **kwargs: Any) -> ShardedFabricStrategy:
        if cls is ShardedFabricStrategy:
            cls = strategy_class(parallelism, ddp=ShardedFabricDDPStrategy, fsdp=ShardedFabricFSDPStrategy)
        return super().__new__(cls)

    @FABRIC_OPTIONS.derive
    def _init_checkpointing(
        self,
        *,
        root: str | None = None,
        load: LoadConfig | dict[str, Any] | None = None,
        step_key: str | None = None,
        restore_rng: bool = True,
        log_metrics: Callable[[dict[str, float], int], Any] | None = None,
        fault_hook: Any = None,  # tests only: fail, stall or kill a rank at named points of a save
        options: CheckpointOptions | None = None,
        **given: Any,
    ) -> None:
        # validated now: bad options fail when the strategy is built, before Fabric starts any rank
        options = self.checkpoint_options = FABRIC_OPTIONS.build(given, options)
        self.options = CallbackConfig.saves_when_asked(
            keep_last=options.keep_last,
            keep_every_n_steps=options.keep_every_n_steps,
            resume_required=options.resume_required,
        )
        self.plugins, tiers_config = door_plugins(
            self.options, options.tiers, options.drill, options.health, options.plugins
        )
        self._save_options = save_config_from(options.save, parallelism=self.parallelism, front_door=FABRIC)
        self._load_options = load if isinstance(load, LoadConfig) else LoadConfig(**(load or {}))
        self._save_checks = SaveChecks(
            trust_option="ShardedFabricStrategy(load={'trust_checkpoint': True})",
            pickled_sections={fabric_state.FABRIC_KEY: safe_pickle.LIGHTNING_STATE_GLOBALS},
        )
        self.root = tiered_dirpath(root, tiers_config) if root or tiers_config else None
        self.step_key = step_key
        self.restore_rng = require_bool("ShardedFabricStrategy.restore_rng", restore_rng)  # "false" is truthy
        self.last_save: PendingSave | None = None
        self.last_load: LoadResult | None = None
        self.not_restored: tuple[str, ...] = ()  # after a load: what the checkpoint did not give back
        self._log_metrics = log_metrics
        self._fault_hook = fault_hook
        self._host: SaverHost | None = None  # made at first use: the processes exist by then
        self._loop: SaveLoop | None = None  # the run's save loop, once its root is known
        self._elsewhere: str | None = None  # the last root saved to outside the run's root (one saver at a time)
        self._resume_event: dict[str, Any] | None = None
        self._last_step = -1  # saved or loaded: a state without a step is saved as the next one
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
        request = self._request_of(parts, step)
        loop = self._run_loop(path)
        if loop is not None and self._is_run_root(loop, path):
            if not loop.started:
                # saves no reader could load are refused first (as at fabric.load, before a loop's first step)
                loop.start(
                    self.last_load,
                    resume_event=self._resume_event,
                    state=lambda: fabric_state.to_dcp_state(parts, None),
                )
            loop.drain()
            self.last_save = loop.save_now(step, request)
        else:  # a root other than the run's: a plain save, no plug-ins; one such root's saver at a time
            if self._elsewhere not in (None, path):
                log.info("saving to %s: waiting for the saves to %s to commit first", path, self._elsewhere)
                self.host.release(self._elsewhere)
            self._elsewhere = path
            self.last_save = request(self.host.saver_for(path), False)
        self._last_step = step

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """`fabric.load(path, state)`: restore `state` in place; returns what the checkpoint holds besides it."""
        if os.path.isfile(str(path)) and not is_selector_file(str(path)):
            # a plain torch file, not a checkpoint of ours (ROOT/latest, the pointer file, is: engine/root.py):
            # Fabric's own loading (LitGPT's fine-tuning scripts start from converted weights with
            # fabric.load_raw("lit_model.pth", model))
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if isinstance(state, torch.nn.Module):  # fabric.load_raw(path, model)
            self.load_checkpoint(path, {"model": state}, strict=strict)
            return {}
        if isinstance(state, Optimizer) or not state:
            raise ValueError(
                f"{type(self).__name__} loads into a state dict, got state={state!r}: pass the objects to restore, "
                "e.g. fabric.load(path, {'model': model, 'optimizer': optimizer, 'step': 0})"
            )
        reference = str(self.broadcast(str(path)))
        loop = self._run_loop(None)
        plan = loop.plan if loop is not None else self._plan_without_root()
        parts = fabric_state.split(state)
        target = fabric_state.door_target(parts, strict=strict)
        resumed = load_resumed(plan, self.host, target, reference, strict=strict, rank=self.global_rank)
        if resumed is None:
            return {}
        loaded = self.last_load = resumed.loaded
        self._apply_tensors(parts, target.restored(), strict)
        blob_key = resumed.layout.own_source  # "fabric", the Trainer's "lightning", or None (another door's)
        if blob_key is None:
            rest = fabric_state.SavedRest(values={}, stateful={}, rng=None, sampler=None)
        else:
            rest = fabric_state.saved_rest(
                {blob_key: target.own_section()}, blob_key, trust=plan.load.trust_checkpoint, where=loaded.path
            )
        remainder = self._apply_rest(parts, rest, state, strict, loaded.path)
        self.plugins.load_state_dict(rest.plugins)  # what each plug-in's state_dict() returned at that save
        self.not_restored = resumed.not_restored
        self._last_step = loaded.step
        self._resume_event = announce_resume(
            resumed, plan=plan, loop=loop, rank=self.global_rank, world_size=self.world_size
        )
        return remainder

    def process_dataloader(self, dataloader: Any) -> Any:
        # the DistributedSampler Fabric put in becomes ours: same order, a position a checkpoint can carry
        return use_fabric_sampler(super().process_dataloader(dataloader))

    def teardown(self) -> None:
        try:
            self.close()
        finally:
            super().teardown()

    # --- for the training loop ---
    @property
    def host(self) -> SaverHost:
        """This strategy's savers and the checkpoint group (made at first use, on every rank)."""
        if self._host is None:
            self._host = SaverHost(self._save_options, self, fault_hook=self._fault_hook)
        return self._host

    def wait_for_staging(self) -> float:
        """Block until the last save's state is copied (seconds blocked). Optimizer steps fence by themselves;
        code that changes parameters or optimizer state another way must call this first."""
        return self._host.fence() if self._host is not None else 0.0

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every save requested so far finished (committed or failed); False if `timeout` passed."""
        return self._host.wait(timeout) if self._host is not None else True

    def close(self) -> bool:
        """Wait (up to save.teardown_timeout_s) for the last save to commit, let the plug-ins finish (drills,
        copies), stop the savers; saving again starts anew. Call it on every rank before the process group goes
        (teardown and exit call it). True when no saver thread runs any more (False: one outlived the timeout)."""
        loop, host = self._loop, self._host
        try:
            if loop is not None and loop.started:
                loop.started = False
                loop.finish()  # may raise a background save's error (save.on_error="raise")
        finally:
            self._elsewhere = None
            stopped = host.close() if host is not None else True
        return stopped

    def checkpoint_group(self) -> Any:
        """The dedicated gloo group for checkpoint collectives (created once, on first use, on every rank)."""
        return self.host.checkpoint_group()

    def all_reduce_max(self, values: list[float]) -> list[float]:
        """MAX over every rank on the training group (the health rules' control state)."""
        return all_reduce_max_on_default_group(values, self.root_device)

    @property
    def fault_hook(self) -> Any:
        """Tests only: the constructor's `fault_hook`, failing saves at named points."""
        return self._fault_hook

    # --- internals ---
    def _run_loop(self, path: str | None) -> SaveLoop | None:
        """The run's save loop over its root (`root=`, else the first root saved to), built once."""
        root = self.root or path
        if self._loop is None and root:
            placement = Placement(node_rank=self.node_rank, local_rank=self.local_rank, num_nodes=self.num_nodes)
            plan = checkpoint_plan(
                root,
                self._save_options,
                self._load_options,
                self.options.resume_required,
                self.plugins,
                placement,
                front_door=FABRIC,
            )
            self.host.configure(plan.save)
            self._loop = SaveLoop(
                plan=plan,
                plugins=self.plugins,
                options=self.options,
                host=self.host,
                reporter=CallableReporter(self._log_metrics, lambda: max(self._last_step, 0)),
                rank=self.global_rank,
                world_size=self.world_size,
            )
            self._loop.setup("fit")
        return self._loop

    def _is_run_root(self, loop: SaveLoop, path: str) -> bool:
        if path in (self.root, loop.root):
            return True
        return fsio.resolve(path, loop.plan.save.storage_options).same_place(loop.plan.location)

    def _plan_without_root(self) -> CheckpointPlan:
        """What a load needs before the run's root is known: explicit paths only."""
        return CheckpointPlan(root="", save=self._save_options, load=self._load_options)

    def _request_of(self, parts: fabric_state.FabricParts, step: int) -> Callable[[CheckpointSaver, bool], PendingSave]:
        def request(saver: CheckpointSaver, never_skip: bool) -> PendingSave:
            rng = gather_rng_states() if self.restore_rng else None  # every rank's: a collective on the training group
            dcp_state = fabric_state.to_dcp_state(parts, rng, self.plugins.state_dict())
            self._save_checks(dcp_state, trust=self._load_options.trust_checkpoint, rank=self.global_rank)
            if saver.config.overlap_staging:
                self.host.guard(parts.optimizers.values())
            updated_in_step = self._parameters_or_optimizer_state(parts)
            extra = self.plugins.save_extra(parts.module, self.global_rank) if parts.module is not None else None
            return saver.save(
                dcp_state,
                step=step,
                epoch=_plain_int(parts.values.get("epoch")),
                samples_consumed=fabric_state.samples_consumed(parts),
                extra=extra,
                identical=updated_in_step,
                defer=updated_in_step,
                never_skip=never_skip,
            )

        return request

    @staticmethod
    def _parameters_or_optimizer_state(parts: fabric_state.FabricParts) -> Callable[[str], bool]:
        """Flattened keys that only the optimizer step changes and that gradient sync keeps identical on every
        rank: written from any rank, copied while the next batch runs (buffers are not: rank 0's, at once)."""
        names = () if parts.module is None else fabric_state.inner_module(parts.module).named_parameters()
        parameters = {f"{MODEL_KEY}.{name}" for name, _ in names}
        optimizers = f"{OPTIMIZERS_KEY}."
        return lambda fqn: fqn in parameters or fqn.startswith(optimizers)

    def _apply_tensors(
        self, parts: fabric_state.FabricParts, restored: dict[tuple[str, ...], Any], strict: bool
    ) -> None:
        if parts.module is None or (MODEL_KEY,) not in restored:
            return
        set_model_state_dict(parts.module, restored[(MODEL_KEY,)], options=StateDictOptions(strict=strict))
        for index, optimizer in enumerate(parts.optimizers.values()):
            loaded = restored.get((OPTIMIZERS_KEY, str(index)))
            if loaded is not None:  # strict=False: one the checkpoint lacks stays as is
                set_optimizer_state_dict(parts.module, optimizer, loaded)

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


def _checkpoint_options(kwargs: dict[str, Any], fabric_takes: Sequence[Callable[..., Any]]) -> dict[str, Any]:
    """Take ShardedFabricStrategy's own options out of `kwargs`; what is left goes to Fabric's strategy, so a name
    none of `fabric_takes` (its constructor, and DDP's for the DDP strategy) has is refused here, by name, with the
    closest option (a misspelt `keep_lst` would otherwise reach Fabric's strategy, or DDP at the first setup)."""
    names = inspect.signature(ShardedFabricStrategy._init_checkpointing).parameters
    ours = {name: kwargs.pop(name) for name in list(kwargs) if name in names}
    theirs = {name for function in fabric_takes for name in inspect.signature(function).parameters}
    FABRIC_OPTIONS.refuse_unknown(set(kwargs) - theirs, also=theirs - {"self", "args", "kwargs"})
    return ours


def _plain_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class ShardedFabricDDPStrategy(ShardedFabricStrategy, DDPStrategy):
    """Fabric DDP (replicated parameters) with sharded, asynchronous, committed checkpoints."""

    strategy_name = "shardckpt_ddp"
    parallelism = "ddp"
    description = "Fabric DDP with lightning_shardckpt checkpoints"

    def __init__(self, *args: Any, parallelism: str = "ddp", **kwargs: Any) -> None:
        """The checkpoint options of ShardedFabricStrategy; the rest go to Fabric's DDPStrategy."""
        checkpointing = _checkpoint_options(kwargs, (DDPStrategy.__init__, DistributedDataParallel.__init__))
        DDPStrategy.__init__(self, *args, **kwargs)
        self._init_checkpointing(**checkpointing)


class ShardedFabricFSDPStrategy(AllRanksDataParallel, ShardedFabricStrategy, ModelParallelStrategy):
    """Fabric FSDP2 / DTensor (ModelParallelStrategy) with sharded, asynchronous, committed checkpoints.

    Without a `parallelize_fn`, the repeated blocks anywhere in the tree (an HF model's decoder layers), one by one,
    and then the root are `fully_shard`-ed over all ranks (lightning/parallelism.py `shard_repeated_blocks`); pass
    your own for tensor parallelism or another wrapping: `parallelize_fn(module, device_mesh) -> module`, the mesh's
    dimensions named "data_parallel" and "tensor_parallel".
    """

    strategy_name = "shardckpt_fsdp"
    parallelism = "fsdp"
    description = "Fabric FSDP2 with lightning_shardckpt checkpoints"

    def __init__(self, parallelize_fn: Any = None, *args: Any, parallelism: str = "fsdp", **kwargs: Any) -> None:
        """The checkpoint options of ShardedFabricStrategy; the rest go to Fabric's ModelParallelStrategy."""
        checkpointing = _checkpoint_options(kwargs, (ModelParallelStrategy.__init__,))
        ModelParallelStrategy.__init__(self, parallelize_fn or shard_repeated_blocks, *args, **kwargs)
        self._init_checkpointing(**checkpointing)

    def teardown(self) -> None:
        try:
            super().teardown()
        except NotImplementedError:
            # Fabric's own ModelParallelStrategy.teardown ends by tearing down its checkpoint_io, which it refuses
            # to have (Fabric never calls it); what comes before that (ours, precision, accelerator) has run
            log.debug("ModelParallelStrategy.teardown: no checkpoint_io to tear down", exc_info=True)


def register() -> None:
    """`Fabric(strategy="shardckpt_ddp" / "shardckpt_fsdp")`: Fabric's registry, separate from the Trainer's."""
    register_in(STRATEGY_REGISTRY, (ShardedFabricDDPStrategy, ShardedFabricFSDPStrategy))
