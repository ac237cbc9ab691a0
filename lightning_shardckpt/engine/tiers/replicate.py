"""Replicator: copies checkpoints committed on the fast tier to the durable tier, verified, and commits them there.

One background thread per rank takes fast-tier commits in request order. For each copy:

1. collective "replicate-pick": the coordinator decides which checkpoint (the newest one due: a copy
   that fell behind skips to the newest, counted as `replication_skipped`) and broadcasts its fast
   manifest;
2. every rank uploads the files it wrote itself (its `__<rank>_0.distcp`; the coordinator also
   `.metadata`), streamed and checked against the manifest's checksums (tier_copy.py): no funnel, no
   staging copy;
3. collective "replicate-receipts": every rank's outcome reaches the coordinator, which commits the
   durable copy only when every upload is confirmed: commit record, then the manifest with
   create-if-absent (the same commit point as a save), then `latest`;
4. collective "replicate-outcome": every rank learns the result; a failure is retried with backoff
   (the durable tier may be unreachable for a while).

A signed run signs its durable copies again (the manifest gains `replicated_from`), so the copy must never vouch
for more than the fast copy did: before anything is uploaded, the coordinator checks the fast manifest's signature
against the run's accepted keys (its signer's own, and LoadConfig.public_keys) in step 1, and every rank checks the
files it is about to upload against the signed digests (collective "replicate-vouched", between steps 1 and 2).
A checkpoint that fails either is refused: never copied, never retried, counted as `replication_refused` and
logged with its path and why; it stays on the fast tier, where a signed resume refuses it too.

A checkpoint older than the durable tier's newest commit of its run (by `seq`, the run's commit order across
tiers) is not copied: counted as `replication_superseded`. That happens after degraded mode (the fast tier
filled; later saves committed on the durable tier directly) when the close or the next run's catch-up owes the
last fast commit, which is older. Committed there it would move the durable `latest` back to it, and a
retention window ordered by `seq` would spend a slot on it; the durable tier exists to hold the newest state.

The replicator has its own gloo group, created once at set-up, not the saver's checkpoint group: the
saver's thread runs its collectives on that group at any moment, and two threads issuing collectives
on one group interleave them (each rank could pair the saver's broadcast with the replicator's), which
deadlocks or mixes payloads. Each background thread owns one group; each group sees one thread's
collectives, in the same order on every rank.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from ...errors import CorruptCheckpoint, SignatureRefused
from .. import catalog, metrics
from ..collectives import all_gather_objects, broadcast_from_coordinator, rank_and_world
from ..format import groups, signing
from ..format.manifest import files_of, files_with_metadata, transfer_order
from ..format.names import MANIFEST, checkpoint_dirname_parts, join, shard_rank
from ..metrics import RunCounters
from ..save.commit import publish
from ..storage.fsio import Location
from . import referenced_files
from .backlog import Backlog
from .config import TiersConfig
from .verified_copy import copy_checked, copy_verified

log = logging.getLogger(__name__)

REPLICATED = "replicated"
REPLICATION_FAILED = "replication_failed"
REPLICATION_SKIPPED = "replication_skipped"
REPLICATION_REFUSED = "replication_refused"  # a signed run's fast copy whose signature or digests do not hold
REPLICATION_SUPERSEDED = "replication_superseded"  # not copied: the durable tier holds a newer commit of the run
REPLICATION_LAG = "replication_lag_checkpoints"  # a gauge: fast commits newer than the newest durable copy
UNREPLICATED_DROPPED = "unreplicated_dropped"
DEGRADED_SAVES = "degraded_saves"
REPLICATED_FROM = "replicated_from"  # the durable manifest's record of where it was copied from (docs/FORMAT.md)

_STOP = object()
FaultHook = Callable[[str], None]


class Replicator:
    """Construct on every rank at the same point (after the group exists); `submit` on every rank alike."""

    def __init__(
        self,
        config: TiersConfig,
        fast: Location,
        durable: Location,
        *,
        group: Any,
        on_committed: Callable[[str], None] | None = None,
        fault_hook: FaultHook | None = None,
        sleep: Callable[[float], None] = time.sleep,
        sign: Any = None,
        public_keys: tuple[Any, ...] = (),
        revoked_keys: tuple[str, ...] = (),
    ) -> None:
        """`sign` (SaveConfig.sign, signing on): the durable copy's manifest (the original's plus `replicated_from`)
        is signed again with the run's key, so a reader with a signature policy accepts either tier's copy; only a
        fast copy signed by that key or one of `public_keys` (PEM files or text, validity windows), by none of
        `revoked_keys`, whose files match its signed digests, is copied."""
        assert config.durable is not None
        self.sign = sign if sign is not None and sign.enabled else None
        self.public_keys = tuple(public_keys)
        self.revoked_keys = tuple(revoked_keys)
        self._policy: signing.SignaturePolicy | None = None  # coordinator, signing on: built at the first copy
        self.config = config
        self.fast, self.durable = fast, durable
        self.group = group
        self.rank = rank_and_world(group)[0]
        self.counters = RunCounters()
        self.lag = 0  # fast commits submitted since the newest durable commit
        self.newest_durable: str | None = None
        self.broken: BaseException | None = None  # a collective failed (a rank died): no further copies this run
        self._on_committed = on_committed or (lambda name: None)
        self._fault = fault_hook or (lambda point: None)
        self._sleep = sleep
        self._queue: queue.Queue[Any] = queue.Queue()
        self._backlog = Backlog()  # its lock also guards lag and newest_durable
        self._stop_requested = threading.Event()
        self._flush_deadline: float | None = None
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # coordinator: each attempt's event (health rules)
        self._owed: str | None = None  # coordinator: the newest checkpoint the cadence passed over since the last copy
        self._since_copy = 0  # fast commits since the last copy (every_n_checkpoints)
        self._last_copy_time = time.monotonic()
        self._thread = threading.Thread(target=self._work, name="shardckpt-replicator", daemon=True)
        self._thread.start()

    # --- the caller's side (any thread; every rank alike) ---
    def submit(self, dirname: str) -> None:
        """A checkpoint committed on the fast tier; call on every rank in commit order."""
        with self._backlog.lock:
            self._backlog.submitted += 1
            self.lag += 1
        self._queue.put(dirname)

    @property
    def pending(self) -> int:
        """Submitted commits the thread has not yet copied or skipped (it may still be on them)."""
        return self._backlog.pending

    def flush(self, timeout: float) -> bool:
        """Wait until every submitted checkpoint was copied or skipped; False if `timeout` passed first.

        While flushing, the newest pending checkpoint is copied even if the cadence would not copy it yet.
        """
        deadline = time.monotonic() + timeout
        self._flush_deadline = deadline
        return self._backlog.wait_empty(deadline, lambda: self.broken is not None)

    def close(self, timeout: float) -> bool:
        """Copy the newest checkpoint not yet on the durable tier (whatever the cadence), then stop; bounded by
        `timeout` (fit end, preemption: tiers.flush_timeout_s). True when nothing was left behind."""
        deadline = time.monotonic() + timeout
        self._flush_deadline = deadline
        self._stop_requested.set()
        self._queue.put(_STOP)
        # the thread stops itself once the owed copy committed or the deadline passed (a copy running then
        # finishes its current attempt); it is a daemon: the run never waits for it without bound
        self._thread.join(max(1.0, timeout + 5.0))
        left = self._backlog.pending
        owed = self._owed is not None or left
        if owed:
            log.error(
                "rank %d: checkpoint(s) committed on the fast tier were not copied to %s before close; "
                "the next run copies the newest one when it starts",
                self.rank,
                self.durable.url,
            )
        return self.broken is None and not owed

    @property
    def stopped(self) -> bool:
        return not self._thread.is_alive()

    def snapshot(self) -> dict[str, int]:
        return {**self.counters.notes(), REPLICATION_LAG: self.lag}

    # --- the thread ---
    def _work(self) -> None:
        pending: list[str] = []
        stopping = False
        try:
            while True:
                if not pending and not stopping:  # block only with nothing to decide on (every rank alike)
                    item = self._queue.get()
                    if item is _STOP:
                        stopping = True
                    else:
                        pending.append(item)
                if self.rank == 0:
                    pending, stopping = self._drain(pending, stopping)
                    decision = self._decide(pending, stopping)
                else:
                    decision = None
                decision = broadcast_from_coordinator("replicate-pick", decision, self.group)
                action, name, manifest, owed, kid = decision
                if action == "superseded":
                    if not owed:  # a submitted one: handled now (an owed one was consumed when passed over)
                        pending = self._consume_until(pending, name)
                        self._backlog.done(1)
                    self.counters.note(REPLICATION_SUPERSEDED)
                    continue
                if action in ("copy", "refuse") and owed:  # passed over earlier: consumed already
                    if action == "copy":
                        self._copy_with_retries(name, manifest, kid, counted=False)
                    else:
                        self.counters.note(REPLICATION_REFUSED)
                    continue
                if action != "stop":
                    pending = self._consume_until(pending, name)
                if action == "copy":
                    self._copy_with_retries(name, manifest, kid)
                elif action == "refuse":
                    self.counters.note(REPLICATION_REFUSED)
                    self._backlog.done(1)
                elif action == "skip":
                    self._backlog.done(1)
                if action == "stop":
                    self._backlog.done(len(pending))
                    return
        except BaseException as err:  # a collective timed out (a rank died) or a bug: the group is unusable now
            self.broken = err
            self.counters.note(REPLICATION_FAILED)
            log.error(
                "rank %d: replication to %s stopped: %s; checkpoints stay on the fast tier, the next run copies the newest",
                self.rank,
                self.durable.url,
                err,
            )
            self._backlog.wake()

    def _drain(self, pending: list[str], stopping: bool) -> tuple[list[str], bool]:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return pending, stopping
            if item is _STOP:
                stopping = True
            else:
                pending.append(item)

    def _decide(self, pending: list[str], stopping: bool) -> tuple[str, str | None, dict | None, bool, str | None]:
        """Coordinator: (action, name, manifest, owed, key id): ("copy", name, manifest, False, kid) copies the newest
        pending, ("copy", name, manifest, True, kid) the one the cadence passed over (at close), ("refuse", name,
        None, owed, None) passes over one whose signature does not hold, ("superseded", name, None, owed, None) leaves
        out one older than the durable tier's newest commit of its run, ("skip", name, None, False, None) passes
        `name` over, ("stop", None, None, False, None) ends the thread. `kid`: the key that signed the fast copy
        (None: the run does not sign)."""
        flushing = stopping or self._flush_deadline is not None
        past_deadline = self._flush_deadline is not None and time.monotonic() > self._flush_deadline
        if stopping and past_deadline:
            return ("stop", None, None, False, None)
        if not pending:
            owed, self._owed = self._owed, None
            if stopping and owed is not None:  # close: the newest commit goes to the durable tier whatever the cadence
                manifest = self._read_fast_manifest(owed)
                if manifest is not None and self._superseded(owed, manifest):
                    return ("superseded", owed, None, True, None)
                if manifest is not None:
                    return self._copy_if_vouched(owed, manifest, owed=True)
            return ("stop", None, None, False, None)
        newest = pending[-1]
        self._since_copy += 1
        durable = self.config.durable
        assert durable is not None, "a replicator runs only with a durable tier"
        due = flushing
        if durable.every_minutes is not None:
            due = due or time.monotonic() - self._last_copy_time >= durable.every_minutes * 60
        else:
            due = due or self._since_copy >= (durable.every_n_checkpoints or 1)
        if len(pending) > 1 and due:
            skipped = len(pending) - 1
            log.warning(
                "replication is %d checkpoint(s) behind; copying the newest (%s) and skipping %d",
                len(pending),
                newest,
                skipped,
            )
        if not due:
            self._owed = pending[0]
            return ("skip", pending[0], None, False, None)
        manifest = self._read_fast_manifest(newest)
        if manifest is None:
            return ("skip", newest, None, False, None)
        if self._superseded(newest, manifest):
            self._owed = None  # older than `newest`: superseded with it
            return ("superseded", newest, None, False, None)
        decision = self._copy_if_vouched(newest, manifest, owed=False)
        if decision[0] == "copy":
            self._owed = None  # older than `newest`: its copy replaces theirs (a refused one does not)
        return decision

    def _copy_if_vouched(
        self, name: str, manifest: dict[str, Any], owed: bool
    ) -> tuple[str, str | None, dict | None, bool, str | None]:
        """Coordinator: copy `name`, unless the run signs and the fast manifest's signature does not hold (then
        refused: its copy would be signed again with the run's key, vouching for what nobody signed)."""
        if self.sign is None:
            return ("copy", name, manifest, owed, None)
        try:
            if self._policy is None:
                signer = self._signer()
                assert signer is not None  # self.sign is set: _signer loads its key (or raises)
                self._policy = signing.policy_of_signer(signer, self.public_keys, self.revoked_keys)
            kid = self._policy.check_manifest(self.fast.fs, join(self.fast.path, name), manifest)
        except Exception as err:  # noqa: BLE001 - SignatureRefused, or no key to judge by: never re-signed
            self._refused(name, f"{type(err).__name__}: {err}")
            return ("refuse", name, None, owed, None)
        return ("copy", name, manifest, owed, kid)

    def _refused(self, name: str, why: str) -> None:
        log.error(
            "rank %d: not replicating %s to %s: %s; a signed run copies only what its accepted keys signed, so it "
            "stays on the fast tier (where a resume requiring a signature refuses it too)",
            self.rank,
            join(self.fast.url, name),
            self.durable.url,
            why,
        )

    def _superseded(self, name: str, manifest: dict[str, Any]) -> bool:
        """Coordinator: the durable tier holds a newer commit of `name`'s run (a larger `seq`: degraded mode's)."""
        run_id, seq = manifest.get("run_id"), manifest.get("seq")
        if not isinstance(run_id, str) or not isinstance(seq, int):
            return False  # no commit order to compare (a v1 manifest): copied as before
        try:
            newest = catalog.newest_commit_of_run(self.durable, run_id)
        except Exception:  # noqa: BLE001 - unreachable: the copy attempt reports it and retries
            log.debug("cannot read the durable tier's newest commit of %s", run_id, exc_info=True)
            return False
        if newest is None or newest.name == name or (newest.seq or 0) <= seq:
            return False
        log.warning(
            "not copying %s (seq %d) to %s: it holds %s (seq %d), a newer commit of run %s (degraded mode); "
            "a copy of the older one would become its `latest`",
            name,
            seq,
            self.durable.url,
            newest.name,
            newest.seq,
            run_id,
        )
        return True

    def _read_fast_manifest(self, name: str) -> dict[str, Any] | None:
        try:
            return catalog.read_manifest(self.fast.fs, self._entry(name))
        except Exception as err:  # noqa: BLE001 - retention deleted it, or it rotted: nothing to copy
            log.warning("cannot read the fast-tier manifest of %s (%s); not replicating it", name, err)
            return None

    def _entry(self, name: str) -> catalog.CheckpointEntry:
        parsed = checkpoint_dirname_parts(name)
        return catalog.CheckpointEntry(
            name, join(self.fast.path, name), parsed.step, parsed.checkpoint_id, catalog.COMMITTED
        )

    def _consume_until(self, pending: list[str], name: str | None) -> list[str]:
        """Drop `name` and everything before it from `pending` (waiting for it if this rank has not seen it yet)."""
        if name is None:
            return pending
        while name not in pending:
            item = self._queue.get()
            if item is _STOP:
                self._queue.put(_STOP)
                raise RuntimeError(f"rank {self.rank}: the coordinator copies {name}, which this rank never committed")
            pending.append(item)
        index = pending.index(name)
        if index:
            for _ in range(index):
                self.counters.note(REPLICATION_SKIPPED)
            self._backlog.done(index)
        return pending[index + 1 :]

    def _copy_with_retries(self, name: str, manifest: dict[str, Any], kid: str | None, counted: bool = True) -> None:
        """Copy until committed, refused (a file does not match the signed digests), the coordinator gives up
        (closing past its deadline) or a newer one waits. `counted`: `name` is a submitted checkpoint not yet marked
        handled. `kid`: the key whose signature of the fast manifest was checked (None: the run does not sign)."""
        failures = 0
        while True:
            started = time.perf_counter()
            ok, message, refused = self._copy_once(name, manifest, kid)
            self._event(name, manifest, ok, message, time.perf_counter() - started)
            if refused:  # the same bytes fail the same way again: never retried
                self.counters.note(REPLICATION_REFUSED)
                if self.rank == 0:
                    self._refused(name, message)
                self._backlog.done(1 if counted else 0)
                return
            if ok:
                self._since_copy = 0
                self._last_copy_time = time.monotonic()
                with self._backlog.lock:
                    self.newest_durable = name
                    self.lag = sum(
                        1 for item in list(self._queue.queue) if item is not _STOP
                    )  # what stays queued is still behind
                self.counters.note(REPLICATED)
                self._backlog.done(1 if counted else 0)
                return
            failures += 1
            self.counters.note(REPLICATION_FAILED)
            wait = self.config.backoff_s(failures)
            log.warning(
                "rank %d: copying %s to %s failed (%s); retrying in %.1fs",
                self.rank,
                name,
                self.durable.url,
                message,
                wait,
            )
            # coordinator decides, for every rank alike: retry, or give up (stopping past the flush deadline)
            give_up = (
                self.rank == 0
                and self._stop_requested.is_set()
                and (self._flush_deadline is None or time.monotonic() + wait > self._flush_deadline)
            )
            give_up = broadcast_from_coordinator("replicate-retry", give_up, self.group)
            if give_up:
                self._backlog.done(1 if counted else 0)
                return
            self._sleep(wait)
            newer = any(item is not _STOP for item in list(self._queue.queue))
            if broadcast_from_coordinator("replicate-newer", newer, self.group):
                # behind: drop this one, the loop picks the newest (counted as skipped)
                self.counters.note(REPLICATION_SKIPPED)
                self._backlog.done(1 if counted else 0)
                return

    def _event(self, name: str, manifest: dict[str, Any], ok: bool, message: str, seconds: float) -> None:
        """Coordinator: one event per copy attempt, in the fast root's event log and to the listeners (health rules)."""
        if self.rank != 0:
            return
        lag = sum(1 for item in list(self._queue.queue) if item is not _STOP) + (0 if ok else 1)
        event = {
            "event": "replication",
            "name": name,
            "step": manifest.get("step"),
            "run_id": manifest.get("run_id"),
            "outcome": "committed" if ok else "failed",
            "cause": message or None,
            "seconds": seconds,
            "durable": self.durable.url,
            "lag_checkpoints": lag,
            "created_at": time.time(),
        }
        metrics.write_json_event(self.fast, f"replicate-{name}-{event['outcome']}", event)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - metrics never fail a copy
                log.warning("a replication listener failed", exc_info=True)

    def _copy_once(self, name: str, manifest: dict[str, Any], kid: str | None) -> tuple[bool, str, bool]:
        """(committed, why not, refused): refused when a rank's files do not match the signed digests."""
        src_dir, dst_dir = join(self.fast.path, name), join(self.durable.path, name)
        if kid is not None:
            check: tuple[bool, str] | None = None  # (refused, why): this rank's files do not hold, or are unreadable
            try:  # what this rank uploads, checked before any rank uploads anything
                signing.check_rank_files(self.fast.fs, src_dir, manifest, self.rank, kid)
            except SignatureRefused as err:
                check = (True, f"rank {self.rank}: {err}")
            except Exception as err:  # noqa: BLE001 - unreadable now: a failed attempt, retried like an upload
                check = (False, f"rank {self.rank}: {type(err).__name__}: {err}")
            checks = [c for c in all_gather_objects("replicate-vouched", check, self.group) if c]
            if checks:
                refused = any(refused for refused, _ in checks)
                return False, "; ".join(why for refused_here, why in checks if refused_here or not refused), refused
        problem = None
        try:
            # v5: this rank's rows from its own group's table, in its own fast root (on a node-local fast tier the
            # other groups' tables are on other nodes' disks); its group's leader uploads that table
            expanded = groups.for_ranks(self.fast.fs, src_dir, manifest, [self.rank])
            files = files_with_metadata(expanded)
            mine = sorted((path for path in files if shard_rank(path) == self.rank), key=transfer_order)
            led = groups.table_led_by(manifest, self.rank)
            if led is not None:
                mine.insert(0, led)
            if self.rank == 0:  # the files no rank owns and no leader wrote: .metadata, v1-v3's unnamed files
                mine.extend(
                    sorted(
                        (p for p in files if shard_rank(p) is None and not p.endswith(groups.GROUP_SUFFIX)),
                        key=transfer_order,
                    )
                )
            self.durable.backend.makedirs(dst_dir)
            for relative in mine:
                self._fault("replicate_before_file")
                copy_verified(
                    self.fast.fs,
                    src_dir,
                    self.durable.fs,
                    dst_dir,
                    relative,
                    expanded,
                    on_piece=lambda: self._fault("replicate_mid_upload"),
                )
            self._copy_references(src_dir, dst_dir, expanded, mine)
        except Exception as err:  # noqa: BLE001 - reported to the coordinator, which decides for all
            problem = f"rank {self.rank}: {type(err).__name__}: {err}"
        problems = [p for p in all_gather_objects("replicate-receipts", problem, self.group) if p]
        outcome: tuple[bool, str] | None = None
        if self.rank == 0:
            outcome = (False, "; ".join(problems)) if problems else self._commit(name, manifest)
        ok, message = broadcast_from_coordinator("replicate-outcome", outcome, self.group)
        return ok, message, False

    def _copy_references(self, src_dir: str, dst_dir: str, expanded: dict[str, Any], mine: list[str]) -> None:
        """Incremental on parts (FORMAT.md §10.6): the earlier files this rank's part references (its own, in its
        fast root) that the durable tier lacks, checked against the referencing records as they pass
        (engine/tiers/referenced_files.py). A sibling the durable tier does not hold committed is marked kept for
        references only, so its retention removes it once nothing kept references it. Already there (the sibling
        was replicated, or an earlier copy brought its files): nothing is read."""
        if not referenced_files.listed(expanded) or not any(shard_rank(path) == self.rank for path in mine):
            return
        fast_fs, durable_fs = self.fast.fs, self.durable.fs
        for reference, (size, ranges) in sorted(
            referenced_files.of_ranks(fast_fs, src_dir, expanded, [self.rank]).items()
        ):
            target = join(dst_dir, reference)
            if durable_fs.exists(target) and durable_fs.size(target) == size:
                continue
            referenced_files.mark_kept_for_references(durable_fs, referenced_files.sibling_dir(dst_dir, reference))
            self._fault("replicate_before_file")
            copy_checked(fast_fs, join(src_dir, reference), durable_fs, target, ranges, size)

    def _signer(self) -> signing.Signer | None:
        if self.sign is None:
            return None
        return signing.load_signer(self.sign.key_path, self.sign.key_env, self.sign.signer)

    def _commit(self, name: str, manifest: dict[str, Any]) -> tuple[bool, str]:
        """Coordinator: check the uploaded sizes, then commit the durable copy (manifest last)."""
        fs, directory = self.durable.fs, join(self.durable.path, name)
        try:
            # v5: the sizes are in its group tables, read from the durable copy (checked against the manifest)
            expected = {entry["path"]: entry["bytes"] for entry in files_of(groups.expanded(fs, directory, manifest))}
            for relative, size in sorted(expected.items()):
                actual = fs.size(join(directory, relative))
                if actual != size:
                    return False, f"{relative}: {actual} bytes on the durable tier, {size} committed on the fast tier"
            lacking = referenced_files.missing(fs, directory, manifest)
            if lacking:  # incremental: committed without them, the durable copy could not be read
                return False, f"{name}: the durable tier lacks {', '.join(lacking[:4])}, which it references"
            if fs.exists(join(directory, MANIFEST)):
                # committed already (a retry after a lost response, a catch-up racing another): never rewrite its
                # commit record, whose checksum names the manifest that is there
                log.info("%s is already committed on %s", name, self.durable.url)
                return True, ""
            durable_manifest = dict(manifest)
            durable_manifest[REPLICATED_FROM] = {
                "tier": "fast",
                "url": join(self.fast.url, name),
                "replicated_at": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            }
            try:
                # the same commit point as a save: record, manifest by create-if-absent, `latest`
                publish(
                    fs,
                    self.durable.path,
                    name,
                    durable_manifest,
                    before_manifest=lambda: self._fault("replicate_before_manifest"),
                    signer=self._signer(),
                )
            except FileExistsError:
                return (
                    False,
                    f"{name}: another writer committed it on {self.durable.url} meanwhile; two runs may share this root",
                )
        except CorruptCheckpoint as err:
            return False, str(err)
        except Exception as err:  # noqa: BLE001 - unreachable storage: retried
            return False, f"{type(err).__name__}: {err}"
        log.info("replicated %s to %s", name, self.durable.url)
        try:
            self._on_committed(name)
        except Exception:  # noqa: BLE001 - retention; the next commit retries it
            log.warning("after replicating %s: the commit listener failed", name, exc_info=True)
        return True, ""


