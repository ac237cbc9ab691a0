"""The commit of a format-v4 or v5 checkpoint, on the coordinator: O(ranks) (v5: O(groups)) checks, a small
manifest, the commit.

The ranks checked their own chunks (each is the cell its layout gives it, the file tiles, the stored size is
what was written, a sample was read back) and wrote their parts. Here rank 0 checks that the summaries add
up: every rank answered without error and with the layout every other rank used, each wrote exactly the
chunks the layout assigns it, each verified something (unless verification is off). Then it writes DCP's
`.metadata` when the checkpoint is small enough for a plain `dcp.load` (dcp_metadata_max_chunks), builds the
manifest from the layout and the parts' sizes and checksums, and publishes it (commit.publish: commit record,
manifest by create-if-absent, `latest`). No per-chunk work, no per-file storage request on rank 0.

In v5 each group's leader ran the per-rank checks for its group and wrote its group table
(group_summaries.py); here rank 0 checks that the groups' summaries add up, and the manifest lists the groups.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from ...errors import CommitFailed
from ..format import chunk_layout, groups, part_references, parts_manifest, signing
from ..format import manifest as manifest_format
from ..format import parts as part_format
from ..format.checksum import checksum
from ..format.chunk_index import own_file
from ..format.names import DCP_METADATA, join
from ..format.safe_pickle import DCP_METADATA_FIELD
from ..gc_pause import gc_paused
from ..storage import fsio
from ..storage.writer import FaultHook
from .commit import CheckpointTarget, lineage, publish_target
from .group_summaries import GroupSummary
from .part_summary import PartSummary, summary_problems
from .save_layout import TENSOR, SaveLayout

log = logging.getLogger(__name__)

MAX_NAMED = 5  # problems named in a refusal; the rest are counted


class PartsCommitter:
    """Called on the coordinator with every rank's PartSummary (v4) or every group's GroupSummary (v5,
    group_summaries.py): commits the checkpoint or raises CommitFailed."""

    def __init__(
        self,
        target: CheckpointTarget,
        layout: SaveLayout,
        dcp_metadata_max_chunks: int,
        fault_hook: FaultHook | None,
        group_size: int | None = None,
    ) -> None:
        self.target = target
        self.group_size = group_size  # None: format v4, called with every rank's summary; else v5, every group's
        self.layout = layout
        self.dcp_metadata_max_chunks = dcp_metadata_max_chunks
        self._fault = fault_hook or (lambda point: None)
        self.manifest: dict[str, Any] | None = None
        self.seconds = 0.0
        self.ranks: list[dict[str, Any]] = []  # per rank that wrote: bytes, write_s, write_gbps

    def __call__(self, summaries: list[Any]) -> None:
        started = time.perf_counter()
        try:
            with gc_paused():  # O(ranks) small objects: the summaries, the tables (engine/gc_pause.py)
                self._commit(summaries)
        finally:
            self.seconds = time.perf_counter() - started

    def _commit(self, summaries: list[Any]) -> None:
        target = self.target
        if self.group_size is None:
            facts = _rank_facts(summaries, self.layout, target.verify_mode)
        else:
            facts = _group_facts(summaries, self.layout, self.group_size, target.verify_mode)
        if facts.problems:
            problems = facts.problems
            shown = "; ".join(problems[:MAX_NAMED]) + (
                f" (and {len(problems) - MAX_NAMED} more)" if len(problems) > MAX_NAMED else ""
            )
            raise CommitFailed(f"step {target.step} ({target.dirname}) did not commit: {shown}")
        self.ranks = facts.ranks
        self._fault("before_metadata")
        fields = dict(target.manifest_fields)
        metadata_record = None
        if self.layout.chunk_count() <= self.dcp_metadata_max_chunks:
            metadata_bytes = pickle.dumps(dcp_metadata(self.layout, facts.parts, target.path))
            fsio.write_new_file(target.root.fs, join(target.path, DCP_METADATA), metadata_bytes)
            metadata_record = {"checksum": checksum(metadata_bytes), "bytes": len(metadata_bytes)}
            if target.sign is not None and target.sign.enabled:
                # signed: .metadata is bound by a cryptographic digest too, never by xxh3 alone (FORMAT.md §12)
                metadata_record[signing.METADATA_DIGEST] = signing.digest_of(metadata_bytes, target.sign.digest)
        parent, seq = lineage(target.root, fields.get("run_id"), target.lineage_from)
        nonfinite = facts.nonfinite
        tensors = []
        for item in self.layout.tensors():
            entry = item.describe()
            if item.dtype is not None and (item.dtype.is_floating_point or item.dtype.is_complex):
                entry["finite"] = item.fqn not in nonfinite  # for drills: NaN/Inf at save time?
            tensors.append(entry)
        manifest = manifest_format.build_parts_manifest(
            checkpoint_id=target.checkpoint_id,
            parent=parent,
            seq=seq,
            step=target.step,
            tensors=tensors,
            objects=[item.describe() for item in self.layout.objects()],
            verification=facts.verification,
            **facts.tables,
            **fields,
        )
        if facts.references:  # incremental (FORMAT.md §10.6): the sibling files its parts reference
            manifest[part_references.REFERENCES_FIELD] = facts.references
        written = facts.written
        if target.sign is not None and target.sign.enabled:
            manifest[signing.DIGEST_FIELD] = target.sign.digest
            if self.group_size is None:
                # v4: each part's digest (each part holds its shard's): the signature over this manifest covers
                # every byte
                manifest[parts_manifest.PARTS_FIELD][signing.PART_DIGESTS] = "".join(
                    written[rank].part_digest or signing.NO_DIGEST if rank in written else signing.NO_DIGEST
                    for rank in range(self.layout.world_size)
                )
            elif groups.TABLE_DIGESTS not in manifest[groups.GROUPS_FIELD]:
                raise CommitFailed(
                    f"step {target.step} ({target.dirname}) did not commit: a signed save's group leaders sent no "
                    "digest of their tables"
                )
            # v5: each group table's digest is in `groups` already; each table holds its parts', each part its
            # chunks': the signature over this manifest covers every byte, and a reader checks only what it reads
        if metadata_record is not None:
            manifest[DCP_METADATA_FIELD] = metadata_record  # readers check .metadata's bytes before unpickling

        def committed() -> None:
            self.manifest = manifest

        publish_target(target, manifest, self._fault, committed)
        log.info("committed %s (%d bytes)", target.path, manifest_format.total_bytes(manifest))


@dataclass
class CommitFacts:
    """What the coordinator commits from, out of the ranks' (v4) or the groups' (v5) summaries."""

    problems: list[str]
    ranks: list[dict[str, Any]] = field(default_factory=list)  # per rank that wrote (v5: per group, its slowest)
    parts: list[tuple[int, dict[str, Any] | None]] = field(default_factory=list)  # for DCP's .metadata
    nonfinite: set[str] = field(default_factory=set)
    verification: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, Any] = field(default_factory=dict)  # build_parts_manifest's parts= (v4) or group_table= (v5)
    written: dict[int, PartSummary] = field(default_factory=dict)  # v4: per writing rank (signing)
    references: list[dict[str, Any]] = field(default_factory=list)  # incremental: the manifest's `references`


def _rank_facts(summaries: list[PartSummary | None], layout: SaveLayout, verify_mode: str) -> CommitFacts:
    problems = summary_problems(summaries, layout, verify_mode)
    if problems:
        return CommitFacts(problems)
    written = {s.rank: s for s in summaries if s is not None and s.file_bytes is not None}
    return CommitFacts(
        [],
        ranks=[
            {"rank": s.rank, "bytes": s.file_bytes, "write_s": s.write_s, "write_gbps": _gbps(s)}
            for s in written.values()
            if s.write_s is not None
        ],
        parts=[(rank, s.part) for rank, s in written.items()],
        nonfinite={fqn for s in written.values() for fqn in s.nonfinite},
        verification=_verification(verify_mode, written.values()),
        tables={
            "parts": parts_manifest.parts_table(
                layout.world_size,
                {
                    rank: {
                        "file_bytes": s.file_bytes,
                        "file_checksum": s.file_checksum,
                        "part_bytes": s.part_bytes,
                        "part_checksum": s.part_checksum,
                    }
                    for rank, s in written.items()
                },
            )
        },
        written=written,
        references=part_references.references_table(entry for s in written.values() for entry in s.referenced),
    )


def _group_facts(summaries: list[GroupSummary | None], layout: SaveLayout, size: int, verify_mode: str) -> CommitFacts:
    """v5: O(groups) checks, as summary_problems is for ranks; each leader checked its group's ranks."""
    problems = []
    count = groups.group_count(layout.world_size, size)
    if len(summaries) != count:
        problems.append(f"{len(summaries)} groups reported, {count} write the checkpoint")
    for number, summary in enumerate(summaries):
        if not isinstance(summary, GroupSummary):
            problems.append(
                f"group {number} (leader rank {groups.group_leader(number, size, layout.world_size)}) sent no summary"
            )
        elif summary.problems:
            problems.extend(summary.problems)
        elif summary.group != number:
            problems.append(f"group {number}'s leader sent group {summary.group}'s summary")
        elif summary.layout_digest != layout.digest:
            problems.append(f"group {number}'s leader planned another layout ({summary.layout_digest})")
        elif summary.entry is None:
            problems.append(f"group {number}'s leader wrote no group table")
    if problems:
        return CommitFacts(problems)
    # no problem above: every group sent its summary, with its table's entry
    sent = [s for s in summaries if s is not None]
    entries = [s.entry for s in sent if s.entry is not None]
    return CommitFacts(
        [],
        ranks=[s.slowest for s in sent if s.slowest is not None],
        parts=[item for s in sent for item in s.parts or ()],
        nonfinite={fqn for s in sent for fqn in s.nonfinite},
        verification=_verification(verify_mode, sent),
        tables={"group_table": groups.groups_table(layout.world_size, size, entries)},
        references=part_references.merge_tables(s.referenced for s in sent),
    )


