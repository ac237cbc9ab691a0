"""Write one staged state dict as a checkpoint directory and commit it (or fail cleanly).

Runs on the background thread in async mode, on the caller in sync mode: the same code either way.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from ...errors import CommitFailed, ShardCkptError
from ..collectives import agree, is_distributed, rank_and_world
from ..config import SaveConfig
from ..format import groups, topology
from ..format.names import (
    GROUPS_FORMAT_VERSION,
    MANIFEST,
    checkpoint_dirname,
    join,
    new_checkpoint_id,
)
from ..storage import retry
from ..storage.fsio import Location
from ..storage.writer import FaultHook, ShardWriter
from . import save_layout
from .commit import CheckpointTarget, Committer
from .incremental_base import IncrementalBase
from .metadata_budget import writes_every_chunk
from .parts_commit import PartsCommitter
from .parts_save import SaveRefused, save_parts

log = logging.getLogger(__name__)


@dataclass
class SaveResult:
    """The outcome of one save on this rank."""

    step: int
    checkpoint_id: str | None
    path: str | None
    committed: bool
    skipped: bool = False
    error: BaseException | None = None
    manifest: dict[str, Any] | None = None  # on the coordinator only
    bytes_rank: int = 0
    cleanup: str | None = None  # coordinator, failed save: REMOVED (its directory) or LEFT (for `shardckpt gc`)
    storage_retries: int = 0  # transient storage errors retried during this save (process-wide count)
    timings: dict[str, float] = field(default_factory=dict)  # write_s, verify_s, commit_s, persist_s
    ranks: list[dict[str, Any]] = field(
        default_factory=list
    )  # coordinator, committed: every rank's bytes/write_s/write_gbps
    part: dict[str, Any] | None = None  # flat format, committed: this rank's part (the next incremental's base)


@dataclass
class SaveMeta:
    """What the caller tells the manifest about this checkpoint."""

    epoch: int | None = None
    samples_consumed: int | None = None
    identity: dict[str, Any] | None = None
    extra: dict[str, Any] | None = None
    # flattened keys whose replicas are bit-identical on every rank (e.g. DDP parameters): their writes
    # may be spread across ranks; every other replicated item is written by rank 0 (see RankZeroSavePlanner)
    identical: Callable[[str], bool] | None = None
    # incremental: what this save builds on (the previous commit, this rank's own part of it); the path taken
    # below decides how its unchanged chunks are referenced (incremental_base.py)
    base: IncrementalBase | None = None
    # set here from `base` for DCP's collective path (v3): (fqn, chunk offsets) -> chunk record of an unchanged
    # chunk to reference (references.chunk_map)
    references: dict[Any, dict[str, Any]] | None = None
    # incremental and signed, the coordinator: referenced path ('../<dir>/<file>') -> that file's digest, from the
    # manifest the coordinator committed (and signed) before, held in memory: never re-read from storage, where
    # someone may have changed it since
    reference_digests: dict[str, str] | None = None


def persist_checkpoint(
    root: Location,
    group: Any,
    config: SaveConfig,
    state_dict: dict[str, Any],
    step: int,
    meta: SaveMeta,
    fault_hook: FaultHook | None = None,
    lineage_from: tuple[Location, ...] = (),
    node_roots: tuple[str, ...] | None = None,
) -> SaveResult:
    """Write `state_dict` (already staged) as the checkpoint of `step`; never raises on a failed commit.

    `lineage_from`: other roots this run commits to (tiers' degraded mode: the fast tier), whose commits the
    new one's `seq` and parent continue (commit.py `lineage`). `node_roots` (node-local saves): each rank's node root
    (node_groups.node_roots), so that a v5 group table is copied to every node its group spans.

    A save whose ranks agree on the layout is written in format v4/v5 (parts_save.py: no global plan, rank 0's
    commit is O(ranks) or O(groups)); an incremental one references its unchanged chunks from each rank's part
    (FORMAT.md §10.6). `format_version=2` (or 3), a signed incremental `format_version=4` (whose parts digest whole
    files, not chunks), or ranks holding different keys or layouts go through DCP's collective planning and commit
    format v2/v3 (as every save did before v4).
    """
    started = time.perf_counter()
    retries_before = _retries()
    flat = not writes_every_chunk(config)
    layout = save_layout.describe(state_dict, group, meta.identical) if flat else None
    # collective "checkpoint-id": all ranks must write into the same fresh directory, and learn whether every
    # rank derived the same layout (then none needs DCP's global plan)
    number, agreed = agree("checkpoint-id", int(new_checkpoint_id(), 16), _digest_of(layout), group)
    checkpoint_id = f"{number:012x}"
    target = CheckpointTarget(
        root=root,
        dirname=checkpoint_dirname(step, checkpoint_id),
        checkpoint_id=checkpoint_id,
        step=step,
        verify_mode=config.verify.mode,
        node_local=config.node_local,
        manifest_fields={
            "epoch": meta.epoch,
            "samples_consumed": meta.samples_consumed,
            "topology": topology.describe(state_dict, group, config.parallelism),
            "identity": meta.identity,
            "extra": meta.extra,
            "run_id": config.run_id,
        },
        sign=config.sign if config.sign.enabled else None,
        lineage_from=tuple(lineage_from),
    )
    result = SaveResult(step=step, checkpoint_id=checkpoint_id, path=join(root.url, target.dirname), committed=False)
    if layout is not None and agreed:
        committer: Any = PartsCommitter(
            target,
            layout,
            config.dcp_metadata_max_chunks,
            fault_hook,
            group_size=_group_size(config, layout.world_size),
        )
        stats = _persist_parts(
            root, group, config, state_dict, target, layout, committer, fault_hook, result, meta, node_roots
        )
    else:
        if meta.base is not None:  # v3: references per chunk in the manifest, from the base read from storage
            meta.references = meta.base.chunk_map(root)
            meta.reference_digests = meta.base.digests
        committer = Committer(target, fault_hook, meta.reference_digests)
        stats = _persist_collectively(root, group, config, state_dict, target, meta, committer, fault_hook, result)
    if result.error is not None and not config.keep_failed_attempts and committer.manifest is None:
        result.cleanup = remove_failed_attempt(root, target.path, group, result.error.__cause__ or result.error)
    result.bytes_rank = stats.get("bytes", 0)
    result.timings = {
        "write_s": stats.get("write_s", 0.0),
        "verify_s": stats.get("verify_s", 0.0),
        "commit_s": committer.seconds,
        "persist_s": time.perf_counter() - started,
    }
    result.storage_retries = _retries() - retries_before
    return result


def _group_size(config: SaveConfig, world: int) -> int | None:
    """Format v5's ranks per group, or None for v4: what format_version asks, except that an unsigned world of one
    group stays v4: its parts table is O(group size) already, and v5 would add a file to write and one to read at
    every resume for nothing.
    Node-local saves too: each group table is copied to every node its group spans (node_groups.py).
    A signed save is v5 at any size: only v5's group tables and parts carry cryptographic digests down to each
    chunk (FORMAT.md §12.2), so each rank verifies what it reads and nothing more (a signed v4 part binds its
    shard file by one digest, which a resharded rank can only check by fetching the whole file)."""
    size = groups.writer_group_size(world)
    one_group = world <= size and not config.sign.enabled
    if config.format_version < GROUPS_FORMAT_VERSION or one_group:
        return None
    return size


def _persist_parts(
    root: Location,
    group: Any,
    config: SaveConfig,
    state_dict: dict[str, Any],
    target: CheckpointTarget,
    layout: save_layout.SaveLayout,
    committer: PartsCommitter,
    fault_hook: FaultHook | None,
    result: SaveResult,
    meta: SaveMeta,
    node_roots: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Format v4: every rank writes its shard and part; rank 0 commits from the ranks' summaries."""
    try:
        # incremental: this rank's unchanged chunks, referenced from its own part of the base (no collective)
        references = meta.base.part_references(root) if meta.base is not None else None
        outcome = save_parts(
            state_dict,
            layout,
            fs=root.fs,
            directory=target.path,
            checkpoint_id=target.checkpoint_id,
            group=group,
            config=config,
            commit=committer,
            fault_hook=fault_hook,
            group_size=committer.group_size,
            references=references,
            node_roots=node_roots,
        )
    except (ShardCkptError, OSError, RuntimeError) as err:
        _failed(result, target, err, group)
        return {}
    result.committed = True
    result.manifest = committer.manifest
    result.ranks = committer.ranks
    result.part = outcome.part
    # what this rank put on storage: its shard file and its part (the checkpoint's bytes_total counts both)
    return {**outcome.stats, "bytes": outcome.stats.get("bytes", 0) + (outcome.summary.part_bytes or 0)}


def _persist_collectively(
    root: Location,
    group: Any,
    config: SaveConfig,
    state_dict: dict[str, Any],
    target: CheckpointTarget,
    meta: SaveMeta,
    committer: Committer,
    fault_hook: FaultHook | None,
    result: SaveResult,
) -> dict[str, Any]:
    """Formats v2/v3: DCP's collective planning, per-chunk receipts, the commit in the writer's `finish`."""
    writer = ShardWriter(
        root.fs,
        target.path,
        verify=config.verify,
        commit=committer,
        fault_hook=fault_hook,
        references=meta.references,
        digest=config.sign.digest if config.sign.enabled else None,  # signing on: each file's digest, same pass
        direct_io=config.direct_io,
    )
    try:
        dcp.save(state_dict, storage_writer=writer, process_group=group, planner=RankZeroSavePlanner(meta.identical))
        result.committed = True
        result.manifest = committer.manifest
        result.ranks = committer.ranks
    except (CheckpointException, ShardCkptError, OSError, RuntimeError) as err:
        _failed(result, target, err, group)
    return writer.last_write_stats


def _failed(result: SaveResult, target: CheckpointTarget, err: BaseException, group: Any) -> None:
    result.error = CommitFailed(f"step {target.step} did not commit ({target.dirname}): {_root_cause(err)}")
    result.error.__cause__ = err
    log.error("rank %d: %s", rank_and_world(group)[0], result.error)


NO_LAYOUT = "f" * 16  # the digest of a rank that cannot describe its layout: equal on all ranks only if none can


def _digest_of(layout: save_layout.SaveLayout | None) -> str:
    return NO_LAYOUT if layout is None else layout.digest


class RankZeroSavePlanner(DefaultSavePlanner):
    """DCP's planner, except that an item every rank holds is written from rank 0's copy.

    "Replicated" is a declaration, not a fact: DDP ranks update BatchNorm buffers from their own batches,
    and the pickled Lightning state differs per rank. DCP's default dedup balances writes and so takes
    each item from an arbitrary rank (a mix no rank ever had). Rank 0 is what plain Lightning saves.
    Items `identical(fqn)` declares bit-identical on every rank keep DCP's balanced spread.
    """

    def __init__(self, identical: Callable[[str], bool] | None = None) -> None:
        super().__init__(dedup_save_to_lowest_rank=True)
        self._identical = identical

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        if self._identical is None:
            return super()._dedup_save_plans(all_plans)  # everything replicated: rank 0 (the lowest rank)
        holders: dict[Any, list[int]] = {}
        for rank, plan in enumerate(all_plans):  # plans arrive in rank order
            for item in plan.items:
                holders.setdefault(item.index, []).append(rank)
        dropped: list[set[Any]] = [set() for _ in all_plans]
        for index, ranks in holders.items():
            if len(ranks) > 1 and not self._identical(index.fqn):
                for rank in ranks[1:]:
                    dropped[rank].add(index)
        kept = [
            dataclasses.replace(plan, items=[i for i in plan.items if i.index not in dropped[r]])
            for r, plan in enumerate(all_plans)
        ]
        return dedup_save_plans(kept, save_to_lowest_rank=False)  # what is still duplicated is identical: balance it


REMOVED, LEFT = "removed", "left"


def remove_failed_attempt(root: Location, directory: str, group: Any, err: BaseException) -> str | None:
    """On the coordinator, remove the directory of a save every rank saw fail; REMOVED, LEFT, or None.

    Left behind, a failed attempt holds its partial shards until `shardckpt gc`: on a disk with room
    for keep_last + 1 checkpoints, one transient disk-full then made every later save fail too.
    Only a collective verdict proves every rank's write step is over: DCP's (a CheckpointException) or the
    parts save's (SaveRefused); each rank's result or error was gathered before the coordinator decided. Any other error (a peer that
    died, a collective timeout) proves nothing, so a rank may still be writing: the directory stays
    for `shardckpt gc`. A directory whose manifest exists is committed, whatever the save reported,
    and is never touched. Best effort: a failure to remove is logged and returned as LEFT.
    """
    rank, _ = rank_and_world(group)
    if rank != 0:
        return None
    if is_distributed() and not isinstance(err, (CheckpointException, SaveRefused)):
        log.warning(
            "rank 0: %s stays for `shardckpt gc`: the ranks did not reach a common verdict (%s)",
            directory,
            type(err).__name__,
        )
        return LEFT
    try:
        if retry.call("exists", lambda: root.fs.exists(join(directory, MANIFEST)), target=directory):
            return None  # committed on storage although the save failed after the manifest: never removed
        retry.call("rm", lambda: root.fs.rm(directory, recursive=True), target=directory)
    except FileNotFoundError:
        return None  # the save failed before anything was written
    except Exception:
        log.warning("rank 0: could not remove the failed attempt %s; `shardckpt gc` will", directory, exc_info=True)
        return LEFT
    log.info("rank 0: removed the failed attempt %s", directory)
    return REMOVED


def release_frames(err: BaseException) -> None:
    """Clear the local variables of every finished frame in `err`'s tracebacks (its whole chain).

    A kept error (the saver's first error, a SaveResult) otherwise keeps every object of the failed save
    alive through its traceback's frames: staged state, open files, half-written record writers, for as
    long as training runs. The tracebacks stay printable (file, line and function are kept).
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [err]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)  # skips frames still executing
        pending.extend((current.__cause__, current.__context__))
        if isinstance(current, CheckpointException):  # DCP keeps each rank's (exception, stack summary)
            pending.extend(
                failure[0] for failure in current.failures.values() if isinstance(failure, tuple) and failure
            )


def _retries() -> int:
    """Storage operations retried so far in this process (ours and botocore's; see retry.py)."""
    return retry.counters.total("retried.") + retry.counters.total("http_retries.")


def _root_cause(err: BaseException) -> str:
    """DCP wraps per-rank failures; name the first rank's own error."""
    if isinstance(err, CheckpointException) and err.failures:
        rank = sorted(err.failures)[0]
        cause = err.failures[rank][0]  # DCP stores (exception, traceback) per failed rank
        return f"rank {rank}: {type(cause).__name__}: {cause}"
    return f"{type(err).__name__}: {err}"
