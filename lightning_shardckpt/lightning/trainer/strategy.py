"""ShardedStrategy: Lightning strategies whose checkpoints go through the lightning_shardckpt engine.

`ShardedStrategy(parallelism="ddp")` builds a DDPStrategy, `parallelism="fsdp"` a ModelParallelStrategy
(FSDP2 / DTensor, sharded in `configure_model`); both save the model and optimizers as sharded DCP state
(each rank writes its own shards, replicated tensors once) and restore them onto any world size.

Only Lightning's overrides live here; the checkpointing is the door core of training/: the strategy's
savers are a `SaverHost` (`host`, training/savers.py), a resume is training/resume.py's (tiers, fallbacks, the
resume line), and a checkpoint of any door opens (training/door_targets.py). ShardedCheckpoint hands the strategy
one `CheckpointPlan` (policies/plan.py) through `use_plan`. `fault_hook=` (tests only) is a constructor option:
a picklable callable the savers call at named points of a save (tests/helpers/faults.py).
"""

from __future__ import annotations

import inspect
import logging
import pickle
import re
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal, TypeVar, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, ParallelStrategy, StrategyRegistry
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

from ...engine import catalog
from ...engine.config import LIGHTNING, LoadConfig, SaveConfig
from ...engine.format import safe_pickle
from ...engine.format.names import parse_dirname
from ...engine.load.loader import LoadResult
from ...engine.root import parse_reference
from ...engine.save.saver import CheckpointSaver, PendingSave
from ...engine.storage import fsio
from ...errors import ConfigError, UntrustedCheckpoint
from ...policies import retention
from ...policies.plan import CheckpointPlan
from ...training import console
from ...training.checkpointer_state import RESERVED_KEY as CHECKPOINTER_SECTION
from ...training.door_targets import DoorTarget, Layout
from ...training.loadable import SaveChecks
from ...training.resume_sequence import Resumed, load_resumed
from ...training.savers import SaverHost, all_reduce_max_on_default_group
from ...training.staging_fence import StagingFence
from .. import lightning_state
from ..parallelism import PARALLELISMS, AllRanksDataParallel, register_in, strategy_class
from . import ckpt_paths, lightning_files
from .sampler_injection import end_of_fit, restore_position, use_resumable_sampler

log = logging.getLogger(__name__)

# what a fit from another door's checkpoint (Fabric's, the Checkpointer's) keeps as it set it up: that door saves none
NOT_IN_OTHER_DOORS = "the LR schedulers, the batch within the epoch, other callbacks' and the datamodule's state"


class _NothingToRestore(dict[str, Any]):
    """What `load_checkpoint` returns when `ckpt_path="latest"` finds nothing committed.

    Lightning skips every restore step for a falsy checkpoint, exactly as when no path was given; the
    version key keeps its migration step quiet.
    """

    def __bool__(self) -> bool:
        return False


def _lacking(layout: Layout) -> list[str]:
    """What stays as this fit set it up, in the user's words (the resume sequence reports it, never silently)."""
    return layout.not_restored() + ([] if layout.native else [NOT_IN_OTHER_DOORS])


_Class = TypeVar("_Class", bound=type)


def _built_by_new(cls: _Class) -> _Class:
    """LightningCLI (jsonargparse) refuses an abstract class_path. ShardedStrategy never is an instance itself:
    its `__new__` builds ShardedDDPStrategy or ShardedFSDPStrategy, which implement all of Strategy."""
    cast(Any, cls).__abstractmethods__ = frozenset()  # ABCMeta's attribute, which typeshed's `type` does not declare
    return cls