def newest_on_both(fast: Location, durable: Location, run_id: str | None) -> str | None:
    """The newest committed checkpoint of `run_id` present on both tiers (where replication stands at start)."""
    on_fast = {entry.name for entry in catalog.committed_of_run(catalog.list_checkpoints(fast), run_id)}
    both = [
        entry for entry in catalog.committed_of_run(catalog.list_checkpoints(durable), run_id) if entry.name in on_fast
    ]
    return both[-1].name if both else None


def durable_ahead(fast: Location, durable: Location, run_id: str) -> bool:
    """The durable tier holds a newer commit of `run_id` than the fast tier does (degraded mode saved there, or the
    fast tier is new or was wiped): the fast tier's commits must continue the durable tier's `seq`, else their
    copies would read as older there (and be left out as superseded)."""
    theirs = catalog.newest_commit_of_run(durable, run_id)
    mine = catalog.newest_commit_of_run(fast, run_id)
    return theirs is not None and (mine is None or (theirs.seq or 0) > (mine.seq or 0))


def missing_on_durable(fast: Location, durable: Location, run_id: str | None) -> str | None:
    """The newest committed fast-tier checkpoint of `run_id` that the durable tier lacks (None: nothing to catch up)."""
    newest = catalog.newest_committed(catalog.list_checkpoints(fast), run_id)
    if newest is None:
        return None
    on_durable = {entry.name for entry in catalog.list_checkpoints(durable) if entry.committed}
    return None if newest.name in on_durable else newest.name
