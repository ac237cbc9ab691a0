"""A full save in format v4: each rank plans, writes, checks and records its own part; rank 0 commits.

No global plan: every rank knows the layout (save_layout.py), so it writes what it owns without sending its
plan anywhere. After writing, reading back and checking its file's stored size, each rank writes its part
(engine/format/parts.py) and sends rank 0 a summary of a few hundred bytes: sizes, checksums, counts, and
errors. Rank 0 checks that the summaries add up and commits (parts_commit.py); its verdict is broadcast,
so every rank returns the same outcome. Two collectives after the write, each O(ranks) on rank 0 and O(1)
elsewhere; nothing per chunk crosses the network unless the checkpoint is small enough for DCP's
`.metadata` (then rank 0 gets the parts themselves, to write it).

Every rank reaches both collectives whatever fails on it (its error travels in its summary): a rank that
raised would otherwise leave the others waiting until the collective timeout.
"""

from __future__ import annotations

import logging
import random
import traceback
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from ...errors import CommitFailed, CorruptCheckpoint
from ..collectives import broadcast_from_coordinator, gather_to_coordinator, rank_and_world
from ..config import SaveConfig
from ..format import chunk_layout, part_references, signing
from ..format import parts as part_format
from ..format.checksum import checksum
from ..format.names import join
from ..storage import fsio, retry
from ..storage.writer import FaultHook, RankWrite, write_rank_file
from .group_summaries import gather_groups
from .part_summary import PartSummary
from .save_layout import TENSOR, SaveLayout

log = logging.getLogger(__name__)

# incremental: (fqn, chunk offsets) -> the record of an unchanged chunk to reference (file: its holder)
References = dict[tuple[str, tuple[int, ...]], dict[str, Any]]


class SaveRefused(CommitFailed):
    """The coordinator refused the commit and every rank was told: every rank's write step is over."""


@dataclass
class RankOutcome:
    """This rank's view of one save after the verdict."""

    stats: dict[str, Any]
    summary: PartSummary
    part: dict[str, Any] | None = None  # this rank's part as written (None: it wrote none): an incremental base


def save_parts(
    state_dict: dict[str, Any],
    layout: SaveLayout,
    *,
    fs: Any,
    directory: str,
    checkpoint_id: str,
    group: Any,
    config: SaveConfig,
    commit: Any,  # parts_commit.PartsCommitter, called on rank 0 with every summary (v5: every group's)
    fault_hook: FaultHook | None = None,
    group_size: int | None = None,  # format v5's ranks per group (group_summaries.py); None: format v4
    references: References | None = None,  # incremental: this rank's unchanged chunks, referenced (§10.6)
    node_roots: tuple[str, ...] | None = None,  # node-local: each rank's root (node_groups.py)
) -> RankOutcome:
    """Write this rank's shard and part, then commit on rank 0; raises SaveRefused (every rank alike) when the
    checkpoint did not commit, or the collective's error when a peer died."""
    rank, _ = rank_and_world(group)
    fault = fault_hook or (lambda point: None)
    stats: dict[str, Any] = {}
    try:
        # signed v5: a digest per chunk (each rank checks what it reads); signed v4 (format_version 4): one per file
        chunk_digests = config.sign.enabled and group_size is not None
        written = _write(state_dict, layout, fs, directory, rank, config, fault, chunk_digests, references or {})
        stats = written.stats
        summary, part = _summarize(written, layout, fs, directory, checkpoint_id, rank, config)
        fault("before_receipt")
    except Exception as err:  # reported to the coordinator, which refuses the commit, naming it
        log.error("rank %d: writing its part of %s failed: %s", rank, directory, err)
        summary = PartSummary(rank, layout.digest, error=f"rank {rank}: {type(err).__name__}: {err}")
        part = None
        summary_error: Exception | None = err
    else:
        summary_error = None
    if group_size is None:
        # collective "part-summaries": rank 0 gets every rank's summary (O(ranks) bytes there, O(1) elsewhere)
        summaries = gather_to_coordinator("part-summaries", summary, group)
    else:
        summaries = gather_groups(
            summary,
            layout,
            group_size,
            fs=fs,
            directory=directory,
            checkpoint_id=checkpoint_id,
            verify_mode=config.verify.mode,
            pg=group,
            digest=config.sign.digest if config.sign.enabled else None,
            node_roots=node_roots,
        )
    verdict: str | None = None
    if summaries is not None:
        try:
            commit(summaries)
        except Exception as err:
            verdict = f"{type(err).__name__}: {err}" if not isinstance(err, CommitFailed) else str(err)
            if not isinstance(err, CommitFailed):
                log.error("rank 0: committing %s failed:\n%s", directory, traceback.format_exc())
    # collective "commit-verdict": every rank learns whether the checkpoint committed
    verdict = broadcast_from_coordinator("commit-verdict", verdict, group)
    if verdict is not None:
        raise SaveRefused(verdict) from summary_error
    return RankOutcome(stats, summary, part)