@_built_by_new
class ShardedStrategy(StagingFence, ParallelStrategy):
    """Base of the sharded strategies; calling it builds the one for `parallelism`.

    A Lightning `Strategy`, so LightningCLI accepts `class_path: lightning_shardckpt.ShardedStrategy`; the
    options below are its typed signature there (`__new__`'s, which jsonargparse and `inspect` read). Options
    of the other parallelism left at their defaults are ignored; other keywords go to DDPStrategy (and on to
    DistributedDataParallel) or ModelParallelStrategy.
    """

    parallelism: str = "unknown"

    def __new__(
        cls,
        parallelism: Literal["ddp", "fsdp"] = "fsdp",
        *,
        process_group_backend: str | None = None,  # None: gloo on CPU, nccl on GPU (checkpoints: own gloo group)
        timeout: timedelta | None = default_pg_timeout,  # of the training process group
        data_parallel_size: int | Literal["auto"] = "auto",  # fsdp: ranks FSDP shards over ("auto": all)
        tensor_parallel_size: int | Literal["auto"] = "auto",  # fsdp: ranks a tensor-parallel group spans
        find_unused_parameters: bool = False,  # ddp: some parameters get no gradient in a step
        static_graph: bool = False,  # ddp: the same parameters are used in every step
        gradient_as_bucket_view: bool = False,  # ddp: gradients are views into DDP's buckets (less memory)
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",  # ddp: how Lightning starts ranks
        **kwargs: Any,
    ) -> ShardedStrategy:
        if cls is ShardedStrategy:
            cls = strategy_class(parallelism, ddp=ShardedDDPStrategy, fsdp=ShardedFSDPStrategy)
        return super().__new__(cls)

    def _init_checkpointing(self, fault_hook: Any) -> None:
        # the plan ShardedCheckpoint hands over (use_plan); without one: saves and loads of explicit paths only
        self._plan = CheckpointPlan(root="", save=SaveConfig(parallelism=self.parallelism, front_door=LIGHTNING))
        self.host = SaverHost(self._plan.save, self, fault_hook=fault_hook)
        self.last_resumed: Resumed | None = None  # the last resume: ShardedCheckpoint announces it at train start
        self.not_restored: tuple[str, ...] = ()  # after a load: what the checkpoint did not give back
        self._resumed_sampler_state: dict[str, Any] | None = None  # applied in process_dataloader
        self._staging_prepared: weakref.WeakSet[CheckpointSaver] = weakref.WeakSet()
        self._init_staging_fence()
        self._save_checks = SaveChecks(
            trust_option="ShardedCheckpoint(..., trust_checkpoint=True)",
            pickled_sections={lightning_state.LIGHTNING_KEY: safe_pickle.LIGHTNING_STATE_GLOBALS},
        )

    @staticmethod
    def of(trainer: Any) -> ShardedStrategy:
        """The Trainer's strategy, which ShardedCheckpoint needs to be a ShardedStrategy (ConfigError otherwise)."""
        if not isinstance(trainer.strategy, ShardedStrategy):
            raise ConfigError(
                f"ShardedCheckpoint needs a ShardedStrategy, the Trainer has {type(trainer.strategy).__name__}; "
                "use Trainer(strategy=ShardedStrategy(parallelism='ddp' or 'fsdp')) or strategy='shardckpt_ddp'"
            )
        return trainer.strategy

    @property
    def connected_module(self) -> pl.LightningModule:
        """The LightningModule, which Lightning connects before any hook that saves, loads or builds a loader."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError(
                f"{type(self).__name__} has no LightningModule yet: it saves, loads and builds loaders only inside "
                "trainer.fit/validate/test/predict, which connect the model first"
            )
        return module

    # --- what Lightning asks of a strategy ---
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # restore into the set-up (wrapped / sharded) model and its optimizers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # optimizers are restored in load_checkpoint, resharded

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        # the one hook that sees fit(ckpt_path=...) before Lightning resolves "last" (lightning/trainer/ckpt_paths.py)
        self._launcher = ckpt_paths.with_last_resolved(self._launcher)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.connected_module)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return get_optimizer_state_dict(self.connected_module, _unwrap(optimizer))

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Apply `checkpoint["state_dict"]` (DCP-loaded, resharded) after Lightning's `on_load_checkpoint` hooks ran."""
        if "state_dict" not in checkpoint:
            return
        started = time.perf_counter()
        set_model_state_dict(self.connected_module, checkpoint["state_dict"], options=StateDictOptions(strict=strict))
        if self.last_load is not None:
            self.last_load.seconds += time.perf_counter() - started  # time to resume includes applying the weights

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # already loaded in load_checkpoint()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """`trainer.save_checkpoint(path)` (and ModelCheckpoint's saves): a blocking save; `path` becomes a
        checkpoint root that keeps only its newest checkpoint, as Lightning overwrites its file."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported; set save.storage_options"
            )
        # Rank 0's path, on every rank, as Lightning's own save writes rank 0's file: a name formatted from a
        # per-rank value (ModelCheckpoint(filename="{train_loss}") without sync_dist) differs between ranks.
        filepath = str(self.broadcast(str(filepath)))
        # One thread at a time on the checkpoint group: let background saves finish first.
        self.wait_for_staging()
        self.host.wait()
        saver = self.host.new_saver(filepath, replace(self.host.save_config, async_save=False))
        result = self.save_to_saver(saver, checkpoint).result()
        saver.close()
        if not result.committed:
            raise result.error or RuntimeError(f"checkpoint {filepath} did not commit")
        callbacks_root = bool(self._plan.root) and saver.root.same_place(self._plan.location)
        if self.is_global_zero and result.path and not callbacks_root:  # there, the callback's keep_last decides
            ckpt_paths.keep_only_newest(saver.root, saver.run_id, result.path.rstrip("/").rsplit("/", 1)[-1])

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """`fit(ckpt_path=...)`: the resume sequence of every door (training/resume_sequence.py), into fresh model tensors and
        the optimizers (resharded); returns Lightning's checkpoint dict for its restore hooks. A checkpoint
        Lightning's own ModelCheckpoint wrote goes to Lightning's loader (lightning/trainer/lightning_files.py)."""
        if self._written_by_lightning(checkpoint_path):
            self.wait_for_staging()  # the load overwrites parameters and optimizer state in place
            return self._load_lightnings_own(str(checkpoint_path), weights_only)
        started = time.perf_counter()
        module = self.connected_module
        optimizers = [_unwrap(optimizer) for optimizer in self.optimizers]
        strict = module.strict_loading  # Lightning's partial-checkpoint switch: missing keys keep their initial values
        target = self._door_target(module, optimizers, strict)
        resumed = load_resumed(
            self._plan, self.host, target, str(checkpoint_path), strict=strict, rank=self.global_rank, lacking=_lacking
        )
        if resumed is None:
            module.trainer._checkpoint_connector._ckpt_path = None  # nothing was restored
            return _NothingToRestore({"pytorch-lightning_version": pl.__version__})
        self.last_resumed, loaded = resumed, resumed.loaded
        restored = target.restored()
        for index, optimizer in enumerate(optimizers):
            if (state := restored.get((lightning_state.OPTIMIZERS_KEY, str(index)))) is not None:
                set_optimizer_state_dict(module, optimizer, state)
        layout = resumed.layout
        if layout.own_source == lightning_state.LIGHTNING_KEY:
            checkpoint = lightning_state.lightning_rest(
                {lightning_state.LIGHTNING_KEY: target.own_section()},
                trust=self.load_config.trust_checkpoint,
                where=loaded.path,
            )
        else:  # another door's checkpoint: its model, optimizers and step; the Checkpointer's data position and RNG
            checkpoint = lightning_state.warm_start(
                module.trainer,
                step=loaded.step,
                epoch=loaded.manifest.get("epoch"),
                callbacks=self._carried_callback_state(target, loaded),
            )
        self.not_restored = resumed.not_restored
        model_section = layout.sources.get((lightning_state.MODEL_KEY,), (lightning_state.MODEL_KEY,))
        checkpoint["state_dict"] = self._present_in_checkpoint(
            restored.get((lightning_state.MODEL_KEY,), {}), model_section, loaded
        )
        loaded.seconds = time.perf_counter() - started  # pick + read; load_model_state_dict adds the apply
        return checkpoint

    def process_dataloader(self, dataloader: Any) -> Any:
        # a sampler whose position survives a resume onto another world size
        dataloader = use_resumable_sampler(super().process_dataloader(dataloader))
        trainer = self.connected_module.trainer
        if self._resumed_sampler_state is not None and trainer.training:
            # here, not at on_train_start: Lightning sizes the epoch and creates the iterator right after
            restore_position(trainer, dataloader, self._resumed_sampler_state)
            self._resumed_sampler_state = None
        return dataloader

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            location = fsio.resolve(str(filepath), self.save_config.storage_options)
            name = location.path.rstrip("/").rsplit("/", 1)[-1]
            if parse_dirname(name) is not None:  # a checkpoint of a root: retention's path (references, crash order)
                root = fsio.resolve(str(filepath).rstrip("/").rsplit("/", 1)[0], self.save_config.storage_options)
                entry = next((e for e in catalog.list_checkpoints(root) if e.name == name and e.committed), None)
                if entry is not None:
                    retention.delete_checkpoint(root, entry)
                    return
            if location.fs.exists(location.path):
                location.fs.rm(location.path, recursive=True)

    def teardown(self) -> None:
        end_of_fit()  # Lightning's "not resumable" warning is right again for a next fit without our sampler
        try:
            # in-flight saves commit; the checkpoint group is released only once no saver thread can touch it
            self.host.close()
        finally:
            super().teardown()

    # --- what ShardedCheckpoint uses ---
    def use_plan(self, plan: CheckpointPlan) -> None:
        """Where checkpoints go and how they are saved and loaded: the callback's whole hand-over, in one call."""
        self._plan = plan
        self.host.configure(plan.save)

    @property
    def last_load(self) -> LoadResult | None:
        """What the last resume loaded (None: this strategy has not resumed)."""
        return self.last_resumed.loaded if self.last_resumed is not None else None

    @property
    def save_config(self) -> SaveConfig:
        return self.host.save_config

    @property
    def load_config(self) -> LoadConfig:
        return self._plan.load

    @property
    def root(self) -> str | None:
        """The checkpoint root `ckpt_path="latest"`, step numbers and ids are relative to (None: no plan)."""
        return self._plan.root or None

    @property
    def fault_hook(self) -> Any:
        """Tests only: the constructor's `fault_hook`, failing saves at named points (engine/save/saver.py passes it on)."""
        return self.host.fault_hook

    def adopt_run_id(self, run_id: str) -> None:
        """This run's id for every saver from now on."""
        self.host.adopt_run_id(run_id)

    def existing_saver(self, root: str) -> CheckpointSaver | None:
        """The saver of `root` if one was created this fit, else None (creates nothing)."""
        return self.host.existing_saver(root)

    def resume_sampler_state(self, state: dict[str, Any] | None) -> None:
        """The resumed sampler position, applied as the training loader is built (process_dataloader)."""
        self._resumed_sampler_state = state

    def all_reduce_max(self, values: list[float]) -> list[float]:
        """MAX over every rank on the training group (the health rules' control state)."""
        return all_reduce_max_on_default_group(values, self.root_device)

    def prepare_staging(self, saver: CheckpointSaver) -> None:
        """Once the optimizer state exists (after the first step): allocate `saver`'s staging memory in the
        background, before its first save; once per saver."""
        if saver not in self._staging_prepared:
            self._staging_prepared.add(saver)
            saver.prepare(self.state_layout())

    def state_layout(self) -> dict[str, Any]:
        """A state with the layout `save_to_saver` stages (live tensors, no copies): for `saver.prepare`."""
        module = self.connected_module
        return lightning_state.load_target(
            get_model_state_dict(module), [get_optimizer_state_dict(module, _unwrap(opt)) for opt in self.optimizers]
        )

    def state_at_start(self) -> dict[str, Any]:
        """The state a save would stage, as far as it exists at train start (the save loop's checks before the
        first step): the model's, and the optimizers' once every one holds state (a resume). A fresh optimizer's
        is left out: get_optimizer_state_dict would make it with a zero step (its step count, its hooks); the
        saver's check at every save sees it."""
        module = self.connected_module
        if self.optimizers and all(_unwrap(optimizer).state for optimizer in self.optimizers):
            return self.state_layout()
        return lightning_state.load_target(get_model_state_dict(module), [])

    def save_to_saver(
        self, saver: CheckpointSaver, checkpoint: dict[str, Any], identity: dict[str, Any] | None = None, **meta: Any
    ) -> PendingSave:
        state = lightning_state.to_dcp_state(checkpoint)
        self._save_checks(state, trust=self.load_config.trust_checkpoint, rank=self.global_rank)
        if saver.config.overlap_staging:
            self._guard_optimizers()
        parameters_or_optimizer_state = self._parameters_or_optimizer_state()
        return saver.save(
            state,
            step=int(checkpoint.get("global_step", 0)),
            epoch=checkpoint.get("epoch"),
            identity=identity,
            samples_consumed=meta.get("samples_consumed"),
            extra=meta.get("extra"),
            identical=parameters_or_optimizer_state,
            # they change only in the optimizer step, which fences: copied while the next batch runs
            defer=parameters_or_optimizer_state,
            never_skip=bool(meta.get("never_skip", False)),
        )

    def _parameters_or_optimizer_state(self) -> Callable[[str], bool]:
        """Flattened keys of parameters and optimizer state.

        Gradient sync keeps every rank's copy bit-identical, so their writes may be spread (buffers such
        as BatchNorm statistics and the pickled rest are not: rank 0's copy); and only the optimizer
        step changes them, so their staging copy may overlap the next forward and backward (buffers
        change in forward: copied at the request)."""
        parameters = {f"{lightning_state.MODEL_KEY}.{name}" for name, _ in self.connected_module.named_parameters()}
        optimizers = f"{lightning_state.OPTIMIZERS_KEY}."
        return lambda fqn: fqn in parameters or fqn.startswith(optimizers)

    # --- internals ---
    def _written_by_lightning(self, checkpoint_path: Any) -> bool:
        """Whether `ckpt_path` is a `.ckpt` file or DCP directory of Lightning's own (rank 0 looks, every rank
        gets its answer): a selector never is, and neither is a root of ours."""
        if not parse_reference(str(checkpoint_path)).is_path:
            return False
        answer = None
        if self.is_global_zero:
            answer = lightning_files.written_by_lightning(str(checkpoint_path), self.load_config.storage_options)
        return bool(self.broadcast(answer))

    def _load_lightnings_own(self, checkpoint_path: str, weights_only: bool | None) -> dict[str, Any]:
        """A run ModelCheckpoint saved, continued: Lightning's loader of the parent strategy reads the file
        (DDP: the whole dict, weights applied by load_model_state_dict after the on_load_checkpoint hooks;
        ModelParallelStrategy: weights and optimizers loaded in place, resharded by DCP), Lightning's restore
        hooks take loops, global step and callbacks' state from the dict it returns. The next save goes to
        ShardedCheckpoint's root in this package's format, continuing the step counter."""
        if weights_only is None:  # Lightning's own default unpickles a remote file whole: our trust option decides
            weights_only = not self.load_config.trust_checkpoint
        try:  # super(): the Lightning strategy below ours (DDPStrategy: Strategy's torch.load; ModelParallelStrategy)
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except pickle.UnpicklingError as err:  # torch's weights_only refusal names the class it would not build
            blocked = _WEIGHTS_ONLY_BLOCKED.search(str(err))
            what = blocked[1] if blocked else "a class outside torch's weights_only allow-list"
            raise UntrustedCheckpoint(
                f"Lightning's checkpoint {checkpoint_path} pickles {what}, which torch's weights_only loader refuses "
                "to build (unpickling it could run its code); if you trust the file, pass ShardedCheckpoint(..., "
                "trust_checkpoint=True) or trainer.fit(..., weights_only=False), or allow just that class with "
                "torch.serialization.add_safe_globals([...])",
                blocked=blocked[1] if blocked else None,
            ) from err
        # Lightning restores optimizers itself only where lightning_restore_optimizer (False: ours load here)
        super().load_optimizer_state_dict(checkpoint)
        self.last_resumed, self.not_restored = None, ()  # nothing of ours was read: no resume event, a new run id
        if self.is_global_zero:
            console.say(
                f"lightning_shardckpt: resumed from Lightning's checkpoint {checkpoint_path} "
                f"(step {checkpoint.get('global_step', '?')}) with Lightning's loader, world size {self.world_size}; "
                f"saves continue in {self.root or 'the paths trainer.save_checkpoint is given'}"
            )
        return checkpoint

    def _door_target(self, module: pl.LightningModule, optimizers: list[Optimizer], strict: bool) -> DoorTarget:
        """What a resume fills: fresh model tensors (this rank's shards; Lightning's on_load_checkpoint hooks see and
        may edit checkpoint["state_dict"] before load_model_state_dict applies it, as with a plain Lightning
        checkpoint), the optimizers' states, the pickled rest of Lightning's dict."""
        entries: dict[tuple[str, ...], Any] = {
            (lightning_state.MODEL_KEY,): {
                key: torch.empty_like(value) if isinstance(value, torch.Tensor) else value
                for key, value in get_model_state_dict(module).items()
            }
        }
        for index, optimizer in enumerate(optimizers):
            entries[(lightning_state.OPTIMIZERS_KEY, str(index))] = get_optimizer_state_dict(module, optimizer)
        entries[(lightning_state.LIGHTNING_KEY,)] = b""
        return DoorTarget(
            entries,
            model=(lightning_state.MODEL_KEY,),
            optimizers=tuple((lightning_state.OPTIMIZERS_KEY, str(index)) for index in range(len(optimizers))),
            own=(lightning_state.LIGHTNING_KEY,),
            reads_own=(CHECKPOINTER_SECTION,),  # its step and data position carry into the fit (load_checkpoint)
            strict=strict,
            strict_hint="LightningModule.strict_loading = False",
        )

    def _carried_callback_state(self, target: DoorTarget, loaded: LoadResult) -> dict[str, Any]:
        """ShardedCheckpoint's state from a Checkpointer's own section (the sampler's position, every rank's RNG,
        the plug-ins' state: what the callback saves too), filed under the state key of the checkpoint's root, so
        the callback takes it as it takes a fork's; {} for a checkpoint without it (Fabric's, a bare saver's)."""
        if target.layout is None or target.layout.own_source != CHECKPOINTER_SECTION:
            return {}
        own = safe_pickle.loads(target.own_section(), (), trust=self.load_config.trust_checkpoint) or {}
        state = {"last_saved_step": loaded.step, "sampler": own.get("sampler"), "rng": own.get("rng")}
        return {ckpt_paths.callback_state_key(loaded.path): {**state, **(own.get("plugins") or {})}}

    def _present_in_checkpoint(
        self, model_state: dict[str, Any], section: tuple[str, ...], loaded: LoadResult
    ) -> dict[str, Any]:
        """The loaded model state without keys the checkpoint lacks (a load gets here with them only when
        strict_loading=False); warns naming every model key left as initialised. `section`: where the checkpoint
        `loaded` holds the model ("model"; another door's name for it)."""
        prefix = ".".join(section) + "."
        saved = {entry["fqn"] for entry in loaded.manifest.get("tensors", [])}
        saved |= {entry["fqn"] for entry in loaded.manifest.get("objects", [])}
        missing = {key for key in model_state if f"{prefix}{key}" not in saved}
        # also what the module's own state_dict() leaves out (Lightning's frozen-backbone pattern): never loaded
        module_keys = torch.nn.Module.state_dict(self.connected_module, keep_vars=True).keys()
        left = sorted(missing | {key for key in module_keys if f"{prefix}{key}" not in saved})
        if left and self.is_global_zero:
            log.warning(
                "strict_loading=False: %d model key(s) are not in %s and keep their initialised values: %s",
                len(left),
                loaded.path,
                ", ".join(left[:20]) + (", ..." if len(left) > 20 else ""),
            )
        return {key: value for key, value in model_state.items() if key not in missing}


