"""ShardedStrategy: Lightning strategies whose checkpoints go through the lightning_shardckpt engine.

`ShardedStrategy(parallelism="ddp")` builds a DDPStrategy, `parallelism="fsdp"` a ModelParallelStrategy
(FSDP2 / DTensor, sharded in `configure_model`); both save the model and optimizers as sharded DCP state
(each rank writes its own shards, replicated tensors once) and restore them onto any world size.

ShardedCheckpoint hands the strategy one `CheckpointPlan` (training/plan.py) through `use_plan`; what
others need of it is public: `saver_for`, `existing_saver`, `replace_saver`, `adopt_run_id`,
`resume_sampler_state`. `fault_hook=` (tests only) is a constructor option: a picklable callable the
savers call at named points of a save (tests/helpers/faults.py), to fail, stall or kill a rank there.
"""

from __future__ import annotations

import inspect
import logging
import time
import weakref
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
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

from ..engine import catalog
from ..engine.collectives import new_checkpoint_group
from ..engine.config import LoadConfig, SaveConfig, save_config_from
from ..engine.format import safe_pickle
from ..engine.format.layout import join, parse_dirname
from ..engine.load.loader import LoadResult, load_checkpoint
from ..engine.save.saver import CheckpointSaver, PendingSave
from ..engine.storage import fsio
from ..errors import CheckpointNotFound, ConfigError, CorruptCheckpoint
from ..policies import retention
from ..training.loadable import SaveChecks
from ..training.plan import CheckpointPlan
from ..training.staging_fence import StagingFence
from . import ckpt_paths, lightning_state
from .sampler_injection import end_of_fit, restore_position, use_resumable_sampler

log = logging.getLogger(__name__)

PARALLELISMS = ("ddp", "fsdp")


class _NothingToRestore(dict):
    """What `load_checkpoint` returns when `ckpt_path="latest"` finds nothing committed.

    Lightning skips every restore step for a falsy checkpoint, exactly as when no path was given; the
    version key keeps its migration step quiet.
    """

    def __bool__(self) -> bool:
        return False


