"""The tiers as a plug-in of every front door: `tiers=` shapes the plan (this node's fast root, a resume that
considers both tiers) and runs CheckpointTiers (checkpoint_tiers.py) through the run's lifecycle."""

from __future__ import annotations

from dataclasses import replace

from ...engine.config import save_config_from
from ...engine.save.saver import CheckpointSaver
from ...engine.tiers.config import TiersConfig
from ...errors import ConfigError
from ..plan import CheckpointPlan, Placement
from ..plugin import Plugin, PluginContext
from .checkpoint_tiers import CheckpointTiers


def tiered_dirpath(dirpath: str | None, config: TiersConfig | None) -> str:
    """The callback's dirpath: as given, or with tiers the fast tier's (a differing dirpath is refused); never
    empty. Incremental saves take tiers: every copy carries the earlier files a checkpoint references
    (engine/tiers/referenced_files.py)."""
    if config is None:
        if not dirpath:
            raise ConfigError("dirpath is empty; set it to a local directory or an fsspec URL such as s3://bucket/run")
        return str(dirpath)
    if dirpath and dirpath != config.fast.dirpath:
        raise ConfigError(
            f"dirpath={dirpath!r} and tiers.fast.dirpath={config.fast.dirpath!r} differ; "
            "with tiers, leave dirpath unset (the fast tier is where saves commit)"
        )
    return config.fast.dirpath


class TiersPlugin(Plugin):
    """CheckpointTiers as a plug-in of ShardedCheckpoint: created at set-up, once this node's rank is known."""

    def __init__(self, config: TiersConfig) -> None:
        self.config = config
        self.tiers: CheckpointTiers | None = None

    def shape_plan(self, plan: CheckpointPlan, placement: Placement) -> CheckpointPlan:
        """This node's fast root becomes the root; the strategy's resume considers both tiers."""
        if self.tiers is None:
            self.tiers = CheckpointTiers(self.config, placement.node_rank, placement.local_rank)
        self.tiers.accepted_keys = tuple(plan.load.public_keys)  # what the replicator may copy and sign again
        self.tiers.revoked_keys = tuple(plan.load.revoked_keys)  # and what it never copies, whoever signed
        fast = self.config.fast
        save = save_config_from(
            plan.save,
            node_local=fast.node_local,
            **({"storage_options": fast.storage_options} if fast.storage_options else {}),
        )
        return replace(plan, root=self.tiers.fast_dirpath, save=save, tier_restore=self.tiers)

    def setup(self, context: PluginContext) -> None:
        if context.stage == "fit":
            self.shaped("setup").preflight()

    def start(self, context: PluginContext) -> None:
        tiers = self.shaped("start")
        if context.run_id is None:
            raise ValueError(
                "TiersPlugin.start without a run id: the door starts plug-ins once its saver and run exist"
            )
        tiers.start(
            context.saver, context.run_id, context.allow_shared_root, context.is_global_zero, context.fault_hook
        )
        if (
            context.is_global_zero
            and tiers.replicator is not None
            and context.publish not in tiers.replicator.listeners
        ):
            tiers.replicator.listeners.append(context.publish)  # replication_ok, replication_lag_checkpoints
        if (
            context.is_global_zero
            and tiers.peer_replicator is not None
            and context.publish not in tiers.peer_replicator.listeners
        ):
            tiers.peer_replicator.listeners.append(context.publish)  # peer_replication_ok, ..._lag_checkpoints

    def before_save(self, context: PluginContext) -> None:
        if context.host is None:
            raise ValueError("TiersPlugin.before_save without the door's saver host (PluginContext.host)")
        self.shaped("before_save").before_save(context.host)  # collective: degraded mode when the fast tier failed

    def shaped(self, event: str) -> CheckpointTiers:
        """The tiers, made when the door had the plan shaped (`shape_plan`), which every door does at set-up."""
        if self.tiers is None:
            raise ValueError(f"TiersPlugin.{event} before shape_plan: a door must have its plan shaped first")
        return self.tiers

    def saver_override(self) -> CheckpointSaver | None:
        return self.tiers.degraded_saver if self.tiers is not None else None

    def owns(self, checkpoint_path: str) -> bool:
        return self.tiers is not None and self.tiers.owns(checkpoint_path)

    def spare(self, keep_last: int | None) -> set[str]:
        # checkpoints not yet on the durable tier (bounded: tiers.fast.max_unreplicated)
        return self.tiers.fast_spare(keep_last, self.tiers.run_id) if self.tiers is not None else set()

    def counters(self) -> dict[str, int]:
        # replicated, replication_failed, replication_lag_checkpoints, ...
        return self.tiers.counters() if self.tiers is not None else {}

    def flush(self) -> None:
        if self.tiers is not None:
            self.tiers.close()  # bounded flush (tiers.flush_timeout_s) of copies to the durable tier

    def close(self, context: PluginContext, *, finished: bool) -> None:
        if not finished and self.tiers is not None:
            self.tiers.close()
