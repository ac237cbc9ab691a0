"""CheckpointTiers: what ShardedCheckpoint(tiers=...) adds on top of a single root.

Saves commit on the fast tier (the callback's root, node-local when its dirpath has `{node_rank}`); a
Replicator (engine/tiers/replicate.py) copies them, verified, to the durable tier and commits them there;
retention runs per tier; a resume reads the newest checkpoint every rank can read, from either tier
(engine/tiers/restore.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from ..engine import catalog, ownership
from ..engine.collectives import all_gather_objects, broadcast_from_coordinator, new_checkpoint_group, rank_and_world
from ..engine.config import LoadConfig, SaveConfig, save_config_from
from ..engine.format.layout import parse_dirname
from ..engine.storage import fsio
from ..engine.tiers.config import TiersConfig
from ..engine.tiers.peer_restore import PeerRestore, restore_from_peers
from ..engine.tiers.peers import PeerReplicator
from ..engine.tiers.replicate import (
    DEGRADED_SAVES,
    UNREPLICATED_DROPPED,
    Replicator,
    missing_on_durable,
    newest_on_both,
)
from ..engine.tiers.restore import FAST, choose
from ..errors import ConfigError, StorageUnavailable
from . import retention
from .plugin import Plugin, PluginContext

log = logging.getLogger(__name__)


class CheckpointTiers:
    """Per rank: this node's view of the fast tier, the durable tier, and the replicator between them."""

    def __init__(self, config: TiersConfig, node_rank: int, local_rank: int) -> None:
        self.config = config
        self.node_rank, self.local_rank = node_rank, local_rank
        self.fast_dirpath = config.fast.dirpath_for(node_rank)
        self.fast = fsio.resolve(self.fast_dirpath, config.fast.storage_options)
        self.durable = fsio.resolve(config.durable.dirpath, config.durable.storage_options) if config.durable else None
        self.replicator: Replicator | None = None
        self._group: Any = None
        self.peer_replicator: PeerReplicator | None = None  # tiers.fast.peers: copies on peer nodes
        self._peer_group: Any = None
        self.peer_restore: PeerRestore | None = None  # the last resume's peer assembly (what it copied, why)
        self._dropped = 0
        self._fast_failed = False  # a save on the fast tier failed (full, failing): degraded mode at the next save
        self.degraded_saver: Any = None  # saves go straight to the durable tier (degraded mode)
        self._degraded_saves = 0
        self._last_counters: dict[str, int] = {}  # the replicator's counters when it stopped (logged after close)
        self.run_id: str | None = None
        self._committed_here: list[str] = []  # node-local fast tier, node > 0: this process's commits, in order

    # --- before training ---
    def preflight(self) -> None:
        """Every rank checks every tier it writes (its node's fast root, the durable root); all raise the first problem."""
        problem = None
        for location in (self.fast, self.durable):
            if location is None:
                continue
            try:
                fsio.preflight(location)
            except StorageUnavailable as err:
                problem = f"{'fast' if location is self.fast else 'durable'} tier: {err}"
                break
        first = next((p for p in all_gather_objects("tiers-preflight", problem, None) if p), None)
        if first is not None:
            raise StorageUnavailable(first)

    # --- training ---
    def start(
        self, saver: Any, run_id: str, allow_shared_root: bool, is_global_zero: bool, fault_hook: Any = None
    ) -> None:
        """Once per fit, on every rank at the same point, after the saver exists: replicator, catch-up, listeners."""
        self.run_id = run_id  # the fast tier's retention rule counts this run's checkpoints
        self._start_peers(saver)
        if self.durable is None or self.replicator is not None:
            return
        # its own group (see replicate.py): the saver's thread owns the checkpoint group
        self._group = new_checkpoint_group(self.config.collective_timeout_s)
        ownership.ensure_owner(self.durable, run_id, allow_shared_root, self._group, saver.config.front_door)
        catch_up = newest_durable = None
        if is_global_zero:
            try:
                newest_durable = newest_on_both(self.fast, self.durable, run_id)  # for the fast tier's retention rule
                catch_up = missing_on_durable(self.fast, self.durable, run_id)
            except Exception:  # noqa: BLE001 - an unreachable durable tier: the first copy retries
                log.warning("cannot compare the fast and durable tiers; no catch-up copy", exc_info=True)
        catch_up = broadcast_from_coordinator("tiers-catch-up", catch_up, self._group)
        self.replicator = Replicator(
            self.config,
            self.fast,
            self.durable,
            group=self._group,
            on_committed=self._durable_retention if is_global_zero else None,
            fault_hook=fault_hook,
        )
        self.replicator.newest_durable = newest_durable
        if catch_up is not None:
            log.info("%s is committed on the fast tier but not on %s: copying it", catch_up, self.durable.url)
            self.replicator.submit(catch_up)
        saver.add_listener(self._note_fast_outcome)
        replicator = self.replicator
        saver.add_listener(
            lambda record: (
                replicator.submit(record.path.rstrip("/").rsplit("/", 1)[-1])
                if record.outcome == "committed" and record.path
                else None
            )
        )
        if self.config.fast.node_local and self.node_rank > 0 and self.local_rank == 0:
            saver.add_listener(self.prune_node_local)

    def _start_peers(self, saver: Any) -> None:
        """tiers.fast.peers: a PeerReplicator on its own group (its thread's collectives), fed every fast commit."""
        if self.config.fast.peers is None or self.peer_replicator is not None:
            return
        self._peer_group = new_checkpoint_group(self.config.collective_timeout_s)
        peers = PeerReplicator(self.config.fast.peers, self.fast, group=self._peer_group)
        self.peer_replicator = peers
        saver.add_listener(
            lambda record: (
                peers.submit(record.path.rstrip("/").rsplit("/", 1)[-1])
                if record.outcome == "committed" and record.path
                else None
            )
        )

    def _close_peers(self, timeout: float) -> None:
        peers, self.peer_replicator = self.peer_replicator, None
        if peers is None:
            return
        if not peers.close(timeout):
            log.error("peer copies of the newest fast-tier checkpoint did not complete before close")
        if peers.stopped and self._peer_group is not None and peers.broken is None:
            import torch.distributed as dist

            dist.destroy_process_group(self._peer_group)
        self._peer_group = None
        self._last_counters = {**self._last_counters, **peers.snapshot()}

    def close(self, timeout: float | None = None) -> None:
        """Bounded flush of pending copies (flush_timeout_s), then stop; the group goes once the thread is gone."""
        if self.degraded_saver is not None:
            self.degraded_saver.close()
        self._close_peers(self.config.flush_timeout_s if timeout is None else timeout)
        replicator, self.replicator = self.replicator, None
        if replicator is None:
            return
        replicator.close(self.config.flush_timeout_s if timeout is None else timeout)
        if replicator.stopped and self._group is not None and replicator.broken is None:
            import torch.distributed as dist

            dist.destroy_process_group(self._group)
        self._group = None
        self._last_counters = {**self._last_counters, **replicator.snapshot()}

    def counters(self) -> dict[str, int]:
        source = dict(self._last_counters)
        for running in (self.replicator, self.peer_replicator):
            if running is not None:
                source.update(running.snapshot())
        return {
            **source,
            **({UNREPLICATED_DROPPED: self._dropped} if self._dropped else {}),
            **({DEGRADED_SAVES: self._degraded_saves} if self._degraded_saves else {}),
        }

    # --- degraded mode: the fast tier is full or failing ---
    def _note_fast_outcome(self, record: Any) -> None:
        if record.outcome == "failed":
            self._fast_failed = True

    def before_save(self, strategy: Any) -> None:
        """Every rank, before each save: one collective decides, for all alike, whether saves leave the fast tier.

        After a fast-tier save failed (a full disk, a failing device), the rest of the fit saves directly to
        the durable tier (counted as degraded_saves): slower saves, but checkpoints go on being made.
        """
        if self.durable is None:
            return
        if self.degraded_saver is not None:
            self._degraded_saves += 1
            return
        if not strategy.reduce_boolean_decision(self._fast_failed, all=False):
            return
        from ..engine.save.saver import CheckpointSaver

        fast = strategy.existing_saver(self.fast_dirpath)
        if fast is not None:
            fast.wait()  # one saver thread at a time on the checkpoint group
        config = replace(
            strategy.save_config, storage_options=dict(self.config.durable.storage_options), node_local=False
        )
        self.degraded_saver = CheckpointSaver(self.config.durable.dirpath, config, group=strategy.checkpoint_group())
        # the strategy's savers: trainer.save_checkpoint waits for it, teardown closes it before the group goes
        strategy.replace_saver(self.config.durable.dirpath, self.degraded_saver)
        self._degraded_saves += 1
        if rank_zero():
            log.error(
                "a save on the fast tier %s failed: degraded mode, the rest of this fit saves directly to %s",
                self.fast.url,
                self.durable.url,
            )

    # --- retention per tier ---
    def fast_spare(self, keep_last: int, run_id: str | None) -> set[str]:
        """Fast-tier checkpoints retention must keep although outside keep_last: newer than the newest durable copy,
        at most `max_unreplicated` of them; older unreplicated ones are dropped (counted, logged)."""
        if self.durable is None:
            return set()
        entries = catalog.committed_of_run(catalog.list_checkpoints(self.fast), run_id)
        newest_durable = self.replicator.newest_durable if self.replicator is not None else None
        names = [entry.name for entry in entries]
        start = names.index(newest_durable) + 1 if newest_durable in names else 0
        unreplicated = names[start:]
        outside = [name for name in unreplicated if name not in names[-keep_last:]]
        cap = self.config.fast.max_unreplicated
        spare = set(outside[-cap:]) if cap else set()
        dropped = [name for name in outside if name not in spare]
        if dropped:
            self._dropped += len(dropped)
            log.warning(
                "fast tier %s: deleting %d checkpoint(s) never copied to %s (%s): more than max_unreplicated=%d wait",
                self.fast.url,
                len(dropped),
                self.durable.url,
                ", ".join(dropped),
                cap,
            )
        return spare

    def _durable_retention(self, name: str) -> None:
        keep = self.config.durable.keep_last if self.config.durable is not None else None
        if keep is not None:
            newest = catalog.newest_committed(catalog.list_checkpoints(self.durable))
            retention.apply(self.durable, keep, None, run_id=newest.run_id if newest else None, just_committed=name)

    def prune_node_local(self, record: Any) -> list[str]:
        """A node other than 0 holds shards of checkpoints whose manifest is on node 0: keep its newest few only.

        Newest by commit order, as node 0's retention does (policies/retention.py), never by step: after a
        rollback the new branch's commits are the newest whatever their steps. This node has no manifest (no
        seq, no commit time), but it knows its own write order, which is the commit order: its ranks write a
        checkpoint's shards before that checkpoint commits, and the next save starts only after (the commit is
        collective). So: this process's commits in the order its saver reported them, newest; directories of
        earlier processes by their modification time on this node's own disk (one clock, no other node's).
        No collective, no durable-tier listing (it lags, may be absent, and copies only every N-th checkpoint).
        Returns the directory names deleted.
        """
        if record.outcome == "committed" and record.path:
            self._committed_here.append(record.path.rstrip("/").rsplit("/", 1)[-1])
        if not self.config.fast.keep_last:
            return []
        if self.peer_replicator is not None and self.peer_replicator.on_coordinators_storage:
            return []  # node 0's root under another name (a symlink): node 0's retention keeps what it spares there
        keep = self.config.fast.keep_last + self.config.fast.max_unreplicated + 1
        order = {name: index for index, name in enumerate(self._committed_here)}
        deleted = []
        try:
            infos = self.fast.fs.ls(self.fast.path, detail=True)
            listed = [(str(info["name"]).rstrip("/").rsplit("/", 1)[-1], info) for info in infos]
            # oldest first: earlier processes' directories by write time, then this process's commits in order
            checkpoints = sorted(
                (order.get(name, -1), _written_at(info), parsed.step, name)
                for name, info in listed
                if (parsed := parse_dirname(name)) is not None
            )
            for *_, name in checkpoints[:-keep]:
                self.fast.fs.rm(f"{self.fast.path}/{name}", recursive=True)
                deleted.append(name)
        except Exception:  # noqa: BLE001 - the next commit retries
            log.debug("pruning %s failed", self.fast.url, exc_info=True)
        return deleted

    # --- restore ---
    def pick(
        self, which: str, base: LoadConfig, group: Any
    ) -> tuple[str, LoadConfig, list[tuple[str, LoadConfig, str]]]:
        """(checkpoint path to load, its load config, fallbacks) for `latest` / `last-good`; collective on every rank.

        With peer copies, `latest` first assembles the newest checkpoint the surviving nodes hold whole in every
        node root (engine/tiers/peer_restore.py); the durable tier is then consulted only if it lists a newer step.
        """
        durable = self.durable
        if self.config.fast.peers is not None and which == "latest":
            durable = self._restore_from_peers(group)
        choices = choose(self.fast, durable, which, group)
        if not choices:
            return self.fast_dirpath, base, []
        first = choices[0]
        if rank_zero():
            log.info("resuming from the %s tier: %s (step %d); %s", first.tier, first.url, first.step, first.reason)
        fallbacks = [
            (
                c.url,
                self._config_for(c.tier, base),
                f"the {first.tier} copy of {first.name} did not load; falling back to its {c.tier} copy at {c.url}",
            )
            for c in choices[1:]
            if c.name == first.name
        ]
        return first.url, self._config_for(first.tier, base), fallbacks

    def _restore_from_peers(self, group: Any) -> Any:
        """Collective: assemble from peer copies; returns the durable location to consider too (None: not needed)."""
        restored = restore_from_peers(self.fast, self.config.fast.dirpath, self.config.fast.peers, group)
        self.peer_restore = restored
        if restored.name is None:
            if rank_zero():
                log.warning("no complete peer copy on the fast tier: %s; reading the durable tier", restored.reason)
            return self.durable
        if rank_zero():
            log.info("fast tier: %s", restored.reason)
        newer = None
        if self.durable is not None and rank_zero():
            newer = _durable_newest_step(self.durable)  # a listing of names only: no object is read
        newer = broadcast_from_coordinator("peer-durable-newer", newer, group)
        if newer is not None and newer > restored.step:
            return self.durable
        return None

    def last_good(self, base: LoadConfig, group: Any) -> tuple[str, LoadConfig] | None:
        """(path, load config) of the newest drilled checkpoint every rank can read, on either tier; collective.

        Where a `latest` picked from the tiers falls back to: drill records live in a tier's root (the fast
        tier's: drills run there), never inside the picked checkpoint's directory.
        """
        choices = choose(self.fast, self.durable, catalog.LAST_GOOD, group)
        if not choices:
            return None
        return choices[0].url, self._config_for(choices[0].tier, base)

    def _config_for(self, tier: str, base: LoadConfig) -> LoadConfig:
        options = self.config.fast.storage_options if tier == FAST else self.config.durable.storage_options
        return replace(base, storage_options=dict(options))

    def owns(self, path: str) -> bool:
        """`path` is a checkpoint of the durable tier (a resume from it continues this run)."""
        if self.durable is None:
            return False
        root = fsio.resolve(path.rstrip("/").rsplit("/", 1)[0], self.config.durable.storage_options)
        return root.same_place(self.durable)