def _write(
    state_dict: dict[str, Any],
    layout: SaveLayout,
    fs: Any,
    directory: str,
    rank: int,
    config: SaveConfig,
    fault: FaultHook,
    chunk_digests: bool = False,
    references: References | None = None,
) -> RankWrite:
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, StorageMeta(checkpoint_id=directory), rank == 0)
    plan = planner.create_local_plan()  # DCP's write items for everything this rank holds; ours is a subset
    # a chunk holding no element (FSDP2's ranks past a tensor's last row) gets no record: no reader needs one
    # (FORMAT.md §10.1), and at 16,384 ranks half of an FSDP2 model's records were such, ~1.5 KB of header each
    items = [item for item in plan.items if layout.items[item.index.fqn].writes_here and not _holds_nothing(item)]
    _check_own_chunks(items, layout, rank)
    fsio.makedirs(fs, directory)
    rng = random.Random(config.verify.seed)
    digest = config.sign.digest if config.sign.enabled else None  # signing on: each file's digest, same pass
    return write_rank_file(
        fs,
        directory,
        rank,
        items,
        planner.resolve_data,
        config.verify,
        rng,
        fault,
        digest=digest,
        direct_io=config.direct_io,
        chunk_digests=chunk_digests,
        reference_of=partial(reference_of, references or {}),
        always_file=True,  # a rank referencing every chunk still has a part, which needs its (empty) file
    )


def _holds_nothing(item: Any) -> bool:
    """A tensor write item whose chunk holds no element (objects always hold their bytes)."""
    return item.tensor_data is not None and not chunk_layout.holds_elements(tuple(item.tensor_data.chunk.sizes))


def reference_of(references: References, item: Any) -> dict[str, Any] | None:
    """The record to reference for write item `item` (None: write it): an unchanged tensor chunk of this rank whose
    earlier record has the same offsets and sizes. An empty chunk is written (0 bytes), never referenced: it would
    pin a file for nothing."""
    if item.tensor_data is None or not references:
        return None
    entry = references.get((item.index.fqn, tuple(item.index.offset)))
    if entry is None or list(entry["sizes"]) != list(item.tensor_data.chunk.sizes) or entry["length"] == 0:
        return None
    return entry


def _check_own_chunks(items: list[Any], layout: SaveLayout, rank: int) -> None:
    """Each chunk this rank writes is the cell the layout gives it (save_layout checked the rule against
    DTensor's placement of this rank's chunk): the per-rank half of the check that the chunks tile every
    tensor. The coordinator counts each rank's chunks against the layout: the other half."""
    for item in items:
        entry = layout.items[item.index.fqn]
        if entry.kind != TENSOR or item.tensor_data is None:
            continue
        chunk = item.tensor_data.chunk
        if entry.own != (tuple(chunk.offsets), tuple(chunk.sizes)):
            raise CorruptCheckpoint(
                f"rank {rank}: its chunk of {item.index.fqn} at {list(chunk.offsets)} ({list(chunk.sizes)}) is not "
                f"the one its layout gives it ({entry.own}); the ranks disagree on how this tensor is sharded"
            )