def _built_by_new(cls: type) -> type:
    """LightningCLI (jsonargparse) refuses an abstract class_path. ShardedStrategy never is an instance itself:
    its `__new__` builds ShardedDDPStrategy or ShardedFSDPStrategy, which implement all of Strategy."""
    cls.__abstractmethods__ = frozenset()
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
            if parallelism not in PARALLELISMS:
                raise ConfigError(
                    f"parallelism={parallelism!r} is unknown; use 'ddp' (replicated) or 'fsdp' (FSDP2 sharded)"
                )
            cls = ShardedDDPStrategy if parallelism == "ddp" else ShardedFSDPStrategy
        return super().__new__(cls)

    def _init_checkpointing(self, fault_hook: Any) -> None:
        # the plan ShardedCheckpoint hands over (use_plan); without one: saves to explicit paths only
        self._plan = CheckpointPlan(root="", save=SaveConfig(parallelism=self.parallelism))
        self.save_config = self._plan.save  # the plan's, with this run's id once adopted
        self.load_config = self._plan.load
        self.last_load: LoadResult | None = None
        self._resumed_sampler_state: dict[str, Any] | None = None  # applied in process_dataloader
        self._group: Any = None
        self._savers: dict[str, CheckpointSaver] = {}
        self._staging_prepared: weakref.WeakSet[CheckpointSaver] = weakref.WeakSet()
        self._init_staging_fence()
        self._fault_hook = fault_hook
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

    # --- what Lightning asks of a strategy ---
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # restore into the set-up (wrapped / sharded) model and its optimizers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # optimizers are restored in load_checkpoint, resharded

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        # the one hook that sees fit(ckpt_path=...) before Lightning resolves "last" (lightning/ckpt_paths.py)
        self._launcher = ckpt_paths.with_last_resolved(self._launcher)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.lightning_module)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return get_optimizer_state_dict(self.lightning_module, _unwrap(optimizer))

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Apply `checkpoint["state_dict"]` (DCP-loaded, resharded) after Lightning's `on_load_checkpoint` hooks ran."""
        if "state_dict" not in checkpoint:
            return
        started = time.perf_counter()
        set_model_state_dict(self.lightning_module, checkpoint["state_dict"], options=StateDictOptions(strict=strict))
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
        for in_flight in self._savers.values():
            in_flight.wait()
        config = replace(self.save_config, async_save=False)
        saver = self._keep_first_run_id(CheckpointSaver(filepath, config, group=self.checkpoint_group()))
        result = self.save_to_saver(saver, checkpoint).result()
        saver.close()
        if not result.committed:
            raise result.error or RuntimeError(f"checkpoint {filepath} did not commit")
        callbacks_root = bool(self._plan.root) and saver.root.same_place(self._plan.location)
        if self.is_global_zero and result.path and not callbacks_root:  # there, the callback's keep_last decides
            ckpt_paths.keep_only_newest(saver.root, saver.run_id, result.path.rstrip("/").rsplit("/", 1)[-1])

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.wait_for_staging()  # the load overwrites parameters and optimizer state in place
        started = time.perf_counter()
        root, which = self._resolve_source(str(checkpoint_path))
        load_config, tier_fallbacks, requested = self.load_config, [], which
        tiers = self._plan.tier_restore
        from_tiers = tiers is not None and which in ("latest", catalog.LAST_GOOD) and root == self._plan.root
        if not from_tiers:  # an explicit path to the root itself may still be restored from another tier
            self._refuse_a_path_without_a_checkpoint(str(checkpoint_path), root)
        if from_tiers:  # `root` becomes the picked checkpoint's directory, on whichever tier it was found
            root, load_config, tier_fallbacks = tiers.pick(which, self.load_config, self.checkpoint_group())
            which = "latest"
        if which == "latest" and not self._has_committed(root):
            if self._plan.resume_required:
                raise CheckpointNotFound(
                    f"ckpt_path='latest' but {root} holds no committed checkpoint and resume_required=true; "
                    "check checkpoint.dirpath, or set resume_required=false to start fresh"
                )
            log.warning("no committed checkpoint in %s: starting fresh", root)
            self.lightning_module.trainer._checkpoint_connector._ckpt_path = None  # nothing was restored
            return _NothingToRestore({"pytorch-lightning_version": pl.__version__})
        module = self.lightning_module
        optimizers = [_unwrap(optimizer) for optimizer in self.optimizers]
        # The model loads into fresh tensors (this rank's shards only), not into the live parameters:
        # Lightning's on_load_checkpoint hooks see and may edit checkpoint["state_dict"] before
        # load_model_state_dict applies it, as with a plain Lightning checkpoint.
        model_target = {
            key: torch.empty_like(value) if isinstance(value, torch.Tensor) else value
            for key, value in get_model_state_dict(module).items()
        }
        target = lightning_state.load_target(
            model_target, [get_optimizer_state_dict(module, optimizer) for optimizer in optimizers]
        )
        strict = module.strict_loading  # Lightning's partial-checkpoint switch: missing keys keep their initial values
        try:
            self.last_load = load_checkpoint(
                target, root, which, config=load_config, strict=strict, process_group=self.checkpoint_group()
            )
        except CorruptCheckpoint as err:  # every rank raises it alike (DCP gathers failures)
            self.last_load = self._load_fallback(err, target, root, requested, strict, tier_fallbacks, from_tiers)
        for index, optimizer in enumerate(optimizers):
            set_optimizer_state_dict(module, optimizer, target[lightning_state.OPTIMIZERS_KEY][str(index)])
        checkpoint = lightning_state.lightning_rest(
            target, trust=self.load_config.trust_checkpoint, where=self.last_load.path
        )
        checkpoint["state_dict"] = self._present_in_checkpoint(target[lightning_state.MODEL_KEY])
        self.last_load.seconds = time.perf_counter() - started  # pick + read; load_model_state_dict adds the apply
        return checkpoint

    def process_dataloader(self, dataloader: Any) -> Any:
        # a sampler whose position survives a resume onto another world size
        dataloader = use_resumable_sampler(super().process_dataloader(dataloader))
        trainer = self.lightning_module.trainer
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
        savers, self._savers = list(self._savers.values()), {}
        self._remove_optimizer_guards()
        end_of_fit()  # Lightning's "not resumable" warning is right again for a next fit without our sampler
        try:
            for saver in savers:
                saver.close()
        finally:
            # release the checkpoint group's gloo threads cleanly, only once no saver thread can touch it:
            # close() joined the workers; one still running (a save past the teardown timeout) keeps the group
            if self._group is not None and all(saver.wait(0) and saver.stopped for saver in savers):
                dist.destroy_process_group(self._group)
                self._group = None
            super().teardown()

    # --- what ShardedCheckpoint (and plug-ins) use ---
    def use_plan(self, plan: CheckpointPlan) -> None:
        """Where checkpoints go and how they are saved and loaded: the callback's whole hand-over, in one call."""
        self._plan = plan
        self.save_config = plan.save
        self.load_config = plan.load

    @property
    def root(self) -> str | None:
        """The checkpoint root `ckpt_path="latest"`, step numbers and ids are relative to (None: no plan)."""
        return self._plan.root or None

    @property
    def fault_hook(self) -> Any:
        """Tests only: the constructor's `fault_hook`, failing saves at named points (engine/save/saver.py passes it on)."""
        return self._fault_hook

    def adopt_run_id(self, run_id: str) -> None:
        """This run's id for every saver created from now on (set before the root's saver exists)."""
        self.save_config = save_config_from(self.save_config, run_id=run_id)

    def resume_sampler_state(self, state: dict[str, Any] | None) -> None:
        """The resumed sampler position, applied as the training loader is built (process_dataloader)."""
        self._resumed_sampler_state = state

    def open_savers(self) -> list[CheckpointSaver]:
        """Every saver this strategy holds (the staging fence waits on each)."""
        return list(self._savers.values())

    def existing_saver(self, root: str) -> CheckpointSaver | None:
        """The saver of `root` if one was created this fit, else None (creates nothing)."""
        return self._savers.get(root)

    def replace_saver(self, root: str, saver: CheckpointSaver) -> None:
        """Adopt a saver made elsewhere (tiers' degraded mode): save_checkpoint waits for it, teardown closes it."""
        self._savers[root] = saver

    def checkpoint_group(self) -> Any:
        """The dedicated gloo group for checkpoint collectives (created once, on first use, on every rank)."""
        if self._group is None:
            self._group = new_checkpoint_group(self.save_config.collective_timeout_s)
        return self._group

    def saver_for(self, root: str) -> CheckpointSaver:
        """The saver of `root`, created on first use with the plan's save config."""
        if root not in self._savers:
            saver = CheckpointSaver(root, self.save_config, group=self.checkpoint_group(), fault_hook=self._fault_hook)
            self._savers[root] = self._keep_first_run_id(saver)
        return self._savers[root]

    def prepare_staging(self, saver: CheckpointSaver) -> None:
        """Once the optimizer state exists (after the first step): allocate `saver`'s staging memory in the
        background, before its first save; once per saver."""
        if saver not in self._staging_prepared:
            self._staging_prepared.add(saver)
            saver.prepare(self.state_layout())

    def state_layout(self) -> dict[str, Any]:
        """A state with the layout `save_to_saver` stages (live tensors, no copies): for `saver.prepare`."""
        module = self.lightning_module
        return lightning_state.load_target(
            get_model_state_dict(module), [get_optimizer_state_dict(module, _unwrap(opt)) for opt in self.optimizers]
        )

    def save_to_saver(
        self, saver: CheckpointSaver, checkpoint: dict[str, Any], identity: dict | None = None, **meta: Any
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

    def _parameters_or_optimizer_state(self):
        """Flattened keys of parameters and optimizer state.

        Gradient sync keeps every rank's copy bit-identical, so their writes may be spread (buffers such
        as BatchNorm statistics and the pickled rest are not: rank 0's copy); and only the optimizer
        step changes them, so their staging copy may overlap the next forward and backward (buffers
        change in forward: copied at the request)."""
        parameters = {f"{lightning_state.MODEL_KEY}.{name}" for name, _ in self.lightning_module.named_parameters()}
        optimizers = f"{lightning_state.OPTIMIZERS_KEY}."
        return lambda fqn: fqn in parameters or fqn.startswith(optimizers)

    # --- internals ---
    def _present_in_checkpoint(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """The loaded model state without keys the checkpoint lacks (a load gets here with them only when
        strict_loading=False); warns naming every model key left as initialised."""
        saved = {entry["fqn"] for entry in self.last_load.manifest.get("tensors", [])}
        saved |= {entry["fqn"] for entry in self.last_load.manifest.get("objects", [])}
        missing = {key for key in model_state if f"{lightning_state.MODEL_KEY}.{key}" not in saved}
        # also what the module's own state_dict() leaves out (Lightning's frozen-backbone pattern): never loaded
        module_keys = torch.nn.Module.state_dict(self.lightning_module, keep_vars=True).keys()
        left = sorted(missing | {key for key in module_keys if f"{lightning_state.MODEL_KEY}.{key}" not in saved})
        if left and self.is_global_zero:
            log.warning(
                "strict_loading=False: %d model key(s) are not in %s and keep their initialised values: %s",
                len(left),
                self.last_load.path,
                ", ".join(left[:20]) + (", ..." if len(left) > 20 else ""),
            )
        return {key: value for key, value in model_state.items() if key not in missing}

    def _keep_first_run_id(self, saver: CheckpointSaver) -> CheckpointSaver:
        """Without a run id set (no ShardedCheckpoint), the first saver's generated one stays this run's."""
        if self.save_config.run_id is None:
            self.save_config = replace(self.save_config, run_id=saver.run_id)
        return saver

    def _resolve_source(self, text: str) -> tuple[str, str]:
        """(root, which) for `ckpt_path`: a selector relative to the callback's root, or a path."""
        is_selector = (
            text in ("latest", catalog.LAST_GOOD)
            or text.isdigit()
            or parse_dirname(text) is not None
            or _looks_like_id(text)
        )
        if is_selector and "/" not in text:
            if not self._plan.root:
                raise ConfigError(
                    f"ckpt_path={text!r} is relative to a checkpoint root, but no ShardedCheckpoint callback set one; "
                    "add ShardedCheckpoint(dirpath=...) to the Trainer's callbacks or pass a path"
                )
            return self._plan.root, text
        return text, "latest"

    def _load_fallback(
        self,
        err: CorruptCheckpoint,
        target: dict[str, Any],
        root: str,
        which: str,
        strict: bool,
        tier_fallbacks: list[tuple[str, LoadConfig, str]],
        from_tiers: bool,
    ) -> LoadResult:
        """After a load failed: the same checkpoint on the other tier (policies/tiers.py), then the last known-good."""
        for path, config, message in tier_fallbacks:
            log.warning("%s (%s)", message, err)
            try:
                return load_checkpoint(
                    target, path, config=config, strict=strict, process_group=self.checkpoint_group()
                )
            except CorruptCheckpoint as again:  # every rank alike, as the first
                err = again
        return self._load_last_good(err, target, root, which, strict, from_tiers)

    def _refuse_a_path_without_a_checkpoint(self, asked: str, root: str) -> None:
        """A path given explicitly must hold a committed checkpoint: only a selector ('latest') may start
        fresh. Starting fresh from a typo'd or emptied path would train from scratch and exit 0."""
        if asked != root or self._has_committed(root):  # a selector, or a path that holds one
            return
        found = catalog.describe_contents(fsio.resolve(root, self.load_config.storage_options))
        raise CheckpointNotFound(
            f"ckpt_path={asked!r} holds no committed checkpoint: found {found}; pass a checkpoint root or "
            "checkpoint directory that holds one (`shardckpt ls ROOT` lists them), or ckpt_path='latest' "
            "(Hydra: resume=latest) to resume from the callback's root, starting fresh if it is empty"
        )

    def _load_last_good(
        self, err: CorruptCheckpoint, target: dict[str, Any], root: str, which: str, strict: bool, from_tiers: bool
    ) -> LoadResult:
        if which != "latest":
            raise err
        good, config = self._last_good(root, from_tiers)
        if good is None or not self._plan.fallback_to_last_good:
            raise CorruptCheckpoint(f"{err}\n{_last_good_hint(good)}", problems=err.problems) from err
        log.warning(
            "the latest checkpoint of %s did not load (%s); fallback_to_last_good: resuming from %s", root, err, good
        )
        return load_checkpoint(target, good, config=config, strict=strict, process_group=self.checkpoint_group())

    def _last_good(self, root: str, from_tiers: bool) -> tuple[str | None, LoadConfig]:
        """(path, load config) of the last known-good checkpoint, every rank alike; (None, ...) without one.

        A `latest` picked from the tiers looks in the tier roots (both tiers, what every rank can read),
        where the drill records are: `root` is then the picked checkpoint's own directory, which holds none.
        """
        if from_tiers:
            good = self._plan.tier_restore.last_good(self.load_config, self.checkpoint_group())  # collective
            return good if good is not None else (None, self.load_config)
        return self.broadcast(self._last_good_path(root)), self.load_config  # rank 0 lists: every rank alike

    def _last_good_path(self, root: str) -> str | None:
        if self.global_rank != 0:
            return None
        try:
            location = fsio.resolve(root, self.load_config.storage_options)
            good = catalog.last_good(location, catalog.list_checkpoints(location))
        except Exception:  # noqa: BLE001 - a hint for an error being raised; never a second error
            log.debug("could not look up the last known-good checkpoint of %s", root, exc_info=True)
            return None
        return join(location.url, good[-1].name) if good else None

    def _has_committed(self, root: str) -> bool:
        if parse_dirname(root) is not None:  # a checkpoint directory itself: the loader opens it (or says why not)
            return True
        location = fsio.resolve(root, self.load_config.storage_options)
        return catalog.newest_committed(catalog.list_checkpoints(location)) is not None


def _last_good_hint(path: str | None) -> str:
    if path is None:
        return (
            "No checkpoint of this root has passed a restore drill, so there is no known-good one to fall back to; "
            "pick an older one with `shardckpt ls` and resume with ckpt_path=<its path>"
        )
    return (
        f"The last known-good checkpoint (newest that passed a restore drill) is {path}: resume from it with "
        "ckpt_path='last-good' (Hydra: resume=last-good), or set drill.fallback_to_last_good=true to do so automatically"
    )


class ShardedDDPStrategy(ShardedStrategy, DDPStrategy):
    """DDP (replicated parameters) with sharded, asynchronous, committed checkpoints."""

    strategy_name = "shardckpt_ddp"
    parallelism = "ddp"

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

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        registry.register(cls.strategy_name, cls, description="DDP with lightning_shardckpt checkpoints")


class ShardedFSDPStrategy(ShardedStrategy, ModelParallelStrategy):
    """FSDP2 / DTensor (ModelParallelStrategy; shard in `configure_model`) with lightning_shardckpt checkpoints."""

    strategy_name = "shardckpt_fsdp"
    parallelism = "fsdp"

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

    def setup_environment(self) -> None:
        # Lightning's "auto" sizes are data_parallel=num_nodes, tensor_parallel=devices: on one node a
        # model sharded over device_mesh["data_parallel"] is neither sharded nor gradient-synced, and the
        # replicas silently diverge. Ours: data-parallel over every rank unless sizes are given.
        self._data_parallel_size, self._tensor_parallel_size = mesh_sizes(
            self._data_parallel_size, self._tensor_parallel_size, self.num_nodes * self.num_processes
        )
        super().setup_environment()

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        registry.register(cls.strategy_name, cls, description="FSDP2 with lightning_shardckpt checkpoints")


def register() -> None:
    for strategy in (ShardedDDPStrategy, ShardedFSDPStrategy):
        if strategy.strategy_name not in StrategyRegistry:
            strategy.register_strategies(StrategyRegistry)


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


def mesh_sizes(data_parallel: int | str, tensor_parallel: int | str, world_size: int) -> tuple[int, int]:
    """(data_parallel_size, tensor_parallel_size) for `world_size` ranks; "auto" fills what is not given."""
    if data_parallel == "auto" and tensor_parallel == "auto":
        return world_size, 1
    if data_parallel == "auto" or tensor_parallel == "auto":
        given_name, given = (
            ("tensor_parallel_size", tensor_parallel)
            if data_parallel == "auto"
            else ("data_parallel_size", data_parallel)
        )
        if not isinstance(given, int) or given < 1 or world_size % given:
            raise ConfigError(
                f"{given_name}={given!r} does not divide the world size {world_size}; give both data_parallel_size "
                f"and tensor_parallel_size (their product is the world size), or neither (data-parallel over all ranks)"
            )
        other = world_size // given
        return (other, given) if data_parallel == "auto" else (given, other)
    if data_parallel * tensor_parallel != world_size:
        raise ConfigError(
            f"data_parallel_size={data_parallel} × tensor_parallel_size={tensor_parallel} must equal the world size "
            f"{world_size} (devices × num_nodes); set data_parallel_size={max(world_size // max(tensor_parallel, 1), 1)}"
        )
    return data_parallel, tensor_parallel


def _unwrap(optimizer: Any) -> Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer wraps the real one


def _looks_like_id(text: str) -> bool:
    return len(text) == 12 and all(c in "0123456789abcdef" for c in text)
