"""Metadata at scale (issue 35): commit, manifest, listing, `latest` and resume planning, 8 ... 16,384 ranks.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/scale.py                       the full table (a few minutes)
    PYTHONPATH=$PWD .venv/bin/python benchmarks/scale.py --ranks 8 64 --tensors 300 --layouts fsdp
    PYTHONPATH=$PWD .venv/bin/python benchmarks/scale.py --ranks 16384 131072 --tensors 1000 --layouts fsdp \
        --node-local 8 --listing 0                                             node-local saves, 8 ranks a node
    PYTHONPATH=$PWD .venv/bin/python benchmarks/scale.py --ranks 16384 131072 --tensors 1000 --layouts fsdp 2d \
        --listing 0 --no-save-requests --matrix                                issue 46's features, against its bounds

Simulated: no tensor bytes move and no process but this one runs. What runs is the real code of each step,
fed with synthetic plans and write results:
- rank 0's commit: the ranks' PartSummary objects, pickled (what the gather carries) and unpickled, then
  `PartsCommitter` (the summaries' checks, DCP's `.metadata` when the checkpoint is small enough, the manifest,
  lineage through the commit index, the commit record, the manifest's create-if-absent, `latest`);
- one rank's part: `parts.build_part` + `to_bytes` for its share of the chunks (what every rank does once);
- a resume: one rank of the new world size (half the old, or the same 2-D mesh) reads the manifest and plans
  its share with `resume_plan.plan_boxes` (the parts it needs, read and checked, and its partial `Metadata`);
- `latest` and `ls` / `timeline` over 2,000 checkpoints of that size (`--listing`; the manifests of all but the
  newest are 1-byte stand-ins, which ls and timeline never read: the request counts show it).
Layouts: `fsdp` (every tensor row-sharded over all ranks, FSDP2's Shard(0)), `ddp` (replicated, each tensor
written once by the rank a balance picks), `2d` (dp x tp mesh, tp = 8: matrices Shard(0) over dp and Shard(1)
over tp). Storage is an in-memory filesystem that counts what each call would be on S3 (GET, PUT, LIST, HEAD).
One rank's share of a save (its shard, read-back, size check and part) is counted on the wire instead, against
moto's S3 server on loopback (real s3fs), for verify.mode sample, full and off, and with a multipart shard.

Prints one JSON line per configuration and a table; `--out FILE` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import statistics
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.memory import MemoryFileSystem
from torch.distributed.checkpoint.metadata import TensorProperties

from lightning_shardckpt.engine import catalog, commit_index
from lightning_shardckpt.engine.config import SignConfig
from lightning_shardckpt.engine.format import chunk_layout, groups, part_references
from lightning_shardckpt.engine.format import manifest as manifest_format
from lightning_shardckpt.engine.format import parts as part_format
from lightning_shardckpt.engine.format.checksum import checksum
from lightning_shardckpt.engine.format.chunk_index import ChunkIndex
from lightning_shardckpt.engine.format.file_digests import digest_of
from lightning_shardckpt.engine.format.names import MANIFEST, checkpoint_dirname, join
from lightning_shardckpt.engine.load.resume_plan import plan_boxes
from lightning_shardckpt.engine.load.shared_reads import SharedChunks, shared_items
from lightning_shardckpt.engine.save.commit import CheckpointTarget
from lightning_shardckpt.engine.save.group_summaries import lead_group
from lightning_shardckpt.engine.save.node_groups import table_copiers
from lightning_shardckpt.engine.save.part_summary import PartSummary
from lightning_shardckpt.engine.save.parts_commit import PartsCommitter
from lightning_shardckpt.engine.save.save_layout import OBJECT, TENSOR, ItemLayout, SaveLayout
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.engine.storage.coalesced_reads import RUN_MAX_BYTES, SMALL_CHUNK_BYTES

TP = 8  # the 2-D mesh's tensor-parallel size
# a decoder layer's shapes, 70B-class: q/o [8192, 8192], k/v [1024, 8192], up/gate [28672, 8192], down [8192, 28672],
# norms [8192]; optimizer moments repeat them
SHAPES = ([8192, 8192], [1024, 8192], [1024, 8192], [8192, 8192], [28672, 8192], [28672, 8192], [8192, 28672], [8192])
DEFAULT_THRESHOLD = 50_000  # SaveConfig.dcp_metadata_max_chunks
SIGN_DIGEST = "sha256"  # --sign's digest: the standard library's (the writer's default, blake3, is optional)


class CountingS3(MemoryFileSystem):
    """An in-memory filesystem that counts its calls as the S3 requests they would be."""

    protocol = ("s3sim",)
    root_marker = "/"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: Counter = Counter()

    def cat_file(self, path, start=None, end=None, **kwargs):
        self.requests["GET"] += 1
        return super().cat_file(path, start=start, end=end, **kwargs)

    def cat_ranges(self, paths, starts, ends, max_gap=None, on_error="return", **kwargs):
        self.requests["GET"] += len(paths)
        return [self._one(p, s, e) for p, s, e in zip(paths, starts, ends)]

    def _one(self, path, start, end):
        try:
            return MemoryFileSystem.cat_file(self, path, start=start, end=end)
        except Exception as err:  # noqa: BLE001 - per range, as cat_ranges(on_error="return") does
            return err

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode or "x" in mode:
            self.requests["PUT"] += 1
        return super()._open(path, mode=mode, **kwargs)

    def ls(self, path, detail=True, **kwargs):
        self.requests["LIST"] += 1
        return super().ls(path, detail=detail, **kwargs)

    def info(self, path, **kwargs):  # exists() and size() come here too: one HEAD each
        self.requests["HEAD"] += 1
        return super().info(path, **kwargs)

    def makedirs(self, path, exist_ok=False):  # S3 has no directories: free
        return super().makedirs(path, exist_ok=True)


fsspec.register_implementation("s3sim", CountingS3, clobber=True)


# --- the synthetic checkpoint ---


def tensor_shapes(tensors: int) -> list[list[int]]:
    return [list(SHAPES[i % len(SHAPES)]) for i in range(tensors)]


def layout_of(kind: str, index: int, shape: list[int], world: int) -> chunk_layout.Layout:
    if kind == "fsdp":
        return chunk_layout.Layout(rank=0, split=((0, world, 1),))
    if kind == "ddp":
        return chunk_layout.replicated(index % world)
    dp = max(1, world // TP)
    if len(shape) == 1:
        return chunk_layout.Layout(rank=0, split=((0, dp, TP),))  # written by tp coordinate 0
    return chunk_layout.Layout(rank=0, split=((0, dp, TP), (1, TP, 1)))


def save_layout(kind: str, world: int, tensors: int) -> SaveLayout:
    items: dict[str, ItemLayout] = {}
    for index, shape in enumerate(tensor_shapes(tensors)):
        fqn = f"model.layers.{index // len(SHAPES)}.t{index % len(SHAPES)}.weight"
        items[fqn] = ItemLayout(
            fqn,
            TENSOR,
            False,
            tuple(shape),
            torch.bfloat16,
            layout_of(kind, index, shape, world),
            properties=TensorProperties(dtype=torch.bfloat16),
        )
    items["lightning"] = ItemLayout("lightning", OBJECT, False, rank=0)
    return SaveLayout(items, world, f"{uuid.uuid4().int % 2**64:016x}", {fqn: (fqn,) for fqn in items})


def part_of_rank(
    layout: SaveLayout, rank: int, checkpoint_id: str, signed_as: str | None = None, base: str | None = None
) -> dict[str, Any]:
    """Rank `rank`'s part as the writer builds it: one record per chunk the layout gives it. `signed_as` "v5": each
    record with its chunk's digest (FORMAT.md §12.2); "v4": the part with its shard file's (stand-ins, as no tensor
    bytes exist here). `base` (--incremental: a sibling checkpoint's directory): every tensor chunk unchanged, so
    referenced in the rank's own file of `base` (FORMAT.md §10.6), the largest part and manifest an incremental save
    writes; objects are written again."""
    signed = signed_as == "v5"
    chunks, objects, offset, held = [], [], 0, 0
    for item in layout.items.values():
        if item.kind == OBJECT:
            if item.rank == rank:
                record: dict[str, Any] = {
                    "fqn": item.fqn,
                    "offset": offset,
                    "length": 4096,
                    "checksum": _digest(offset),
                }
                if signed:
                    record["digest"] = _digest(offset) * 4
                objects.append(record)
                offset += 4096
            continue
        for cell in _cells_of_rank(item, rank):
            if not chunk_layout.holds_elements(cell.sizes):
                continue  # no record for a chunk of no element (parts_save._holds_nothing, FORMAT.md §10.1)
            length = chunk_bytes(cell.sizes)
            record = {
                "fqn": item.fqn,
                "offsets": list(cell.offsets),
                "sizes": list(cell.sizes),
                "offset": offset,
                "length": length,
                "checksum": _digest(offset),
                "finite": True,
            }
            if base is not None:  # in the base's file, where the rank wrote it at its full save
                record.update(offset=held, checksum=_digest(held), file=f"../{base}/__{rank}_0.distcp")
                held += length
            else:
                offset += length
            if signed:
                record["digest"] = record["checksum"] * 4
            chunks.append(record)
    for record in chunks:
        if "file" in record:
            record["file_bytes"] = held  # the holder's size (its objects aside: stand-ins)
    own = len(objects) + sum("file" not in record for record in chunks)
    verification = {"mode": "sample", "chunks_total": own, "bytes_total": offset}
    verification.update(chunks_verified=1, bytes_verified=min(offset, 1600))
    part = part_format.build_part(
        checkpoint_id=checkpoint_id,
        rank=rank,
        file=f"__{rank}_0.distcp",
        file_bytes=offset,
        tensor_chunks=chunks,
        objects=objects,
        verification=verification,
        write_s=1.0,
    )
    if signed_as == "v4":
        part["file_digest"] = _digest(rank) * 4
    return part


def _cells_of_rank(item: ItemLayout, rank: int) -> list[chunk_layout.Cell]:
    """The cells of `item` that `rank` wrote, without visiting the others (rules: invert the rank map)."""
    layout = item.layout
    if not layout.split:
        return [chunk_layout.Cell((0,) * len(item.shape), item.shape, layout.rank)] if layout.rank == rank else []
    grid, rest = [], rank - layout.rank
    for _, pieces, stride in sorted(layout.split, key=lambda entry: -entry[2]):
        index = rest // stride if stride else 0
        if not 0 <= index < pieces:
            return []
        grid.append(index)
        rest -= index * stride
    if rest:
        return []
    order = sorted(range(len(layout.split)), key=lambda i: -layout.split[i][2])
    by_entry = [0] * len(layout.split)
    for position, entry in enumerate(order):
        by_entry[entry] = grid[position]
    return [chunk_layout.cell_at(layout, item.shape, by_entry)]


def summaries(
    layout: SaveLayout,
    checkpoint_id: str,
    real: set[int],
    with_parts: bool,
    signed_as: str | None = None,
    base: str | None = None,
) -> list[PartSummary]:
    """Every rank's summary; the ranks in `real` (and all, `with_parts`) carry their actual part's size and digest
    (`signed_as`, part_of_rank's: its cryptographic digest too, SIGN_DIGEST; `base`: its references)."""
    signed = signed_as is not None
    counts = layout.chunks_per_rank()
    out = []
    for rank in range(layout.world_size):
        summary = PartSummary(rank, layout.digest, chunks=counts[rank], write_s=1.0)
        if counts[rank]:
            if rank in real or with_parts:
                part = part_of_rank(layout, rank, checkpoint_id, signed_as, base)
                summary.referenced = part_references.reference_entries(part)
                data = part_format.to_bytes(part)
                summary.part_bytes, summary.part_checksum = len(data), checksum(data)
                summary.part_digest = digest_of(data, SIGN_DIGEST) if signed else None
                summary.file_bytes, summary.file_checksum = part["file_bytes"], part["file_checksum"]
                summary.part = part if with_parts else None
            else:
                summary.part_bytes, summary.part_checksum = 150 * counts[rank], _digest(rank)
                summary.file_bytes, summary.file_checksum = 2**20 * counts[rank], _digest(rank + 1)
                summary.part_digest = _digest(rank) * 4 if signed else None
                if base is not None:  # every chunk referenced in its own file of the base; objects aside
                    summary.referenced = [(base, rank, summary.file_bytes, counts[rank])]
            summary.bytes_total = summary.file_bytes
            summary.verified_chunks, summary.verified_bytes = 1, 1600
        out.append(summary)
    return out


def _digest(value: int) -> str:
    return f"{(value * 0x9E3779B97F4A7C15) % 2**64:016x}"


def _prod(values: Any) -> int:
    out = 1
    for value in values:
        out *= value
    return out


# --- one configuration ---


def resume_targets(kind: str, layout: SaveLayout) -> tuple[int, int, dict[str, Any]]:
    """(new world size, the rank measured, its boxes): half the world (rows resharded), or the same 2-D mesh."""
    world = layout.world_size
    if kind == "2d" or world == 1:
        new_world, rank = world, world // 2
    else:
        new_world, rank = max(1, world // 2), max(1, world // 2) // 2
    return new_world, rank, boxes_of(kind, list(layout.items.values()), new_world, rank)


def boxes_of(kind: str, items: list[ItemLayout], new_world: int, rank: int) -> dict[str, Any]:
    """The box of each of `items` that rank `rank` of `new_world` holds (None: none of it; objects: None)."""
    boxes: dict[str, Any] = {}
    for item in items:
        if item.kind == OBJECT:
            boxes[item.fqn] = None
            continue
        shape = item.shape
        if kind == "ddp":
            boxes[item.fqn] = ((0,) * len(shape), shape)
        elif kind == "fsdp":
            rows = -(-shape[0] // new_world)
            start = min(rank * rows, shape[0])
            boxes[item.fqn] = ((start, *([0] * (len(shape) - 1))), (min(rows, shape[0] - start), *shape[1:]))
        else:
            cells = _cells_of_rank(item, rank)
            boxes[item.fqn] = (cells[0].offsets, cells[0].sizes) if cells else None
    return boxes


def manifest_lists(layout: SaveLayout) -> dict[str, Any]:
    """The manifest's `tensors` and `objects` of `layout` (what shared_reads.shared_items chooses from)."""
    return {
        "tensors": [item.describe() for item in layout.tensors()],
        "objects": [item.describe() for item in layout.objects()],
    }


def chunk_bytes(sizes: Any) -> int:
    """A stand-in chunk's stored bytes: a record's ~1.6 KB of zip framing and a bf16 payload."""
    return 1600 + 2 * _prod(sizes)


def _coalesced_requests(chunks: int, small: tuple[int, int]) -> int:
    """Range requests for `chunks` chunks of one file, `small` = (how many, their bytes) of them small: those in
    runs of at most RUN_MAX_BYTES (storage/coalesced_reads.py; a rank's cells of one old rank are neighbours in its
    file: exact when it reads all of them, as FSDP2 halving and a same-mesh 2-D resume do), each larger one alone."""
    count, nbytes = small
    return chunks - count + math.ceil(nbytes / RUN_MAX_BYTES)


def resume_fanout(kind: str, layout: SaveLayout, group_size: int | None) -> dict[str, Any]:
    """Every rank of the resume's new world (resume_targets'), and what it reads: the parts, shard files and
    group tables of the old ranks whose stored cells overlap its boxes (chunk_layout.cells_within, as the plan
    takes them), and on the coordinator also the writers' of what it reads for every rank (shared_reads.
    shared_items); `before`: as a resume read before issue 46, each rank reading the shared items itself. Per
    kind of file: the most ranks reading one file, how many files every rank reads, and the most requests one
    rank makes to one file (a table or part: once; a shard file: one range read per run of small neighbouring
    chunks and per larger chunk; before: per chunk).
    Tensors sharing a layout and shape share a box per rank: computed once per such pattern."""
    new_world, _, _ = resume_targets(kind, layout)
    shared = set(shared_items(manifest_lists(layout), set(layout.items)))
    patterns: dict[tuple[Any, ...], tuple[ItemLayout, int]] = {}
    for item in layout.tensors():
        if item.fqn in shared:
            continue
        key = (item.tensor_layout, item.shape)
        first, times = patterns.get(key, (item, 0))
        patterns[key] = (first, times + 1)
    shared_writers: dict[int, int] = Counter()  # old rank -> shared records it holds
    for item in layout.items.values():
        if item.fqn in shared:
            shared_writers[item.rank if item.kind == OBJECT else item.tensor_layout.rank] += 1
    readers = {"now": (Counter(), Counter(), Counter()), "before": (Counter(), Counter(), Counter())}
    most_chunks = {"now": 0, "before": 0}  # range reads of one rank to one shard file
    total = {"now": 0, "before": 0}  # every GET of the resume: tables, parts and shard range reads, all ranks
    for rank in range(new_world):
        per_file: Counter = Counter()  # chunks this rank reads from each old rank's shard file
        small: dict[int, tuple[int, int]] = {}  # of which small ones (coalesced_reads.SMALL_CHUNK_BYTES): count, bytes
        for item, times in patterns.values():
            box = boxes_of(kind, [item], new_world, rank)[item.fqn]
            if box is None:
                continue
            for cell in chunk_layout.cells_within(item.tensor_layout, item.shape, box):
                per_file[cell.rank] += times
                if chunk_bytes(cell.sizes) <= SMALL_CHUNK_BYTES:
                    count, nbytes = small.get(cell.rank, (0, 0))
                    small[cell.rank] = (count + times, nbytes + times * chunk_bytes(cell.sizes))
        for when in ("now", "before"):
            if when == "now":  # one request per run of small neighbours (taken as adjacent), one per larger chunk
                files = Counter({old: _coalesced_requests(n, small.get(old, (0, 0))) for old, n in per_file.items()})
                if rank == 0:  # the coordinator's one range read per run of shared records in a file
                    files.update({old: 1 for old in shared_writers})
            else:  # one range read per chunk, every rank reading the shared items itself
                files = Counter(per_file)
                files.update(shared_writers)
            parts, shards, tables = readers[when]
            for old, chunks in files.items():
                parts[old] += 1
                shards[old] += 1
                most_chunks[when] = max(most_chunks[when], chunks)
                total[when] += 1 + chunks
            if group_size is not None:
                for group in {old // group_size for old in files}:
                    tables[group] += 1
                    total[when] += 1
    out: dict[str, Any] = {"new_world": new_world}
    for when, (parts, shards, tables) in readers.items():
        out[when] = {
            "most_readers": {"part": max(parts.values(), default=0), "shard": max(shards.values(), default=0)}
            | ({"group_table": max(tables.values(), default=0)} if group_size is not None else {}),
            "read_by_every_rank": sum(n == new_world for n in parts.values())
            + sum(n == new_world for n in shards.values())
            + sum(n == new_world for n in tables.values()),
            "most_requests_per_rank": {"part": 1, "group_table": 1, "shard": most_chunks[when]},
            "requests_total": total[when],
        }
    return out


def run(
    kind: str,
    world: int,
    tensors: int,
    threshold: int,
    group_size: int | None = None,
    sign_key: str | None = None,
    incremental: bool = False,
    ranks_per_node: int | None = None,
) -> dict[str, Any]:
    """One configuration; `group_size`: format v5 (every group's leader simulated, each timed on its own),
    None: format v4 (rank 0 hears from every rank). As the writer does (persist._group_size), a world of one
    group is written as v4, unless signed. `sign_key` (a PEM private key file): signed (FORMAT.md §12; v5: §12.2),
    the commit signing the manifest, and the resume planned as a rank under a signature policy plans it (each group
    table and part it reads checked against its digest). `incremental`: the save after a full one where no tensor
    changed (every chunk a reference in the parts, FORMAT.md §10.6), and the resume follows those references.
    `ranks_per_node`: a node-local save (each node its own
    root): each leader also sends its table to one rank on each other node its group spans
    (engine/save/node_groups.py), counted and sized here; everything else is as on a shared root."""
    signed = sign_key is not None
    base = checkpoint_dirname(6, "b" * 12) if incremental else None
    if group_size is not None and world <= group_size and not signed:
        group_size = None  # a signed save is v5 at any size (persist._group_size)
    # signed v5: a digest per chunk record; signed v4 (--format-version 4): one per part, its shard file's
    signed_as = None if not signed else ("v5" if group_size is not None else "v4")
    count = groups.group_count(world, group_size) if group_size is not None else 1
    location = fsio.resolve(f"s3sim:///scale-{uuid.uuid4().hex[:8]}")
    fs, root = location.fs, location.path
    layout = save_layout(kind, world, tensors)
    chunks = layout.chunk_count()
    checkpoint_id = uuid.uuid4().hex[:12]
    _, rank, boxes = resume_targets(kind, layout)
    needed = {
        cell.rank
        for item in layout.tensors()
        if boxes[item.fqn] is not None
        for cell in chunk_layout.cells_within(item.layout, item.shape, boxes[item.fqn])
    } | {0}
    small = chunks <= threshold
    sums = summaries(layout, checkpoint_id, needed, with_parts=small, signed_as=signed_as, base=base)
    # each rank's own work: its part (the busiest rank: the one with the most chunks)
    busiest = max(range(world), key=lambda r: sums[r].chunks)
    started = time.perf_counter()
    part_bytes = len(part_format.to_bytes(part_of_rank(layout, busiest, checkpoint_id, signed_as, base)))
    rank_part_s = time.perf_counter() - started
    for r in needed:  # the parts a resume reads, on storage
        path = join(root, checkpoint_dirname(7, checkpoint_id), part_format.part_filename(r))
        fs.pipe_file(path, part_format.to_bytes(part_of_rank(layout, r, checkpoint_id, signed_as, base)))
    gathered = [pickle.dumps(s) for s in sums]
    leader_max_s, leader_median_s, received, leaders = 0.0, 0.0, gathered, []
    copies, copy_bytes = 0, 0  # node-local: the most table copies one leader sends, and their bytes
    if group_size is not None:
        # every leader's work, each timed alone: unpickle its members' summaries, check them, write its table
        # (into the first checkpoint's directory: the one a resume plans from). Rank 0 leads no group
        first_directory = join(root, checkpoint_dirname(7, checkpoint_id))
        times = []
        for group in range(count):
            ranks = groups.group_ranks(group, group_size, world)
            # A real leader's process holds its own group; this one holds the whole simulated world (every rank's
            # summary, of every configuration run so far). Unfrozen, the cyclic collector's full (generation 2)
            # pass over that heap landed in one leader's window now and then: 0.21-0.33 s, where the leader's own
            # work was 0.01 s (a gc.callbacks trace put one generation-2 pass in each slow window, none elsewhere).
            # Frozen, a collection sees only what this leader allocates, as in its own process.
            gc.freeze()
            started = time.perf_counter()
            members = [pickle.loads(gathered[r]) for r in ranks]
            table: list[bytes] = []
            leaders.append(
                lead_group(
                    members,
                    layout,
                    group,
                    group_size,
                    world,
                    fs,
                    first_directory,
                    checkpoint_id,
                    "sample",
                    SIGN_DIGEST if signed else None,
                    table,
                )
            )
            times.append(time.perf_counter() - started)
            if ranks_per_node and table:
                roots = [str(r // ranks_per_node) for r in ranks]
                sent = len(table_copiers(roots, range(len(roots)), len(roots) - 1))
                if len(table[0]) * sent > copy_bytes:
                    copies, copy_bytes = sent, len(table[0]) * sent
        gc.unfreeze()
        leader_max_s = max(times, default=0.0)
        leader_median_s = statistics.median(times)
        received = [pickle.dumps(leader) for leader in leaders]  # what rank 0 hears: one summary per leader

    def commit(checkpoint: str) -> tuple[PartsCommitter, float, dict[str, int]]:
        target = CheckpointTarget(
            root=location,
            dirname=checkpoint_dirname(7, checkpoint),
            checkpoint_id=checkpoint,
            step=7,
            verify_mode="sample",
            manifest_fields={
                "topology": {"world_size": world, "device_type": "cuda", "parallelism": kind, "mesh_shape": None},
                "run_id": "scale-bench",
            },
            sign=SignConfig(key_path=sign_key, digest=SIGN_DIGEST) if signed else None,
        )
        fs.requests.clear()
        started = time.perf_counter()
        # the gather's unpickling, on rank 0: every rank's summary (v4) or every leader's (v5)
        heard = [pickle.loads(data) for data in received]
        committer = PartsCommitter(target, layout, threshold, None, group_size=group_size)
        committer(heard)
        return committer, time.perf_counter() - started, dict(fs.requests)

    # timed alone (tracemalloc slows allocation-heavy code several times), then once more for its peak memory;
    # the second commit follows the first one's `latest` and index, as every commit after a run's first does
    first, _, _ = commit(checkpoint_id)
    tracemalloc.start()
    commit(uuid.uuid4().hex[:12])
    commit_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    newest, commit_s, commit_requests = commit(uuid.uuid4().hex[:12])
    target = first.target
    directory = join(root, target.dirname)
    manifest_bytes = len(fs.cat_file(join(directory, MANIFEST)))
    record_bytes = len(fs.cat_file(join(directory, "commit.json")))
    metadata_bytes = len(fs.cat_file(join(directory, ".metadata"))) if fs.exists(join(directory, ".metadata")) else 0

    fs.requests.clear()
    started = time.perf_counter()
    entry = catalog.find(location, "latest")
    latest_s = time.perf_counter() - started
    latest_requests = dict(fs.requests)
    assert entry.name == newest.target.dirname, (entry.name, newest.target.dirname)  # the newest of 3 commits

    def plan_share() -> tuple[Any, float]:
        started = time.perf_counter()
        # the picked checkpoint's manifest, read and validated as rank 0 reads it once `latest` named it (one GET;
        # the other ranks get it in the pick's broadcast, loader.py): an upper bound for any rank
        manifest = manifest_format.parse(fs.cat_file(join(directory, MANIFEST)), directory)
        # as under a policy (the key id only names it in refusals); v4 signed: files hashed whole, not simulated here
        signed_by = "bench" if signed and groups.is_signed(manifest) else None
        plan = plan_boxes(location.fs, directory, manifest, boxes, {}, signed_by, broadcast)
        return plan, time.perf_counter() - started

    # what the coordinator reads for every rank and broadcasts (loader._shared_chunks): the records the measured
    # rank plans those items from, with no part of theirs read (their bytes: no shard bytes exist here)
    coordinator = ChunkIndex(
        location.fs, directory, manifest_format.parse(fs.cat_file(join(directory, MANIFEST)), directory)
    )
    broadcast = SharedChunks(
        records={
            fqn: coordinator.object_chunk(fqn)
            for fqn in shared_items(manifest_lists(layout), set(layout.items))
            if layout.items[fqn].kind == OBJECT
        }
    )
    fs.requests.clear()
    plan, plan_s = plan_share()
    plan_requests = dict(fs.requests)
    tracemalloc.start()
    plan_share()
    plan_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    records = sum(layout.chunks_per_rank())
    empty_records = sum(
        not chunk_layout.holds_elements(chunk["sizes"])
        for r in needed
        for chunk in part_of_rank(layout, r, checkpoint_id, signed_as)[part_format.TENSOR_CHUNKS]
    )
    started = time.perf_counter()
    fanout = resume_fanout(kind, layout, group_size)
    fanout_s = time.perf_counter() - started
    plan_read = manifest_bytes + sum(
        len(part_format.to_bytes(part_of_rank(layout, r, checkpoint_id, signed_as, base))) for r in plan.part_ranks
    )
    if group_size is not None:  # and the group tables of those parts' ranks
        table_bytes = json.loads(fs.cat_file(join(directory, MANIFEST)))["groups"]["table_bytes"]
        plan_read += sum(table_bytes[g] for g in {r // group_size for r in plan.part_ranks})
    return {
        "layout": kind,
        "ranks": world,
        "tensors": tensors,
        "chunks": chunks,
        "manifest_bytes": manifest_bytes,
        "commit_record_bytes": record_bytes,
        "dcp_metadata_bytes": metadata_bytes,
        "format_version": 4 if group_size is None else 5,
        "signed": signed,
        "incremental": incremental,
        "group_size": group_size,
        "gather_bytes": sum(map(len, received)),
        # messages to one rank in the gather: rank 0 hears every other rank (v4) or every leader (v5; it leads
        # no group), a leader its group's other members
        "rank0_hears": world - 1 if group_size is None else count,
        "leader_hears": 0 if group_size is None else group_size - 1,
        "rank0_commit_s": round(commit_s, 4),
        "leader_s": round(leader_max_s, 4),  # v5: the slowest leader's work (one hiccup of a loaded host shows here)
        "leader_median_s": round(leader_median_s, 4),
        "rank0_commit_peak_mb": round(commit_peak / 1e6, 1),
        "rank_part_s": round(rank_part_s, 4),
        "rank_part_bytes": part_bytes,
        "resume_rank": rank,
        "resume_plan_s": round(plan_s, 4),
        "resume_plan_peak_mb": round(plan_peak / 1e6, 1),
        "resume_read_bytes": plan_read,
        # and the tensor bytes it reads: its stored cells' chunks whole (a stand-in record each, chunk_bytes), what
        # the metadata above is read for; with them, signing's share of what a resume reads
        "resume_tensor_bytes": sum(
            chunk_bytes(cell.sizes)
            for item in layout.tensors()
            if boxes.get(item.fqn) is not None
            for cell in chunk_layout.cells_within(item.tensor_layout, item.shape, boxes[item.fqn])
        ),
        "resume_parts": plan.parts_read,
        "resume_group_tables": plan.group_tables_read,
        "latest_s": round(latest_s, 4),
        **({"node_local_table_copies": copies, "node_local_copy_bytes": copy_bytes} if ranks_per_node else {}),
        "requests": {"commit_rank0": commit_requests, "latest": latest_requests, "resume_rank": plan_requests},
        # every record the ranks write (the commit's count: stored cells and objects), the cells of no element
        # that get none (before issue 46 each was a record), and records of no element in the parts built here
        "records": records,
        "empty_cells_unrecorded": chunks - records,
        "empty_records": empty_records,
        "resume_fanout": fanout,
        "resume_fanout_s": round(fanout_s, 2),
    }


def rank_save_requests(tensors: int, mode: str = "sample", big_tensor_mib: int = 0) -> dict[str, int]:
    """The S3 requests of one rank's share of a save, through the real write path (`save_parts` with the commit
    left out: its shard file, the read-back, the stored-size check and its part), against moto's S3 server on
    loopback through tests/helpers/s3_server.py's FaultProxy, which records each request on the wire (s3fs and
    botocore run their production code). `big_tensor_mib`: one more tensor that large, so the shard is a
    multipart upload (s3fs's 50 MiB parts). Returns PUT / GET / HEAD / LIST / POST counts, `upload` (the shard's
    own requests: its PUT, or its multipart create, parts and completion) and `beyond_upload` (all the others)."""
    import re

    from lightning_shardckpt.engine.config import SaveConfig, VerifyConfig
    from lightning_shardckpt.engine.save import save_layout as layouts
    from lightning_shardckpt.engine.save.parts_save import save_parts
    from tests.helpers.s3_server import FaultProxy, S3Server

    server = S3Server()
    proxy = FaultProxy(server.host, server.port)
    try:
        server.create_bucket("scale")
        location = fsio.resolve(f"s3://scale/rank-{uuid.uuid4().hex[:8]}", server.storage_options(proxy.endpoint))
        state = {f"model.t{i}": torch.full((4, 4), float(i)) for i in range(tensors)}
        if big_tensor_mib:
            state["model.big"] = torch.ones(big_tensor_mib * 2**18)  # float32: 4 bytes each
        state["lightning"] = {"global_step": 7}
        layout = layouts.describe(state, None, None)
        proxy.clear()
        save_parts(
            state,
            layout,
            fs=location.fs,
            directory=join(location.path, checkpoint_dirname(7, "0123456789ab")),
            checkpoint_id="0123456789ab",
            group=None,
            config=SaveConfig(verify=VerifyConfig(mode=mode)),
            commit=lambda summaries: None,
        )
        counts: Counter = Counter()
        for request in proxy.requests():
            listing = request.method == "GET" and "list-type=" in request.path
            counts["LIST" if listing else request.method] += 1
            shard = re.search(r"/__0_0\.distcp(\?|$)", request.path) is not None
            counts["upload" if shard and request.method in ("PUT", "POST") else "beyond_upload"] += 1
        return dict(counts)
    finally:
        proxy.stop()
        server.stop()


# --- ls / timeline over 2,000 checkpoints ---


def listing(kind: str, world: int, tensors: int, count: int, group_size: int | None = None) -> dict[str, Any]:
    """ls, timeline and `latest` over `count` committed checkpoints of this size, on local disk, 3 runs."""
    from lightning_shardckpt.ops.timeline import timeline

    one = run(kind, world, tensors, 0, group_size)  # the manifest size of one such checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        location = fsio.resolve(tmp)
        saved = _commit_many(location, kind, world, tensors, count, group_size)
        times: dict[str, list[float]] = {"ls": [], "timeline": [], "latest": []}
        for _ in range(3):
            started = time.perf_counter()
            entries = catalog.list_checkpoints(location)
            times["ls"].append(time.perf_counter() - started)
            assert sum(e.committed for e in entries) == count, [e.problem for e in entries if not e.committed][:1]
            started = time.perf_counter()
            rows = timeline(location)["checkpoints"]
            times["timeline"].append(time.perf_counter() - started)
            assert len(rows) == count
            started = time.perf_counter()
            assert catalog.find(location, "latest").name == saved
            times["latest"].append(time.perf_counter() - started)
    return {
        "layout": kind,
        "ranks": world,
        "tensors": tensors,
        "checkpoints": count,
        "manifest_bytes": one["manifest_bytes"],
        **{f"{name}_s": [round(x, 3) for x in sorted(values)] for name, values in times.items()},
    }


def _commit_many(location: Any, kind: str, world: int, tensors: int, count: int, group_size: int | None) -> str:
    """`count` committed checkpoints of one run; the newest through the real commit code (its lineage through the
    commit index), the older ones as their commit record, index marker and a 1-byte manifest stand-in (ls and
    timeline read commit records only; `latest` reads the newest's manifest): writing 2,000 real 1 MB manifests
    would measure the disk, not the code."""
    layout = save_layout(kind, world, tensors)
    fs, root = location.fs, location.path
    created = datetime.now(timezone.utc) - timedelta(hours=count)
    parent = None
    for step in range(count - 1):
        checkpoint_id = uuid.uuid4().hex[:12]
        name = checkpoint_dirname(step, checkpoint_id)
        directory = join(root, name)
        fs.makedirs(directory, exist_ok=True)
        stand_in = b"{"
        manifest = {
            "format_version": 4,
            "id": checkpoint_id,
            "step": step,
            "run_id": "scale-bench",
            "parent": parent,
            "seq": step + 1,
            "created_at": (created + timedelta(minutes=step)).isoformat(timespec="milliseconds"),
            "epoch": 0,
            "samples_consumed": None,
            "topology": {"world_size": world, "device_type": "cuda", "parallelism": kind, "mesh_shape": None},
            "verification": {"mode": "sample", "chunks_total": layout.chunk_count()},
            "extra": {"metrics": {"loss": 2.0 / (step + 1)}},
            "identity": {},
            "parts": {"count": 0, "file_bytes": [], "part_bytes": []},
        }
        record = manifest_format.build_commit_record(manifest, stand_in)
        fs.pipe_file(join(directory, "commit.json"), manifest_format.to_bytes(record))
        fs.pipe_file(join(directory, MANIFEST), stand_in)
        commit_index.write_marker(fs, root, manifest, name)
        fsio.replace_small_file(fs, join(root, "latest"), (name + "\n").encode())
        parent = checkpoint_id
    checkpoint_id = uuid.uuid4().hex[:12]
    target = CheckpointTarget(
        root=location,
        dirname=checkpoint_dirname(count - 1, checkpoint_id),
        checkpoint_id=checkpoint_id,
        step=count - 1,
        verify_mode="sample",
        manifest_fields={
            "topology": {"world_size": world, "device_type": "cuda", "parallelism": kind, "mesh_shape": None},
            "run_id": "scale-bench",
        },
    )
    fs.makedirs(target.path, exist_ok=True)  # the ranks' writes create it
    ranks = summaries(layout, checkpoint_id, set(), with_parts=False)
    if group_size is None or world <= group_size:
        PartsCommitter(target, layout, 0, None)(ranks)
    else:  # format v5: every leader's table and summary, then rank 0's commit from them
        leaders = [
            lead_group(
                [ranks[r] for r in groups.group_ranks(g, group_size, world)],
                layout,
                g,
                group_size,
                world,
                fs,
                target.path,
                checkpoint_id,
                "sample",
            )
            for g in range(groups.group_count(world, group_size))
        ]
        PartsCommitter(target, layout, 0, None, group_size=group_size)(leaders)
    return target.dirname


# --- report ---


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| layout | format | ranks | tensors | chunks | manifest | .metadata | gather | rank 0 commit s | rank 0 MB "
        "| leader s (median, slowest) | messages to rank 0 / a leader "
        "| part (busiest rank) | resume plan s | resume MB | resume reads | parts read | requests: commit (rank 0) "
        "| `latest` | resume (one rank) |"
    )
    lines = [head, "|" + "---|" * 20]
    for r in rows:
        req = r["requests"]
        lines.append(
            f"| {r['layout']} | v{r['format_version']}{' signed' if r.get('signed') else ''} | {r['ranks']:,} "
            f"| {r['tensors']:,} | {r['chunks']:,} "
            f"| {_size(r['manifest_bytes'])} "
            f"| {_size(r['dcp_metadata_bytes']) if r['dcp_metadata_bytes'] else '-'} | {_size(r['gather_bytes'])} "
            f"| {r['rank0_commit_s']:.3f} | {r['rank0_commit_peak_mb']} | {r['leader_median_s']:.3f}, {r['leader_s']:.3f} "
            f"| {r['rank0_hears']:,} / {r['leader_hears']:,} "
            f"| {_size(r['rank_part_bytes'])} "
            f"| {r['resume_plan_s']:.3f} | {r['resume_plan_peak_mb']} | {_size(r['resume_read_bytes'])} "
            f"| {r['resume_parts']} | {_req(req['commit_rank0'])} | {_req(req['latest'])} | {_req(req['resume_rank'])} |"
        )
    return "\n".join(lines)


def fanout_table(rows: list[dict[str, Any]]) -> str:
    """A full resume's requests per file (resume_fanout), before issue 46 and now, and the records written."""
    lines = [
        "| layout | ranks → new | records | empty cells (no record) | empty records | files read by every rank "
        "(before → now) | most ranks reading one file: table / part / shard (before → now) "
        "| most range reads of one rank to one shard file | GETs of the whole resume (before → now) |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        f = r["resume_fanout"]
        before, now = f["before"], f["now"]

        def most(side: dict[str, Any]) -> str:
            return " / ".join(str(side["most_readers"].get(k, "-")) for k in ("group_table", "part", "shard"))

        lines.append(
            f"| {r['layout']} | {r['ranks']:,} → {f['new_world']:,} | {r['records']:,} "
            f"| {r['empty_cells_unrecorded']:,} | {r['empty_records']} "
            f"| {before['read_by_every_rank']} → {now['read_by_every_rank']} | {most(before)} → {most(now)} "
            f"| {now['most_requests_per_rank']['shard']} | {before['requests_total']:,} → {now['requests_total']:,} |"
        )
    return "\n".join(lines)


GROWTH = (  # (column, row key): what grows with the world size, on rank 0 and on every rank
    ("manifest", "manifest_bytes"),
    ("gather to rank 0", "gather_bytes"),
    ("rank 0 commit s", "rank0_commit_s"),
    ("rank 0 MB", "rank0_commit_peak_mb"),
    ("slowest leader s", "leader_s"),
    ("part (busiest rank)", "rank_part_bytes"),
    ("resume plan s", "resume_plan_s"),
    ("resume reads", "resume_read_bytes"),
)


def growth_table(rows: list[dict[str, Any]]) -> str:
    """Per layout and tensor count: each cost at the largest world size over the smallest one without DCP's
    `.metadata` (which rank 0 builds only below its bound, a cost of its own), and what one more rank adds: flat
    is x1.0 and +0, linear in ranks is x(ratio of world sizes)."""
    lines = [
        "| layout | tensors | ranks | " + " | ".join(name for name, _ in GROWTH) + " |",
        "|" + "---|" * (3 + len(GROWTH)),
    ]
    by_config: dict[tuple[str, int, bool], list[dict[str, Any]]] = {}
    for row in rows:
        if not row["dcp_metadata_bytes"]:
            by_config.setdefault((row["layout"], row["tensors"], row.get("signed", False)), []).append(row)
    for (kind, tensors, signed), group in by_config.items():
        if len(group) < 2:
            continue
        low, high = min(group, key=lambda r: r["ranks"]), max(group, key=lambda r: r["ranks"])
        added = high["ranks"] - low["ranks"]
        cells = []
        for _, key in GROWTH:
            ratio = f"x{high[key] / low[key]:.1f}" if low[key] else "from 0"  # v5's leaders: none at one group
            per_rank = (high[key] - low[key]) / added
            unit = " B" if key.endswith("bytes") else (" µs" if key.endswith("_s") else " KB")
            scale = 1e6 if key.endswith("_s") else (1e3 if key.endswith("_mb") else 1)
            cells.append(f"{ratio} ({per_rank * scale:+.1f}{unit}/rank)")
        label = f"{kind} signed" if signed else kind
        lines.append(f"| {label} | {tensors:,} | {low['ranks']:,} → {high['ranks']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _req(counts: dict[str, int]) -> str:
    return " ".join(f"{k} {v}" for k, v in sorted(counts.items()) if v) or "-"


def _throwaway_key() -> str:
    """A PEM Ed25519 private key file for --sign, in a temporary directory (the benchmark's only)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    path = os.path.join(tempfile.mkdtemp(prefix="scale-sign-"), "bench.pem")
    key = ed25519.Ed25519PrivateKey.generate()
    with open(path, "wb") as handle:
        handle.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return path


# issue 46's features, as (signed, incremental, ranks per node for a node-local save with peers), alone, in pairs and
# all three together (an incremental node-local checkpoint's peer copies carry the files it references:
# engine/tiers/referenced_files.py)
MATRIX: dict[str, tuple[bool, bool, int | None]] = {
    "plain": (False, False, None),
    "signed": (True, False, None),
    "incremental": (False, True, None),
    "node-local + peers": (False, False, 8),
    "signed + incremental": (True, True, None),
    "signed + node-local": (True, False, 8),
    "incremental + node-local": (False, True, 8),
    "signed + incremental + node-local": (True, True, 8),
}
# issue 46's "done when", per configuration: (label, the row's value, the bound)
BOUNDS: list[tuple[str, Any, float]] = [
    ("manifest KB", lambda r: r["manifest_bytes"] / 1e3, 256),
    ("rank 0 commit s", lambda r: r["rank0_commit_s"], 0.1),
    ("rank 0 MB", lambda r: r["rank0_commit_peak_mb"], 32),
    ("slowest leader s", lambda r: r["leader_s"], 0.05),
    ("messages to one rank", lambda r: max(r["rank0_hears"], r["leader_hears"]), 512),
    ("resume plan s", lambda r: r["resume_plan_s"], 0.1),
    ("resume plan MB", lambda r: r["resume_plan_peak_mb"], 16),
    ("metadata read MB", lambda r: r["resume_read_bytes"] / 1e6, 1),
    ("requests of a rank to one file", lambda r: max(r["resume_fanout"]["now"]["most_requests_per_rank"].values()), 2),
    ("files read by every rank", lambda r: r["resume_fanout"]["now"]["read_by_every_rank"], 0),
    ("empty records", lambda r: r["empty_records"], 0),
]


def _matrix(args: argparse.Namespace) -> int:
    key = _throwaway_key()
    rows = _rows(args, [(f, key if signed else None, inc, per_node) for f, (signed, inc, per_node) in MATRIX.items()])
    print()
    print(matrix_table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


def _rows(args: argparse.Namespace, features: list[tuple[str, str | None, bool, int | None]]) -> list[dict[str, Any]]:
    """One row per layout, tensor count, world size and feature (name, signing key or None, incremental, ranks
    per node or None), each printed as a JSON line as it is measured."""
    rows = []
    for kind in args.layouts:
        for tensors in args.tensors:
            for world in args.ranks:
                group_size = (args.group_size or groups.writer_group_size(world)) if args.format_version == 5 else None
                for feature, key, incremental, per_node in features:
                    row = run(
                        kind, world, tensors, args.dcp_metadata_max_chunks, group_size, key, incremental, per_node
                    )
                    row["feature"] = feature
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def matrix_table(rows: list[dict[str, Any]]) -> str:
    """One line per configuration: each bound's value, starred where it is over the bound; and the bytes a signed
    resume reads against the same configuration unsigned, metadata alone and with the tensor bytes."""
    unsigned = {
        (r["layout"], r["ranks"], r["tensors"], r["incremental"], "node" in r["feature"]): r
        for r in rows
        if not r["signed"]
    }
    head = ["layout", "ranks", "feature", *(label for label, _, _ in BOUNDS), "signed / unsigned read (metadata; all)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["layout"], f"{r['ranks']:,}", r["feature"]]
        for _, value, bound in BOUNDS:
            v = value(r)
            cells.append(f"{v:.3g}" + (" **over**" if v > bound else ""))
        base = unsigned.get((r["layout"], r["ranks"], r["tensors"], r["incremental"], "node" in r["feature"]))
        if r["signed"] and base is not None:
            meta = r["resume_read_bytes"] / base["resume_read_bytes"]
            total = (r["resume_read_bytes"] + r["resume_tensor_bytes"]) / (
                base["resume_read_bytes"] + base["resume_tensor_bytes"]
            )
            cells.append(f"{meta:.2f}x; {total:.3f}x")
        else:
            cells.append("")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 2048, 16384])
    parser.add_argument("--tensors", type=int, nargs="+", default=[300, 1000])
    parser.add_argument("--layouts", nargs="+", default=["fsdp", "ddp", "2d"], choices=["fsdp", "ddp", "2d"])
    parser.add_argument("--dcp-metadata-max-chunks", type=int, default=DEFAULT_THRESHOLD)
    parser.add_argument("--format-version", type=int, choices=[4, 5], default=5, help="5: group tables (§10.5)")
    parser.add_argument(
        "--group-size", type=int, default=None, help="format 5's ranks per group (default: the writer's for each world)"
    )
    parser.add_argument(
        "--node-local",
        type=int,
        default=None,
        metavar="RANKS_PER_NODE",
        help="node-local saves (each node its own root): also count the table copies a leader sends to the other "
        "nodes its group spans",
    )
    parser.add_argument("--listing", type=int, default=2000, help="checkpoints for ls/timeline (0: skip)")
    parser.add_argument(
        "--sign",
        action="store_true",
        help="signed checkpoints (FORMAT.md §12.2): each configuration also signed, with a throwaway Ed25519 key",
    )
    parser.add_argument(
        "--no-save-requests", action="store_true", help="skip one rank's save counted on S3 (moto; about a minute)"
    )
    parser.add_argument(
        "--incremental",
        action="store_true",
        help="incremental saves (FORMAT.md §10.6): each save references every tensor chunk of the full one before it",
    )
    parser.add_argument(
        "--matrix",
        action="store_true",
        help="issue 46's feature matrix: each of " + ", ".join(MATRIX) + " (8 ranks a node) per layout and world "
        "size, and a table of each against the issue's bounds (--sign, --incremental and --node-local are ignored)",
    )
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.matrix:
        return _matrix(args)
    keys = [None, _throwaway_key()] if args.sign else [None]
    rows = _rows(args, [("signed" if key else "plain", key, args.incremental, args.node_local) for key in keys])
    print()
    print(table(rows))
    print()
    print(growth_table(rows))
    print()
    print(fanout_table(rows))
    result: dict[str, Any] = {"rows": rows}
    saving = {}
    for label, mode, big in (
        ()
        if args.no_save_requests
        else (("sample", "sample", 0), ("full", "full", 0), ("off", "off", 0), ("sample-multipart", "sample", 120))
    ):
        saving[label] = rank_save_requests(max(args.tensors), mode, big)
        shard = f"{max(args.tensors):,} tensors" + (f" and one of {big} MiB (a multipart upload)" if big else "")
        print(
            f"requests of one rank's share of a save on S3 (moto, counted on the wire; {shard}, verify.mode={mode}): "
            f"{_req({k: v for k, v in saving[label].items() if k.isupper()})}; the shard's upload "
            f"{saving[label].get('upload', 0)}, beyond it {saving[label].get('beyond_upload', 0)}"
        )
    result["rank_save_requests"] = saving
    if args.listing:
        lst = listing(
            "fsdp",
            max(args.ranks),
            max(args.tensors),
            args.listing,
            (args.group_size or groups.writer_group_size(max(args.ranks))) if args.format_version == 5 else None,
        )
        print(json.dumps(lst), flush=True)
        print(
            f"\nls / timeline / latest over {lst['checkpoints']:,} checkpoints of {lst['ranks']:,} ranks x "
            f"{lst['tensors']:,} tensors (manifest {_size(lst['manifest_bytes'])}), 3 runs (min, median, max): "
            f"ls {lst['ls_s']} s, timeline {lst['timeline_s']} s, latest {lst['latest_s']} s"
        )
        result["listing"] = lst
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
