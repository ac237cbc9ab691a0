"""Read one global tensor of a committed checkpoint at a time, assembled from its chunks, every byte checked.

What bisect, compare and export share. A global tensor is rebuilt from the manifest (format v4: and the
parts of the ranks that wrote it, read when first needed): each chunk names its file, byte range, checksum
and place (`offsets`, `sizes`) in the global tensor, so the checkpoint's world size does not matter and
`.metadata` is never unpickled. Each chunk's bytes are checked against the recorded checksum
(chunk_reads.check_chunk, the check every reader makes) before they are decoded.

Memory: the returned tensor plus one reused read buffer the size of the largest chunk read so far.
Callers that walk a checkpoint drop each tensor before reading the next.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CorruptCheckpoint
from ..catalog import CheckpointEntry
from ..format import chunk_layout, safe_pickle
from ..format.checksum import ChunkCheck
from ..format.chunk_index import ChunkIndex
from ..format.names import join, shard_filename
from ..format.parts_manifest import LAYOUT_FIELD
from ..storage.chunk_reads import check_chunk, decode_tensor_record, read_at
from ..storage.fsio import Location

log = logging.getLogger(__name__)

DTYPE_PREFIX = "torch."  # the manifest writes str(torch.float32) = "torch.float32"


@dataclass(frozen=True)
class TensorSpec:
    """A global tensor as the manifest lists it."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[dict[str, Any], ...]  # format v1-v3; v4 lists them in its parts (GlobalTensorReader reads them)
    finite: bool | None = None  # the writer's flag (format v2): no chunk held NaN/Inf when written
    layout: chunk_layout.Layout | None = None  # format v4

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def chunk_count(self) -> int:
        return len(self.chunks) if self.layout is None else chunk_layout.chunk_count(self.layout)

    @property
    def files(self) -> list[str]:
        if self.layout is not None:  # v4: the shard files of the ranks its layout names, no part read
            return sorted({shard_filename(cell.rank) for cell in chunk_layout.stored_cells(self.layout, self.shape)})
        return sorted({chunk["file"] for chunk in self.chunks})


def dtype_of(name: str) -> torch.dtype:
    """`"torch.float32"` -> torch.float32; anything else is a damaged manifest."""
    dtype = getattr(torch, name[len(DTYPE_PREFIX) :], None) if name.startswith(DTYPE_PREFIX) else None
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpoint(
            f"the manifest names dtype {name!r}, which is not a torch dtype; the manifest is damaged"
        )
    return dtype


def tensor_specs(manifest: dict[str, Any]) -> dict[str, TensorSpec]:
    """Every tensor of a manifest by fqn, in the manifest's (sorted) order."""
    return {
        item["fqn"]: TensorSpec(
            item["fqn"],
            tuple(item["shape"]),
            dtype_of(item["dtype"]),
            tuple(item.get("chunks") or ()),
            item.get("finite"),
            chunk_layout.from_json(item[LAYOUT_FIELD]) if LAYOUT_FIELD in item else None,
        )
        for item in manifest["tensors"]
    }


class GlobalTensorReader:
    """Reads global tensors of one committed checkpoint; a context manager that keeps its files open.

    `bytes_read` counts every byte read and checked.
    """

    def __init__(self, location: Location, entry: CheckpointEntry) -> None:
        if not entry.committed:
            raise CorruptCheckpoint(
                f"{entry.path} is {entry.state}, not committed; only committed checkpoints are read"
            )
        self.location = location
        self.entry = entry
        self.manifest = entry.committed_manifest
        self.specs = tensor_specs(self.manifest)
        self._chunks = ChunkIndex(location.fs, entry.path, self.manifest)
        self.bytes_read = 0
        self._handles: dict[str, Any] = {}
        self._sizes: dict[str, int] = {}  # each open file's size in storage
        self._buffer = bytearray()  # reused for every chunk: reads land in memory that was used before

    def __enter__(self) -> GlobalTensorReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.close()

    @property
    def path(self) -> str:
        return self.entry.path

    def read(self, fqn: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The global tensor `fqn`, checked chunk by chunk; into `out` (same shape and dtype) when given."""
        spec = self.specs.get(fqn)
        if spec is None:
            raise KeyError(f"{self.entry.path} has no tensor {fqn!r}")
        if out is None:
            out = torch.empty(spec.shape, dtype=spec.dtype)
        elif tuple(out.shape) != spec.shape or out.dtype != spec.dtype:
            raise ValueError(
                f"{fqn}: out is {tuple(out.shape)} {out.dtype}, the checkpoint holds {spec.shape} {spec.dtype}"
            )
        # in file and byte order: a sequential read of each file
        chunks = spec.chunks if spec.layout is None else self._chunks.tensor_chunks(fqn)
        for chunk in sorted(chunks, key=lambda c: (c["file"], c["offset"])):
            data = self._read_chunk(chunk, fqn)
            piece = decode_tensor_record(data, tuple(chunk["sizes"]), spec.dtype)
            target = out
            for dim, (start, size) in enumerate(zip(chunk["offsets"], chunk["sizes"])):
                target = target.narrow(dim, start, size)
            if tuple(piece.shape) != tuple(target.shape):
                raise CorruptCheckpoint(
                    f"{join(self.entry.path, chunk['file'])}: a chunk of {fqn!r} holds shape {tuple(piece.shape)}, "
                    f"the manifest says {tuple(target.shape)}; the checkpoint is damaged"
                )
            target.copy_(piece)  # before the buffer is reused for the next chunk
        return out

    def iter_tensors(self, fqns: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(fqn, tensor) one at a time; the caller drops each before asking for the next."""
        for fqn in self.specs if fqns is None else fqns:
            yield fqn, self.read(fqn)

    def _read_chunk(self, chunk: dict[str, Any], fqn: str) -> memoryview:
        length = chunk["length"]
        handle = self._handle(chunk["file"], fqn)
        # no more than the file holds past the offset: a manifest may claim a 3 GiB chunk of an 8 KB file, and
        # the buffer would be zero-filled before the short read is found (check_chunk names it)
        wanted = max(0, min(length, self._sizes[chunk["file"]] - chunk["offset"]))
        if len(self._buffer) < wanted:
            self._buffer = bytearray(wanted)
        data = read_at(handle, chunk["offset"], memoryview(self._buffer)[:wanted])
        self.bytes_read += len(data)
        check_chunk(self.entry.path, chunk["file"], length, data, ChunkCheck.of_record(chunk), fqn)
        return data

    def _handle(self, relative: str, fqn: str) -> Any:
        handle = self._handles.get(relative)
        if handle is None:
            safe_pickle.check_inside(self.location.fs, self.entry.path, relative)  # a name leading out is never opened
            path = join(self.entry.path, relative)
            try:
                handle = self.location.fs.open(path, "rb")
            except FileNotFoundError as err:
                raise CorruptCheckpoint(
                    f"{path} is missing: the manifest lists it (tensor {fqn!r} lives there). Restore it from a replica "
                    "or use an older checkpoint; `shardckpt verify` lists every loss",
                    problems=[{"file": relative, "tensor": fqn, "expected": "present", "actual": "missing"}],
                ) from err
            self._handles[relative] = handle
            size = getattr(handle, "size", None)  # fsspec's files know it from opening; else one stat
            self._sizes[relative] = int(size if isinstance(size, int) else self.location.fs.size(path))
        return handle