class ShardedDDPStrategy(ShardedStrategy, DDPStrategy):
    """DDP (replicated parameters) with sharded, asynchronous, committed checkpoints."""

    strategy_name = "shardckpt_ddp"
    parallelism = "ddp"
    description = "DDP with lightning_shardckpt checkpoints"

    def __init__(
        self,
        parallelism: Literal["ddp"] = "ddp",
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        fault_hook: Any = None,
        **kwargs: Any,
    ) -> None:
        """Options as ShardedStrategy's (`fault_hook`: tests only); other keywords go to DDPStrategy and DDP."""
        # no backend default of ours: Lightning picks gloo on CPU and nccl on GPU for training; checkpoint
        # collectives always use their own gloo group
        DDPStrategy.__init__(
            self,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            **_own_options(type(self), parallelism, kwargs),
        )
        self._init_checkpointing(fault_hook)


class ShardedFSDPStrategy(AllRanksDataParallel, ShardedStrategy, ModelParallelStrategy):
    """FSDP2 / DTensor (ModelParallelStrategy; shard in `configure_model`) with lightning_shardckpt checkpoints."""

    strategy_name = "shardckpt_fsdp"
    parallelism = "fsdp"
    description = "FSDP2 with lightning_shardckpt checkpoints"

    def __init__(
        self,
        parallelism: Literal["fsdp"] = "fsdp",
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int | Literal["auto"] = "auto",
        fault_hook: Any = None,
        **kwargs: Any,
    ) -> None:
        """Options as ShardedStrategy's (`fault_hook`: tests only); other keywords go to ModelParallelStrategy."""
        ModelParallelStrategy.__init__(
            self,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **_own_options(type(self), parallelism, kwargs),
        )
        self._init_checkpointing(fault_hook)