def _summarize(
    written: RankWrite,
    layout: SaveLayout,
    fs: Any,
    directory: str,
    checkpoint_id: str,
    rank: int,
    config: SaveConfig,
) -> tuple[PartSummary, dict[str, Any] | None]:
    summary = PartSummary(rank, layout.digest, chunks=len(written.receipts), write_s=written.stats.get("write_s"))
    if written.relative is None:
        return summary, None  # nothing to write: no file, no part
    path = join(directory, written.relative)
    # the stored size, checked by the rank that wrote it (all ranks in parallel, not N requests on rank 0): as the
    # read-back found it, else one HEAD
    stored = written.stored_bytes
    if stored is None:
        stored = retry.call("size", lambda: fs.size(path), target=path)
    if stored != written.file_bytes:
        raise CorruptCheckpoint(f"{path}: {stored} bytes on storage, {written.file_bytes} written (truncated upload?)")
    tensor_chunks, objects = [], []
    for item, receipt in written.receipts:
        record: dict[str, Any] = {
            "fqn": item.index.fqn,
            "offset": receipt.offset,
            "length": receipt.length,
            "checksum": receipt.checksum,
        }
        if receipt.reference:  # incremental: the bytes are in a sibling's file (FORMAT.md §10.6)
            record[part_references.FILE] = receipt.relative_path
            record[part_references.HOLDER_BYTES] = receipt.file_bytes
        if receipt.crypto is not None:  # signed v5: bound by the part's digest in its group table
            record[part_format.DIGEST] = receipt.crypto[0]
        if item.tensor_data is None:
            objects.append(record)
            continue
        record["offsets"] = list(item.tensor_data.chunk.offsets)
        record["sizes"] = list(item.tensor_data.chunk.sizes)
        if receipt.blocks is not None:
            record["blocks"] = {"size": receipt.blocks[0], "checksums": list(receipt.blocks[1])}
            if receipt.crypto is not None and receipt.crypto[1] is not None:
                record["blocks"][part_format.BLOCK_DIGESTS] = list(receipt.crypto[1])
        if receipt.finite is not None:
            record[part_format.FINITE_FIELD] = receipt.finite
            if not receipt.finite:
                summary.nonfinite.append(item.index.fqn)
        tensor_chunks.append(record)
    receipts = [receipt for _, receipt in written.receipts if not receipt.reference]  # this save's own bytes
    verified = [r for r in receipts if r.verified]
    verification: dict[str, Any] = {
        "mode": config.verify.mode,
        "chunks_total": len(receipts),
        "bytes_total": sum(r.length for r in receipts),
        "chunks_verified": len(verified),
        "bytes_verified": sum(r.length if r.verified_bytes is None else r.verified_bytes for r in verified),
    }
    part = part_format.build_part(
        checkpoint_id=checkpoint_id,
        rank=rank,
        file=written.relative,
        file_bytes=written.file_bytes,
        tensor_chunks=tensor_chunks,
        objects=objects,
        verification=verification,
        write_s=written.stats.get("write_s"),
    )
    if written.file_digest is not None:
        part[signing.FILE_DIGEST] = written.file_digest  # vouched for by the part's own digest in the signed manifest
    data = part_format.to_bytes(part)
    fsio.write_new_file(fs, join(directory, part_format.part_filename(rank)), data)
    summary.file_bytes = written.file_bytes
    summary.file_checksum = part["file_checksum"]
    summary.part_bytes = len(data)
    summary.part_checksum = checksum(data)
    if config.sign.enabled:  # v4: the part holds its file's digest; v5: its chunks'
        summary.part_digest = signing.digest_of(data, config.sign.digest)
    summary.verified_chunks = verification["chunks_verified"]
    summary.verified_bytes = verification["bytes_verified"]
    summary.bytes_total = verification["bytes_total"]
    summary.referenced = part_references.reference_entries(part)
    if layout.chunk_count() <= config.dcp_metadata_max_chunks:
        summary.part = part
    return summary, part
