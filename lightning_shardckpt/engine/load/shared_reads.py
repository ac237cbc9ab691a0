"""What every rank of a resume needs, read once by the coordinator and sent over the load's process group.

Every rank's target holds the non-tensor state (objects: the step, the optimizer's hyper-parameters, a loop's
progress) and small replicated tensors (a step counter, a norm's scalar), and one rank wrote each: rank 0 when
nothing is declared identical. Read by each rank, they make three hot objects of a resume (rank 0's group
table, part and shard file: one request per rank each, 8,192 at once under one prefix for a 16,384 -> 8,192
resume). Here the coordinator (rank 0 of the load's group) reads their records and their bytes once, one range
read per run of neighbouring records in a file, and broadcasts them; each rank then plans them from the records
it received (resume_plan.plan_boxes) and its reader serves their bytes from memory (storage/reader.py,
`in_memory`), checked against their checksums (and, signed, digests) exactly as bytes read from storage are.

Tensor shards (what differs per rank) are not shared: each rank reads its own, so no object is read by every
rank. A replicated tensor larger than SHARED_TENSOR_MAX_BYTES is not shared either (the broadcast would carry
its bytes through one rank's link to all the others: reading it where it is is no worse).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from ...errors import CorruptCheckpoint
from ..format import chunk_layout, part_references, parts_manifest
from ..format.chunk_index import ChunkIndex
from ..format.manifest_schema import is_reference
from ..format.names import join
from ..format.safe_pickle import check_inside
from ..storage.chunk_reads import InMemoryShard, ShardFile
from .global_tensors import dtype_of

log = logging.getLogger(__name__)

# a replicated tensor is shared when its stored bytes are at most this: scalars, norms, counters; a larger one is
# read by each rank that needs it (its bytes must reach each rank either way)
SHARED_TENSOR_MAX_BYTES = 1 * 2**20
# and the shared tensors together at most this: the broadcast is pickled whole on every rank, so a model of many
# small replicated tensors (a DDP-style state) shares its smallest ones and each rank reads the rest as before
SHARED_TENSORS_MAX_BYTES = 64 * 2**20
# neighbouring shared records of one file are read in one range request when the bytes between them are fewer
MERGE_GAP_BYTES = 1 * 2**20


@dataclass
class SharedChunks:
    """The records of the shared items (fqn -> its chunk record, with `file`), their bytes as read (file -> runs of
    (first byte, bytes)), each such file's size on storage and, from its part, its recorded size."""

    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    spans: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)
    stored_bytes: dict[str, int] = field(default_factory=dict)  # what storage held when the coordinator read it
    file_bytes: dict[str, int] = field(default_factory=dict)  # what the file's part records (signed: size check)

    def shards(self) -> dict[str, InMemoryShard]:
        """The shared bytes as the reader serves them (ShardReader's `in_memory`), by file."""
        return {file: InMemoryShard(file, self.stored_bytes[file], spans) for file, spans in self.spans.items()}


def shared_items(
    manifest: dict[str, Any], wanted: set[str], tensors_max_bytes: int = SHARED_TENSORS_MAX_BYTES
) -> list[str]:
    """Of the keys a target holds (`wanted`), those every rank reads whole from one writer: objects, and replicated
    tensors (one cell) of at most SHARED_TENSOR_MAX_BYTES each, smallest first, `tensors_max_bytes` in all. A v4/v5
    manifest (parts) only."""
    out = [item["fqn"] for item in manifest["objects"] if item["fqn"] in wanted]
    small = []
    for tensor in manifest["tensors"]:
        if tensor["fqn"] not in wanted:
            continue
        layout = chunk_layout.from_json(tensor[parts_manifest.LAYOUT_FIELD])
        if chunk_layout.chunk_count(layout) != 1:
            continue
        nbytes = math.prod(tensor["shape"]) * dtype_of(tensor["dtype"]).itemsize
        if 0 < nbytes <= SHARED_TENSOR_MAX_BYTES:
            small.append((nbytes, tensor["fqn"]))
    total = 0
    for nbytes, fqn in sorted(small):
        total += nbytes
        if total > tensors_max_bytes:
            break
        out.append(fqn)
    return out


def read_shared(index: ChunkIndex, fqns: list[str]) -> SharedChunks:
    """The coordinator's read: the records of `fqns` from their writers' parts (`index`: checked as any plan's
    reads are), then their bytes, one range read per run of records at most MERGE_GAP_BYTES apart in a file.
    The bytes are not checked here: every rank checks what it places (the coordinator too)."""
    objects = {item["fqn"] for item in index.manifest["objects"]}
    tensors = {tensor["fqn"]: tensor for tensor in index.manifest["tensors"]}
    shared = SharedChunks()
    for fqn in fqns:
        if fqn in objects:
            shared.records[fqn] = index.object_chunk(fqn)
        else:
            layout = chunk_layout.from_json(tensors[fqn][parts_manifest.LAYOUT_FIELD])
            (record,) = index.cells_chunks(fqn, list(chunk_layout.cells(layout, tensors[fqn]["shape"])))
            shared.records[fqn] = record
    by_file: dict[str, list[dict[str, Any]]] = {}
    for record in shared.records.values():
        by_file.setdefault(record["file"], []).append(record)
    held = {part["file"]: part["file_bytes"] for part in index.parts_held().values()}
    for file, records in sorted(by_file.items()):
        path = join(index.directory, file)
        check_inside(index.fs, index.directory, file)  # a name or a symlink leading out is never opened
        try:
            shard = ShardFile(index.fs, path)
        except FileNotFoundError as err:
            raise CorruptCheckpoint(
                f"{path} is missing: the manifest lists it (it holds {sorted(r['fqn'] for r in records)[:3]}). Restore "
                "it from a replica or load an older checkpoint; `shardckpt verify` lists every loss",
                problems=[
                    {"file": file, "tensor": r["fqn"], "expected": "present", "actual": "missing"} for r in records
                ],
            ) from err
        try:
            shared.stored_bytes[file] = shard.size
            shared.file_bytes[file] = _recorded_size(records[0], held)
            shared.spans[file] = [_read_run(shard, run) for run in _runs(records)]
        finally:
            shard.close()
    log.debug("read %d shared item(s) for every rank: %d run(s)", len(fqns), sum(map(len, shared.spans.values())))
    return shared


def _recorded_size(record: dict[str, Any], held: dict[str, int]) -> int:
    """The size the parts record for the file holding `record`: its own part's, or for an incremental checkpoint's
    referenced chunk (a sibling's file) the holder's size its part copied (FORMAT.md §10.6)."""
    if is_reference(record["file"]):
        return int(record[part_references.HOLDER_BYTES])
    return held[record["file"]]


def _runs(records: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(first byte, end) of the runs of `records` that are read together: neighbours at most MERGE_GAP_BYTES apart."""
    runs: list[tuple[int, int]] = []
    for record in sorted(records, key=lambda r: r["offset"]):
        start, end = record["offset"], record["offset"] + record["length"]
        if runs and start - runs[-1][1] <= MERGE_GAP_BYTES:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end))
        else:
            runs.append((start, end))
    return runs


def _read_run(shard: ShardFile, run: tuple[int, int]) -> tuple[int, bytes]:
    """The bytes of `run` that the file holds (fewer when it was cut short: the ranks' checks name the chunk)."""
    start, end = run
    buffer = bytearray(max(0, min(end, shard.size) - start))
    filled = shard.read_into(start, memoryview(buffer)) if buffer else 0
    return start, bytes(buffer[:filled])
