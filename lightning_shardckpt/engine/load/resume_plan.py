"""A rank's plan for restoring a format-v4 checkpoint: only the metadata of what this rank will own.

DCP plans a load from one global `Metadata`: every chunk of every tensor, read and unpickled whole on every
rank. A load plan only ever uses the chunks that overlap what the rank holds, so here each rank works out
those from the manifest's layouts (which cells of each tensor overlap its target shard), reads the parts of
the ranks that wrote them (one or two per tensor when the world size changed, one when it did not), and
builds a `Metadata` holding just those chunks. DCP's own planner then reshards exactly as with the whole
metadata; our reader checks every byte it reads against the checksums the parts recorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..format import chunk_layout, part_references, parts_manifest
from ..format.chunk_index import ChunkIndex
from ..format.manifest_schema import is_reference
from ..format.parts import BLOCK_DIGESTS, BLOCKS_FIELD, DIGEST
from ..gc_pause import gc_paused
from .global_tensors import dtype_of
from .shared_reads import SharedChunks


@dataclass
class ResumePlan:
    """What this rank reads, with what it will check the bytes against."""

    metadata: Metadata
    expected_checksums: dict[tuple[str, int], tuple[str, str]]
    expected_blocks: dict[tuple[str, int], tuple[int, list[str]]]
    parts_read: int = 0
    chunks: int = 0
    seconds: float = 0.0
    part_ranks: list[int] = field(default_factory=list)
    group_tables_read: int = 0  # v5: the group tables read to find those parts (FORMAT.md §10.5)
    # signed v5 under a signature policy: (file, offset) -> (the chunk's cryptographic digest, its blocks' or
    # None), from parts checked against the signed chain; None when the plan was not made under a policy
    expected_digests: dict[tuple[str, int], tuple[str, list[str] | None]] | None = None
    file_bytes: dict[str, int] = field(default_factory=dict)  # each shard file read: its size, as its part says


def plan_resume(
    fs: Any,
    directory: str,
    manifest: dict[str, Any],
    state_dict: dict[str, Any],
    signed_by: str | None = None,
    shared: SharedChunks | None = None,
    index: ChunkIndex | None = None,
) -> ResumePlan:
    """The metadata of the chunks this rank's `state_dict` (the target, as DCP flattens it) overlaps, read from
    the parts that hold them; keys the checkpoint lacks are left out (DCP then reports them, or skips them in
    a partial load). `signed_by` (a signed v5 checkpoint whose signature by that key a policy accepted): every
    group table and part read is checked against the signed chain of digests, and the plan holds each chunk's.
    `shared`: the records of the items the coordinator read for every rank (shared_reads.py), planned from them
    with no part read; `index`: the coordinator's own ChunkIndex of that read, whose parts are not read again."""
    flat, mappings = flatten_state_dict(state_dict)
    shapes = {tensor["fqn"]: tensor["shape"] for tensor in manifest["tensors"]}
    boxes = {fqn: _target_box(value, shapes[fqn]) if fqn in shapes else None for fqn, value in flat.items()}
    return plan_boxes(fs, directory, manifest, boxes, mappings, signed_by, shared, index)


Box = tuple[tuple[int, ...], tuple[int, ...]]


def plan_boxes(
    fs: Any,
    directory: str,
    manifest: dict[str, Any],
    boxes: dict[str, Box | None],
    mappings: dict[str, Any],
    signed_by: str | None = None,
    shared: SharedChunks | None = None,
    index: ChunkIndex | None = None,
) -> ResumePlan:
    """plan_resume for a target given as the box (offsets, sizes) of each tensor this rank holds (None: none of
    it; objects: any value). What a resume plans with, without a state dict (benchmarks/scale.py plans so)."""
    with gc_paused():  # parts parsed and metadata built: a burst of small objects (engine/gc_pause.py)
        return _plan_boxes(fs, directory, manifest, boxes, mappings, signed_by, shared, index)


