"""CheckpointTiers: what a front door's `tiers=` adds on top of a single root.

Saves commit on the fast tier (the callback's root, node-local when its dirpath has `{node_rank}`); a
Replicator (engine/tiers/replicate.py) copies them, verified, to the durable tier and commits them there;
retention runs per tier; a resume reads the newest checkpoint every rank can read, from either tier
(engine/tiers/restore.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from ...engine import catalog, commit_index, ownership
from ...engine.collectives import all_gather_objects, broadcast_from_coordinator, new_checkpoint_group, rank_and_world
from ...engine.config import LoadConfig
from ...engine.format import bounded_json, signing
from ...engine.format.manifest_schema import split_reference
from ...engine.format.names import join, parse_dirname
from ...engine.format.part_references import FILE as HOLDER_FILE
from ...engine.format.part_references import HOLDERS
from ...engine.format.parts import PART_MAX_BYTES, PART_SUFFIX
from ...engine.storage import fsio
from ...engine.storage.fsio import Location
from ...engine.tiers.config import PeersConfig, TierConfig, TiersConfig
from ...engine.tiers.peer_restore import PeerRestore, restore_from_peers
from ...engine.tiers.peers import PeerReplicator
from ...engine.tiers.replicate import (
    DEGRADED_SAVES,
    UNREPLICATED_DROPPED,
    Replicator,
    durable_ahead,
    missing_on_durable,
    newest_on_both,
)
from ...engine.tiers.restore import DURABLE, FAST, choose_signed, listed_anywhere
from ...errors import CheckpointNotFound, SignatureRefused, StorageUnavailable
from .. import retention
from ..plan import Fallback, TierPicked
from ..plugin import SaverHosting

log = logging.getLogger(__name__)


class CheckpointTiers:
    """Per rank: this node's view of the fast tier, the durable tier, and the replicator between them."""

    def __init__(self, config: TiersConfig, node_rank: int, local_rank: int) -> None:
        self.config = config
        self.node_rank, self.local_rank = node_rank, local_rank
        self._newest_durable_at_close: str | None = None  # the closed replicator's, for fit end's retention pass
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
        # the run's accepted public keys (LoadConfig.public_keys, from the plan): a signed run's replicator copies
        # (and signs again) only what its own key or one of these signed
        self.accepted_keys: tuple[Any, ...] = ()
        self.revoked_keys: tuple[str, ...] = ()  # LoadConfig.revoked_keys: refused as a copy's source too

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
                continued = {location.url for location in saver.lineage_from}
                if self.durable.url not in continued and durable_ahead(self.fast, self.durable, run_id):
                    # this run's seq goes on from the durable tier's newest commit (one order across the tiers);
                    # the coordinator alone computes a commit's lineage, so only its saver needs to know
                    saver.lineage_from = (*saver.lineage_from, self.durable)
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
            sign=saver.config.sign,  # a signed run's durable copies are signed too
            public_keys=self.accepted_keys,
            revoked_keys=self.revoked_keys,
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
        self._newest_durable_at_close = replicator.newest_durable  # fit end's retention pass still asks (fast_spare)
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

    def before_save(self, host: SaverHosting) -> None:
        """Every rank, before each save: one collective decides, for all alike, whether saves leave the fast tier.

        After a fast-tier save failed (a full disk, a failing device), the rest of the fit saves directly to
        the durable tier (counted as degraded_saves): slower saves, but checkpoints go on being made.
        """
        if self.durable is None:
            return
        if self.degraded_saver is not None:
            self._degraded_saves += 1
            return
        if not host.reduce_boolean_decision(self._fast_failed, all=False):
            return
        from ...engine.save.saver import CheckpointSaver

        fast = host.existing_saver(self.fast_dirpath)
        if fast is not None:
            fast.wait()  # one saver thread at a time on the checkpoint group
        config = replace(host.save_config, storage_options=dict(self.durable_tier.storage_options), node_local=False)
        # its commits continue the run's fast-tier commits (seq, parent): a replication of an older fast checkpoint
        # then reads as older on the durable tier (and is skipped as superseded, engine/tiers/replicate.py)
        self.degraded_saver = CheckpointSaver(
            self.durable_tier.dirpath, config, group=host.checkpoint_group(), lineage_from=(self.fast,)
        )
        # the door's savers: a blocking save waits for it, closing the door closes it before the group goes
        host.replace_saver(self.durable_tier.dirpath, self.degraded_saver)
        self._degraded_saves += 1
        if rank_zero():
            log.error(
                "a save on the fast tier %s failed: degraded mode, the rest of this fit saves directly to %s",
                self.fast.url,
                self.durable.url,
            )

    # --- retention per tier ---
    def fast_spare(self, keep_last: int | None, run_id: str | None) -> set[str]:
        """Fast-tier checkpoints retention must keep although outside keep_last: newer than the newest durable copy,
        at most `max_unreplicated` of them; older unreplicated ones are dropped (counted, logged)."""
        if self.durable is None or keep_last is None:  # keep_last None keeps every checkpoint: none to spare
            return set()
        entries = catalog.committed_of_run(catalog.list_checkpoints(self.fast), run_id)
        if self.replicator is not None:
            newest_durable = self.replicator.newest_durable
        else:
            newest_durable = self._newest_durable_at_close
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
        if keep is not None and self.durable is not None:
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
                (order.get(name, -1), fsio.written_at(info), parsed.step, name)
                for name, info in listed
                if (parsed := parse_dirname(name)) is not None
            )
            referenced = self._referenced_here([name for *_, name in checkpoints[-keep:]])
            for *_, name in checkpoints[:-keep]:
                if name in referenced:  # incremental: a kept checkpoint's parts read this one's files
                    continue
                self.fast.fs.rm(f"{self.fast.path}/{name}", recursive=True)
                deleted.append(name)
        except Exception:  # noqa: BLE001 - the next commit retries
            log.debug("pruning %s failed", self.fast.url, exc_info=True)
        return deleted

    def _referenced_here(self, kept: list[str]) -> set[str]:
        """Sibling directories the parts this node root holds of `kept` reference (FORMAT.md §10.6): this node has no
        manifest to list them, but its ranks' parts name every earlier file they read. Read as written here, by this
        node's ranks; an unreadable part pins everything (nothing referenced-looking is deleted)."""
        out: set[str] = set()
        for name in kept:
            directory = join(self.fast.path, name)
            try:
                parts = [p for p in self.fast.fs.ls(directory, detail=False) if str(p).endswith(PART_SUFFIX)]
            except FileNotFoundError:
                continue
            for path in parts:
                try:
                    part = bounded_json.loads(fsio.read_small(self.fast.fs, path, PART_MAX_BYTES), PART_MAX_BYTES)
                    for held in part.get(HOLDERS) or []:
                        sibling = split_reference(held[HOLDER_FILE])
                        if sibling is None:
                            raise ValueError(f"{held[HOLDER_FILE]!r} is no reference")
                        out.add(sibling[0])
                except Exception:  # noqa: BLE001 - unreadable: keep every directory (the next commit retries)
                    log.debug("cannot read %s; keeping every checkpoint it might reference", path, exc_info=True)
                    return {parsed for p in self.fast.fs.ls(self.fast.path, detail=False) if (parsed := _name(p))}
        return out

    # --- restore ---
    def pick(self, which: str | int, base: LoadConfig, group: Any) -> TierPicked | None:
        """(checkpoint path to load, its load config, fallbacks, signature skips) for `latest`, `last-good`, a step,
        an id or a directory name, on either tier; None when neither tier holds it. Collective on every rank.

        With peer copies, `latest` first assembles the newest commit the surviving nodes hold whole in every node
        root (engine/tiers/peer_restore.py); the durable tier is considered beside it, by commit order, unless its
        commit index vouches that its newest commit is the same checkpoint (then no checkpoint of it is read: a
        rollback's newer commit of a smaller step is never hidden, nor a newer commit behind a stale `latest`, and a
        resume that has it locally reads no object). The durable copy of the
        picked checkpoint is always a fallback when the fast one fails its checks.
        A checkpoint some rank cannot read is no candidate; if every one listed is such, that is an error (never a
        fresh start over checkpoints that exist). With `base.require_signature`, a copy the signature policy refuses
        is no candidate either (engine/tiers/restore.py `choose_signed`): `latest` and `last-good` pass over it to the
        newest validly signed commit, naming what they passed over; if the policy refused every candidate, the error
        says so.
        """
        durable: Location | None = self.durable
        refused_by_peers: dict[str, tuple[str, tuple[Any, ...]]] = {}
        policy = signing.policy_of(base.require_signature, base.public_keys, base.revoked_keys)
        if self.config.fast.peers is not None and which == "latest":
            durable = self._restore_from_peers(group, policy)
            refused_by_peers = self.peer_restore.refused if self.peer_restore is not None else {}
        tier_pick = choose_signed(self.fast, durable, which, group, policy, refused_by_peers)
        choices, refused = tier_pick.choices, tier_pick.refused
        if refused and rank_zero():
            for copy, why in refused.items():  # the words of `latest` without tiers (engine/catalog.py)
                log.warning("skipping %s for `%s`: %s", copy, which, why)
        if not choices:
            listed = listed_anywhere(self.fast, durable, which) if rank_zero() else None
            listed = broadcast_from_coordinator("tier-listed", listed, group)
            if refused:  # every rank knows them (gathered): all raise alike
                unreadable = [copy for copy in listed or [] if copy not in refused]
                raise SignatureRefused(
                    f"the signature policy refused every candidate for {which!r} on the fast and durable tiers: "
                    + "; ".join(f"{copy} ({why})" for copy, why in list(refused.items())[:4])
                    + (f"; and {len(refused) - 4} more (logged)" if len(refused) > 4 else "")
                    + (f"; not readable by every rank: {', '.join(unreadable)}" if unreadable else "")
                    + ". Resume one signed by an accepted key by its name or step, or add the key that signed these "
                    "to public_keys if you trust it"
                )
            if listed:
                raise CheckpointNotFound(
                    f"{', '.join(listed)} {'is' if len(listed) == 1 else 'are'} committed but not readable by every "
                    "rank (a node-local tier on a resized or replaced cluster): resume from the durable tier's copy, "
                    "or on the nodes that hold the files"
                )
            return None
        first = choices[0]
        if rank_zero():
            skipped = tier_pick.signature_skipped
            log.info(
                "resuming from the %s tier: %s (step %d); %s%s",
                first.tier,
                first.url,
                first.step,
                first.reason,
                f"; passed over (the signature policy refused them): {', '.join(skipped)}" if skipped else "",
            )
        copies = [(c.tier, c.url) for c in choices[1:] if c.name == first.name]
        refused_durable = f"{DURABLE}:{first.name}" in refused
        if first.tier == FAST and self.durable is not None and not copies and not refused_durable:
            # not considered (peer copies: the durable tier was not read): its copy, if it has one, is still a copy
            copies.append((DURABLE, join(self.durable.url, first.name)))
        fallbacks = [
            Fallback(
                url,
                self._config_for(tier, base),
                f"the {first.tier} copy of {first.name} did not load; falling back to its {tier} copy at {url}",
            )
            for tier, url in copies
        ]
        if first.tier == FAST and self.config.fast.peers is not None:  # first: the nearest intact copy of a file
            fallbacks.insert(
                0,
                Fallback(
                    first.url,
                    self._config_for(FAST, base),
                    f"the fast copy of {first.name} did not load; replacing its damaged files from intact peer copies",
                    prepare=lambda group: self._repair(first.name, group),
                ),
            )
        return TierPicked(first.url, self._config_for(first.tier, base), fallbacks, tier_pick.signature_skipped)

    def _restore_from_peers(self, group: Any, policy: signing.SignaturePolicy | None) -> Location | None:
        """Collective: assemble from peer copies (the newest one `policy` accepts); returns the durable location to
        consider beside it (None: its commit index vouches that its newest commit is the checkpoint just assembled,
        so nothing newer is there)."""
        restored = restore_from_peers(self.fast, self.config.fast.dirpath, self.peers_config, group, policy=policy)
        self.peer_restore = restored
        if restored.name is None:
            if rank_zero():
                log.warning("no complete peer copy on the fast tier: %s; reading the durable tier", restored.reason)
            return self.durable
        if rank_zero():
            log.info("fast tier: %s", restored.reason)
        nothing_newer = False
        if self.durable is not None and rank_zero():
            try:
                # its commit index and directory names (no checkpoint's object read), never the bare pointer: a lost
                # or rewritten `latest` naming the assembled checkpoint would hide a newer durable commit (degraded
                # mode's); when they cannot vouch, the choice considers the durable tier
                nothing_newer = commit_index.vouches_newest(self.durable, restored.name)
            except Exception:  # noqa: BLE001 - unreachable: consider it (the choice lists it or leaves it out)
                log.debug("cannot read %s's commit index", self.durable.url, exc_info=True)
        nothing_newer = broadcast_from_coordinator("peer-durable-latest", nothing_newer, group)
        return None if nothing_newer else self.durable

    def _repair(self, name: str, group: Any) -> None:
        """Collective: files of `name` that fail their checksums in any node root are replaced from intact peer
        copies (the load that follows says whether that was enough)."""
        repaired = restore_from_peers(self.fast, self.config.fast.dirpath, self.peers_config, group, repair=name)
        if rank_zero():
            log.warning("fast tier: %s", repaired.reason)

    def last_good(self, base: LoadConfig, group: Any) -> tuple[str, LoadConfig] | None:
        """(path, load config) of the newest drilled checkpoint every rank can read, on either tier; collective.

        Where a `latest` picked from the tiers falls back to: drill records live in a tier's root (the fast
        tier's: drills run there), never inside the picked checkpoint's directory.
        """
        policy = signing.policy_of(base.require_signature, base.public_keys, base.revoked_keys)
        choices = choose_signed(self.fast, self.durable, catalog.LAST_GOOD, group, policy).choices
        if not choices:
            return None
        return choices[0].url, self._config_for(choices[0].tier, base)

    @property
    def durable_tier(self) -> TierConfig:
        """The durable tier's options, where only a run with a durable tier gets (self.durable is made from them)."""
        assert self.config.durable is not None, "a durable-tier step of a run without a durable tier"
        return self.config.durable

    @property
    def peers_config(self) -> PeersConfig:
        """The fast tier's peer copies, where only a run that has them gets (a resume from peers, a repair)."""
        assert self.config.fast.peers is not None, "a peer-copy step of a run without fast.peers"
        return self.config.fast.peers

    def tier_of(self, checkpoint_path: str) -> str:
        """Where a resume read `checkpoint_path`, in the words of its console line."""
        return "durable tier" if self.owns(checkpoint_path) else "fast tier"

    def _config_for(self, tier: str, base: LoadConfig) -> LoadConfig:
        options = self.config.fast.storage_options if tier == FAST else self.durable_tier.storage_options
        return replace(base, storage_options=dict(options))

    def owns(self, path: str) -> bool:
        """`path` is a checkpoint of the durable tier (a resume from it continues this run)."""
        if self.durable is None:
            return False
        parent = path.rstrip("/").rsplit("/", 1)[0]
        if fsio.protocol_of(parent) != fsio.protocol_of(self.durable_tier.dirpath):
            # another kind of storage (the fast tier's): the durable tier's options could not even open it
            return False
        return fsio.resolve(parent, self.durable_tier.storage_options).same_place(self.durable)


def _name(path: Any) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def rank_zero() -> bool:
    return rank_and_world()[0] == 0