def register() -> None:
    register_in(StrategyRegistry, (ShardedDDPStrategy, ShardedFSDPStrategy))


def _own_options(cls: type[ShardedStrategy], parallelism: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` less those of the other parallelism left at their defaults: `ShardedStrategy(...)` passes every
    option it was given to the chosen class, and LightningCLI gives all of them. One set is a ConfigError."""
    if parallelism != cls.parallelism:
        raise ConfigError(
            f"{cls.__name__}(parallelism={parallelism!r}) is a {cls.parallelism!r} strategy; use "
            f"ShardedStrategy(parallelism={parallelism!r}), or leave parallelism out"
        )
    own = inspect.signature(cls.__init__).parameters
    shared = inspect.signature(ShardedStrategy.__new__).parameters
    kept = dict(options)
    for name, value in options.items():
        if name in shared and name not in own:
            kept.pop(name)
            if value != shared[name].default:
                other = next(p for p in PARALLELISMS if p != cls.parallelism)
                raise ConfigError(
                    f"{name}={value!r} applies to parallelism={other!r} only; remove it, or use parallelism={other!r}"
                )
    return kept


_WEIGHTS_ONLY_BLOCKED = re.compile(r"GLOBAL ([\w.]+)")  # torch: "Unsupported global: GLOBAL pkg.Class was not ..."


def _unwrap(optimizer: Optimizer | LightningOptimizer) -> Optimizer:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer  # it wraps the real one


def _looks_like_id(text: str) -> bool:
    return len(text) == 12 and all(c in "0123456789abcdef" for c in text)