def _plan_boxes(
    fs: Any,
    directory: str,
    manifest: dict[str, Any],
    boxes: dict[str, Box | None],
    mappings: dict[str, Any],
    signed_by: str | None,
    shared: SharedChunks | None,
    index: ChunkIndex | None,
) -> ResumePlan:
    started = time.perf_counter()
    received = shared.records if shared is not None else {}
    tensors = {tensor["fqn"]: tensor for tensor in manifest["tensors"]}
    objects = {item["fqn"]: item for item in manifest["objects"]}
    wanted_cells: dict[str, list[chunk_layout.Cell]] = {}
    wanted_objects: list[str] = []
    for fqn, box in boxes.items():
        if fqn in tensors:
            layout = chunk_layout.from_json(tensors[fqn][parts_manifest.LAYOUT_FIELD])
            shape = tensors[fqn]["shape"]
            wanted_cells[fqn] = [] if box is None else list(chunk_layout.cells_within(layout, shape, box))
        elif fqn in objects:
            wanted_objects.append(fqn)
    if index is None:
        index = ChunkIndex(fs, directory, manifest, signed_by)
    # every part this rank needs, read at once (concurrently), before any record is looked up; none for what the
    # coordinator read for every rank
    index.parts(
        {cell.rank for fqn, cells in wanted_cells.items() if fqn not in received for cell in cells}
        | {objects[f]["rank"] for f in wanted_objects if f not in received}
    )
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    checksums: dict[tuple[str, int], tuple[str, str]] = {}
    blocks: dict[tuple[str, int], tuple[int, list[str]]] = {}
    digests: dict[tuple[str, int], tuple[str, list[str] | None]] | None = {} if signed_by is not None else None
    referenced_bytes: dict[str, int] = {}  # incremental (FORMAT.md §10.6): each sibling file read, its size
    for fqn, cells in wanted_cells.items():
        tensor = tensors[fqn]
        chunks = []
        records = [received[fqn]] if fqn in received and cells else index.cells_chunks(fqn, cells)
        for number, record in enumerate(records):
            offsets = torch.Size(record["offsets"])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(record["sizes"])))
            storage[MetadataIndex(fqn, offsets, number)] = _StorageInfo(
                record["file"], record["offset"], record["length"]
            )
            checksums[(record["file"], record["offset"])] = (record["checksum"], fqn)
            if digests is not None:
                digests[(record["file"], record["offset"])] = _digests_of(record)
            if is_reference(record["file"]):  # incremental (a sibling's file): its size, as the part copied it
                referenced_bytes[record["file"]] = record[part_references.HOLDER_BYTES]
            if BLOCKS_FIELD in record:
                blocks[(record["file"], record["offset"])] = (
                    record[BLOCKS_FIELD]["size"],
                    record[BLOCKS_FIELD]["checksums"],
                )
        state[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype_of(tensor["dtype"])),
            size=torch.Size(tensor["shape"]),
            chunks=chunks,
        )
    for fqn in wanted_objects:
        record = received[fqn] if fqn in received else index.object_chunk(fqn)
        state[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = _StorageInfo(record["file"], record["offset"], record["length"])
        checksums[(record["file"], record["offset"])] = (record["checksum"], fqn)
        if digests is not None:
            digests[(record["file"], record["offset"])] = _digests_of(record)
    held = index.parts_held()
    metadata = Metadata(
        state_dict_metadata=state,
        planner_data={fqn: mappings[fqn] for fqn in state if fqn in mappings},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=directory),
    )
    return ResumePlan(
        metadata,
        checksums,
        blocks,
        parts_read=index.parts_read,
        chunks=len(storage),
        seconds=time.perf_counter() - started,
        part_ranks=sorted(held),
        group_tables_read=index.tables_read,
        expected_digests=digests,
        file_bytes={
            **(shared.file_bytes if shared is not None else {}),
            **referenced_bytes,
            **{part["file"]: part["file_bytes"] for part in held.values()},
        },
    )


def _digests_of(record: dict[str, Any]) -> tuple[str, list[str] | None]:
    """A signed v5 chunk record's (digest, block digests or None); the part was checked to digest every chunk."""
    blocks = record.get(BLOCKS_FIELD)
    return record[DIGEST], (blocks[BLOCK_DIGESTS] if isinstance(blocks, dict) else None)


def _target_box(value: Any, shape: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The part of the global tensor this rank's target holds (offsets, sizes); None when it holds none."""
    if isinstance(value, DTensor):
        if value.device_mesh.get_coordinate() is None:
            return None  # not on this tensor's mesh: DCP plans no read for it
        sizes, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return tuple(offsets), tuple(sizes)
    if isinstance(value, torch.Tensor):
        return (0,) * value.dim(), tuple(value.shape)
    return (0,) * len(shape), tuple(shape)  # not a tensor here: DCP will say so; read what it would
