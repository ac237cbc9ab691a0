"""CheckpointSaver: stage on the caller, then persist + verify + commit on a background thread.

The training thread pays only for waiting on a free staging slot (policy `when_busy`) and for the copy
into reused host buffers. One background thread runs saves in request order, so every rank runs the
same checkpoint collectives in the same order on the dedicated checkpoint group.

With `overlap_staging`, the part of the copy a caller marks `defer` (state that changes only in the
optimizer step) runs in the background too; the training thread blocks only at `fence()`, which it
calls (or an optimizer hook from `guard()` calls) before that state may change.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ...errors import CommitFailed, ConfigError
from .. import metrics, ownership
from ..collectives import is_distributed, new_checkpoint_group, rank_and_world
from ..config import SaveConfig
from ..format import manifest as manifest_format
from ..format.listed_digests import reference_digests_of
from ..format.names import OWNER, checkpoint_dirname
from ..metrics import CheckpointRecord, RunCounters
from ..storage import fsio
from ..storage.fsio import Location
from ..storage.writer import FaultHook
from . import metadata_budget, node_groups
from .incremental import ChangeTracker
from .incremental_base import IncrementalBase
from .persist import REMOVED, SaveMeta, SaveResult, persist_checkpoint, release_frames
from .staging import DeferredCopy, StagingBuffers

log = logging.getLogger(__name__)


class PendingSave:
    """A save that was requested; `result()` blocks until it committed, failed or was skipped."""

    def __init__(self, step: int) -> None:
        self.step = step
        self._done = threading.Event()
        self._result: SaveResult | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> SaveResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint of step {self.step} still in flight after {timeout}s")
        assert self._result is not None
        return self._result

    def _set(self, result: SaveResult) -> None:
        self._result = result
        self._done.set()


@dataclass
class _Job:
    state: dict[str, Any]
    slot: StagingBuffers
    step: int
    meta: SaveMeta
    record: CheckpointRecord
    pending: PendingSave
    requested_at: float
    unchanged: frozenset[str] = frozenset()  # incremental: keys unchanged since the previous save (not staged)


class CheckpointSaver:
    """Saves state dicts as committed, verified checkpoints under one root.

    Construct it on every rank at the same point (it creates the checkpoint process group), and call
    `save` on every rank with the same steps.
    """

    def __init__(
        self,
        dirpath: str,
        config: SaveConfig | None = None,
        *,
        group: Any = None,
        fault_hook: FaultHook | None = None,
        lineage_from: tuple[Location, ...] = (),
    ) -> None:
        """`group`: an existing checkpoint process group to share; by default one is created (collectively).
        `lineage_from`: other roots this run commits to (tiers' degraded mode saves on the durable tier after the
        fast tier's commits): each new commit's `seq` and parent continue theirs too, so `seq` stays monotonic
        per run across roots."""
        self.config = config or SaveConfig()
        self.lineage_from = tuple(lineage_from)
        self.root = fsio.resolve(dirpath, self.config.storage_options)
        self.root.backend.makedirs(self.root.path)
        self.group = group if group is not None else new_checkpoint_group(self.config.collective_timeout_s)
        self.rank = rank_and_world(self.group)[0]
        # before anything is written: a root another run owns is refused on every rank (ownership.py)
        self.run_id = ownership.ensure_owner(
            self.root,
            self.config.run_id or ownership.new_run_id(),
            self.config.allow_shared_root,
            self.group,
            self.config.front_door,
        )
        self.config = replace(self.config, run_id=self.run_id)  # every manifest records it
        # node-local: each rank's node root, so that a v5 group table is copied to every node its group spans
        self.node_roots = node_groups.node_roots(self.root, self.group) if self.config.node_local else None
        # staging memory is bounded: one host copy of the state per save that may be in flight
        self._free_slots: queue.Queue[StagingBuffers] = queue.Queue()
        self.slots = [StagingBuffers() for _ in range(self.config.max_in_flight)]
        for slot in self.slots:
            self._free_slots.put(slot)
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()  # run in order by the worker
        self._worker: threading.Thread | None = None
        self._in_flight: list[PendingSave] = []
        self._records: deque[CheckpointRecord] = deque()
        self._listeners: list[Callable[[CheckpointRecord], None]] = []
        self._first_error: BaseException | None = None
        self._error_raised = False
        # overlapped copies not yet fenced, with the record their wait is added to (training thread only)
        self._unfenced: deque[tuple[DeferredCopy, CheckpointRecord]] = deque()
        self.fence_wait_total_s = 0.0  # seconds the training thread blocked in fence() over this saver's life
        self.counters = RunCounters()
        # incremental saves: the tracker runs on the training thread; the base (the previous save's directory,
        # None unless it committed) is set by whichever thread runs the saves, in request order
        self._tracker = ChangeTracker(self.config.full_every_n) if self.config.incremental else None
        self._base: str | None = None
        self._base_failed = False
        # signed incremental saves, the coordinator: the digests the base's manifest recorded, as this process
        # committed and signed them (listed_digests.reference_digests_of), never re-read from storage
        self._base_digests: dict[str, str] | None = None
        # incremental saves on the flat format, every rank: the part it wrote for the base, in memory (its unchanged
        # chunks are referenced from these records, never from storage: incremental_base.py)
        self._base_part: dict[str, Any] | None = None
        self._fault_hook = fault_hook
        self._requested = False  # a save was requested (the root may then hold this run's checkpoints)

    # --- the training thread's side ---
    def save(
        self,
        state_dict: dict[str, Any],
        step: int,
        *,
        epoch: int | None = None,
        samples_consumed: int | None = None,
        identity: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        identical: Callable[[str], bool] | None = None,
        never_skip: bool = False,
        defer: Callable[[str], bool] | None = None,
    ) -> PendingSave:
        """Snapshot `state_dict` now and commit it as the checkpoint of `step` (in the background if async).

        Returns once the state is copied: the caller may mutate it right away. With `on_error="raise"`,
        a failure of an earlier background save is raised here. An item several ranks hold is written
        from rank 0's copy, unless `identical(flattened_key)` says every rank's copy is the same bytes
        (then the writes are spread across ranks). `never_skip` (every rank alike): wait for a staging slot
        even under when_busy="skip" — for a save that must happen, such as the last one of a run.

        With `overlap_staging` (and async saves), tensors whose flattened key `defer(key)` accepts are
        copied in the background: the caller may mutate everything else right away, and those only
        after `fence()` (call it before the optimizer step, or let `guard(optimizer)` do it).
        """
        self._raise_first_error()
        self._refuse_unloadable(state_dict)
        self._requested = True
        self.fence()  # one snapshot at a time: the previous overlapped copy is complete before this one starts
        requested = time.perf_counter()
        pending = PendingSave(step)
        record = CheckpointRecord(step=step, rank=self.rank, outcome=metrics.SKIPPED, run_id=self.config.run_id)
        slot = self._acquire_slot(step, never_skip)
        if slot is None:
            record.cause = (
                f"a previous save was still in flight (max_in_flight={self.config.max_in_flight}, when_busy='skip')"
            )
            record.pause_s = record.total_s = time.perf_counter() - requested
            self._finish(
                record, pending, SaveResult(step=step, checkpoint_id=None, path=None, committed=False, skipped=True)
            )
            return pending
        staging_started = time.perf_counter()
        base_failed = self._base_failed
        unchanged: frozenset[str] = frozenset()
        try:
            if self._tracker is not None:
                if base_failed:  # the previous save did not commit: nothing to reference, this one is full
                    self._base_failed = False
                    self._tracker.reset()
                unchanged = self._tracker.plan(state_dict)
                if self._tracker.full_because is not None and self.rank == 0:
                    log.info("rank 0: incremental: step %d is a full save: %s", step, self._tracker.full_because)
            # synchronous: the caller waits for the write, so the live state is consistent without a copy
            staged = (
                slot.stage(state_dict, defer if self.config.overlap_staging else None, unchanged)
                if self.config.async_save
                else state_dict
            )
        except BaseException:
            # nothing was queued: leave the saver as if this call never happened, or the next save waits
            # forever for this slot (max_in_flight=1) or references tensors this plan wrongly took as saved
            self._undo_request(slot, base_failed)
            raise
        if slot.deferred is not None:
            self._unfenced.append((slot.deferred, record))
        record.stage_s = time.perf_counter() - staging_started
        record.pause_s = time.perf_counter() - requested
        job = _Job(
            staged,
            slot,
            step,
            SaveMeta(epoch, samples_consumed, identity, extra, identical),
            record,
            pending,
            requested,
            unchanged,
        )
        self._in_flight.append(pending)
        if self.config.async_save:
            self._ensure_worker()
            self._jobs.put(lambda: self._run(job))
        else:
            self._run(job)
            record.pause_s = record.total_s  # synchronous: the caller waited for everything
            self._raise_first_error()
        return pending

    def _refuse_unloadable(self, state_dict: dict[str, Any]) -> None:
        """ConfigError, before anything of this save is staged or written, when its manifest would list every chunk
        (format_version=2, incremental) and be larger than readers load (metadata_budget.py). The doors refused
        such a configuration before training (training/preflight.py); checked here at every save, not the first
        only: optimizer state may appear after the start; O(tensors), no collective."""
        if not metadata_budget.writes_every_chunk(self.config):
            return
        world = rank_and_world(self.group)[1]
        try:
            metadata_budget.refuse_unloadable(self.config, world, metadata_budget.tensors_of(state_dict))
        except ConfigError as err:
            if self._requested:
                raise
            # the root's owner marker (written when this saver was made) names this run: a fixed rerun with a
            # new run id would be refused as another run, so say how to continue this one
            raise ConfigError(
                f"{err}. {self.root.url} is claimed for run {self.run_id!r} ({OWNER}): rerun with "
                f"save.run_id={self.run_id}, or delete {OWNER} if nothing else writes there"
            ) from None

    def fence(self) -> float:
        """Block until the state of every requested save is copied; returns the seconds this call blocked.

        With `overlap_staging`, call it on the training thread before anything changes the state a save
        deferred (the optimizer step). Without overlapped copies pending it returns at once.
        """
        waited = 0.0
        while self._unfenced:
            deferred, record = self._unfenced.popleft()
            seconds = deferred.fence()
            # added before the record is emitted in practice: that follows the whole write, which starts only
            # once this copy is done (a record emitted first shows 0)
            record.overlap_wait_s += seconds
            waited += seconds
        self.fence_wait_total_s += waited
        return waited

    def guard(self, *optimizers: torch.optim.Optimizer) -> list[Any]:
        """Fence before every `step()` of `optimizers` (a step pre-hook); returns the hooks' handles.

        Not for Lightning's automatic optimization, whose `step()` runs the next forward and backward
        inside its closure: a pre-hook there would block before them (ShardedStrategy fences after them).
        """

        def fence_before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            self.fence()  # a pre-hook must return None (or replacement arguments)

        return [optimizer.register_step_pre_hook(fence_before_step) for optimizer in optimizers]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every requested save finished; False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for pending in list(self._in_flight):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not pending._done.wait(remaining):
                return False
        return True

    def close(self, timeout: float | None = None) -> None:
        """Wait (bounded) for in-flight saves so the run's last checkpoint commits, then stop and join the worker."""
        timeout = self.config.teardown_timeout_s if timeout is None else timeout
        self.fence()
        waiting = [p.step for p in self._in_flight if not p.done()]
        if waiting:
            log.info("rank %d: waiting up to %.0fs for checkpoint(s) of step %s to commit", self.rank, timeout, waiting)
        deadline = time.monotonic() + timeout
        if not self.wait(timeout):
            log.error(
                "rank %d: checkpoint(s) of step %s did not finish within %.0fs; they stay uncommitted",
                self.rank,
                [p.step for p in self._in_flight if not p.done()],
                timeout,
            )
        worker = self._worker
        if worker is not None and worker.is_alive():
            self._jobs.put(None)
            # joined, not only told to stop: a worker thread still alive when the caller destroys the checkpoint
            # group or the interpreter exits aborts the process ("terminate called without an active exception")
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                log.error(
                    "rank %d: the checkpoint worker did not stop within %.0fs; its process group must stay until it does",
                    self.rank,
                    timeout,
                )
        self._raise_first_error()

    @property
    def stopped(self) -> bool:
        """True when no worker thread runs (never started, or closed and joined): the group may go."""
        return self._worker is None or not self._worker.is_alive()

    def prepare(self, state_dict: dict[str, Any]) -> bool:
        """Allocate and touch staging memory for a state of this layout, on the background thread.

        The first save of a run otherwise pays for fresh memory inside its pause (4-50x slower than a
        copy into used memory). Call it once the state has its final layout (after the first optimizer
        step); a save that comes while it runs waits for it. Returns False when nothing was scheduled
        (synchronous mode, or every slot busy).
        """
        if not self.config.async_save:
            return False
        try:
            slot = self._free_slots.get_nowait()
        except queue.Empty:
            return False

        def allocate() -> None:
            try:
                slot.allocate_like(state_dict)
            except Exception:  # an optimisation only: the first save allocates instead
                log.warning("rank %d: preparing staging memory failed", self.rank, exc_info=True)
            finally:
                self._free_slots.put(slot)

        self._ensure_worker()
        self._jobs.put(allocate)
        return True

    def poll_records(self) -> list[CheckpointRecord]:
        """Records of saves that finished since the last call (for logging on the training thread)."""
        out = []
        while self._records:
            out.append(self._records.popleft())
        return out

    def add_listener(self, listener: Callable[[CheckpointRecord], None]) -> None:
        """Call `listener(record)` when a save finishes (on the background thread in async mode)."""
        self._listeners.append(listener)

    # --- internals ---
    def _acquire_slot(self, step: int, never_skip: bool = False) -> StagingBuffers | None:
        if self.config.when_busy == "skip" and not never_skip:
            if _any_rank(self._free_slots.empty()):  # every rank must take the same decision
                log.warning(
                    "rank %d: skipping the checkpoint of step %d: a previous save is still in flight", self.rank, step
                )
                return None
            return self._free_slots.get()
        try:
            return self._free_slots.get_nowait()
        except queue.Empty:
            log.info("rank %d: checkpoint of step %d waits for a previous save to commit", self.rank, step)
            return self._free_slots.get()

    def _undo_request(self, slot: StagingBuffers, base_failed: bool) -> None:
        """Undo what `save` did before its staging copy failed: the tracker's plan and the slot it took."""
        if self._tracker is not None:
            self._tracker.undo()
            # only ever set back to True (a full next save): the worker may have set it meanwhile
            self._base_failed = self._base_failed or base_failed
        self._free_slots.put(slot)

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name="shardckpt-saver", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            work = self._jobs.get()
            if work is None:
                return
            work()

    def _run(self, job: _Job) -> None:
        try:
            deferred = job.slot.deferred
            job.slot.wait_until_ready()
            job.record.overlap_copy_s = deferred.seconds if deferred is not None else 0.0
            if job.unchanged:
                if self._base is None:
                    raise CommitFailed(
                        f"step {job.step}: incremental save, but the save it builds on did not commit; "
                        "its unchanged tensors were not copied, so it cannot be written. The next save is full"
                    )
                job.meta.base = IncrementalBase(self._base, job.unchanged, self._base_part, self._base_digests)
            result = persist_checkpoint(
                self.root,
                self.group,
                self.config,
                job.state,
                job.step,
                job.meta,
                self._fault_hook,
                lineage_from=self.lineage_from,
                node_roots=self.node_roots,
            )
        except BaseException as err:  # a bug or an unexpected error: never lose it silently
            log.exception("rank %d: checkpoint of step %d crashed", self.rank, job.step)
            result = SaveResult(step=job.step, checkpoint_id=None, path=None, committed=False, error=err)
        finally:
            job.state = {}
            job.meta.references = job.meta.reference_digests = job.meta.base = None
        if self._tracker is not None:  # before the slot is free: the next request sees whether it may reference
            committed_id = result.checkpoint_id if result.committed else None  # a commit has its id
            self._base = checkpoint_dirname(job.step, committed_id) if committed_id is not None else None
            self._base_part = result.part if result.committed else None  # flat format: this rank's own records
            base, manifest = self._base, result.manifest
            if base is not None and manifest is not None and self.config.sign.enabled:
                self._base_digests = reference_digests_of(manifest, base)
            else:
                self._base_digests = None
            self._base_failed = self._base_failed or not result.committed
        self._free_slots.put(job.slot)
        if result.error is not None:
            # kept (first error, records): its frames, finished now, must not keep the save's objects alive
            release_frames(result.error)
        record = job.record
        record.outcome = metrics.COMMITTED if result.committed else metrics.FAILED
        record.checkpoint_id, record.path = result.checkpoint_id, result.path
        record.cause = None if result.error is None else str(result.error)
        record.write_s = result.timings.get("write_s", 0.0)
        record.verify_s = result.timings.get("verify_s", 0.0)
        record.commit_s = result.timings.get("commit_s", 0.0)
        record.bytes_rank = result.bytes_rank
        record.storage_retries = result.storage_retries
        record.cleanup = result.cleanup
        record.ranks = result.ranks
        if result.cleanup is not None:
            self.counters.note(metrics.FAILED_DIRS_REMOVED if result.cleanup == REMOVED else metrics.FAILED_DIRS_LEFT)
        record.bytes_total = manifest_format.total_bytes(result.manifest) if result.manifest else None
        record.manifest = result.manifest
        record.write_gbps = result.bytes_rank / record.write_s / 1e9 if record.write_s > 0 else 0.0
        record.total_s = time.perf_counter() - job.requested_at
        if result.error is not None and self._first_error is None:
            self._first_error = result.error
        self._finish(record, job.pending, result)

    def _finish(self, record: CheckpointRecord, pending: PendingSave, result: SaveResult) -> None:
        self.counters.count(record.outcome)
        if self.config.write_events and self.rank == 0:
            metrics.write_event(self.root, record, self.counters.snapshot(), self.counters.notes())
        self._records.append(record)
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:
                log.exception("checkpoint listener failed")
        pending._set(result)
        if pending in self._in_flight:
            self._in_flight.remove(pending)

    def _raise_first_error(self) -> None:
        if self.config.on_error != "raise" or self._first_error is None or self._error_raised:
            return
        self._error_raised = True
        err = self._first_error
        raise CommitFailed(f"a background checkpoint did not commit: {err}") from err


def _any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is True on any rank (a collective on the training group, main thread)."""
    if not is_distributed():
        return flag
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())