def _written_at(info: dict[str, Any]) -> float:
    """A listed directory's modification time in seconds (local disks give `mtime`; object stores `LastModified`)."""
    value = info.get("mtime", info.get("LastModified", info.get("last_modified", 0.0)))
    return value.timestamp() if hasattr(value, "timestamp") else float(value or 0.0)


def _durable_newest_step(durable: Any) -> int | None:
    try:
        names = [str(n).rstrip("/").rsplit("/", 1)[-1] for n in durable.fs.ls(durable.path, detail=False)]
    except Exception:  # noqa: BLE001 - unreachable: the peer copy is what there is
        return None
    steps = [parsed.step for name in names if (parsed := parse_dirname(name)) is not None]
    return max(steps) if steps else None


def rank_zero() -> bool:
    return rank_and_world()[0] == 0


def tiered_dirpath(dirpath: str | None, config: TiersConfig | None, save: SaveConfig) -> str:
    """The callback's dirpath: as given, or with tiers the fast tier's (a differing dirpath, or incremental
    saves, are refused); never empty."""
    if config is None:
        if not dirpath:
            raise ConfigError("dirpath is empty; set it to a local directory or an fsspec URL such as s3://bucket/run")
        return str(dirpath)
    if dirpath and dirpath != config.fast.dirpath:
        raise ConfigError(
            f"dirpath={dirpath!r} and tiers.fast.dirpath={config.fast.dirpath!r} differ; "
            "with tiers, leave dirpath unset (the fast tier is where saves commit)"
        )
    if save.incremental:
        raise ConfigError(
            "save.incremental with tiers is not supported yet: the replicator copies a checkpoint's own "
            "files, not the earlier ones an incremental checkpoint references; use one or the other"
        )
    return config.fast.dirpath


class TiersPlugin(Plugin):
    """CheckpointTiers as a plug-in of ShardedCheckpoint: created at set-up, once this node's rank is known."""

    def __init__(self, config: TiersConfig) -> None:
        self.config = config
        self.tiers: CheckpointTiers | None = None

    def shape_plan(self, plan: Any, placement: Any) -> Any:
        """This node's fast root becomes the root; the strategy's resume considers both tiers."""
        if self.tiers is None:
            self.tiers = CheckpointTiers(self.config, placement.node_rank, placement.local_rank)
        fast = self.config.fast
        save = save_config_from(
            plan.save,
            node_local=fast.node_local,
            **({"storage_options": fast.storage_options} if fast.storage_options else {}),
        )
        return replace(plan, root=self.tiers.fast_dirpath, save=save, tier_restore=self.tiers)

    def setup(self, context: PluginContext) -> None:
        if context.stage == "fit":
            self.tiers.preflight()

    def start(self, context: PluginContext) -> None:
        tiers = self.tiers
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
        self.tiers.before_save(context.strategy)  # collective: degraded mode when the fast tier failed

    def saver_override(self) -> Any:
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