def dcp_metadata(layout: SaveLayout, parts: list[tuple[int, dict[str, Any] | None]], checkpoint_path: str) -> Metadata:
    """DCP's global metadata, as DCP's own save would have written it: what a plain `dcp.load` reads. Built
    from the layout's cells and the (rank, part) of every writing rank: O(chunks), so only for small
    checkpoints."""
    located: dict[tuple[str, tuple[int, ...]], _StorageInfo] = {}
    for rank, part in parts:
        if part is None:
            raise CommitFailed(f"rank {rank} did not send its part, which DCP's .metadata needs")
        for chunk in part[part_format.TENSOR_CHUNKS]:
            located[(chunk["fqn"], tuple(chunk["offsets"]))] = _StorageInfo(
                own_file(chunk, part)["file"], chunk["offset"], chunk["length"]
            )
        for chunk in part[part_format.OBJECTS]:
            located[(chunk["fqn"], ())] = _StorageInfo(part["file"], chunk["offset"], chunk["length"])
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}

    def where(fqn: str, offsets: tuple[int, ...]) -> _StorageInfo:
        try:
            return located[(fqn, offsets)]
        except KeyError:
            raise CommitFailed(f"no part lists the chunk of {fqn} at {list(offsets)} its layout names") from None

    for item in layout.items.values():
        if item.kind != TENSOR:
            state[item.fqn] = BytesStorageMetadata()
            storage[MetadataIndex(item.fqn)] = where(item.fqn, ())
            continue
        assert item.layout is not None and item.properties is not None  # a tensor's item carries both (save_layout)
        chunks = []
        for cell in chunk_layout.stored_cells(item.layout, item.shape):  # an empty cell has no record
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(cell.offsets), sizes=torch.Size(cell.sizes)))
            storage[MetadataIndex(item.fqn, torch.Size(cell.offsets), len(chunks) - 1)] = where(item.fqn, cell.offsets)
        state[item.fqn] = TensorStorageMetadata(properties=item.properties, size=torch.Size(item.shape), chunks=chunks)
    return Metadata(
        state_dict_metadata=state,
        planner_data=layout.mappings,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_path),
    )


def _verification(mode: str, written: Any) -> dict[str, Any]:
    summaries = list(written)
    return {
        "mode": mode,
        "chunks_total": sum(s.chunks for s in summaries),
        "bytes_total": sum(s.bytes_total for s in summaries),
        "chunks_verified": sum(s.verified_chunks for s in summaries),
        "bytes_verified": sum(s.verified_bytes for s in summaries),
    }


def _gbps(summary: PartSummary) -> float:
    return summary.file_bytes / summary.write_s / 1e9 if summary.write_s and summary.file_bytes is not None else 0.0
