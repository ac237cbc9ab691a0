"""Streaming writers for `shardckpt export`: a torch.save zip and safetensors, one tensor at a time.

Both formats put a table of every tensor (name, dtype, shape, where its bytes go) before the bytes, and
the manifest knows that table before a single byte is read. So each writer takes the plan first, then
receives tensors in plan order and writes each one straight to the file: memory holds one tensor.

- torch: exactly the zip archive `torch.save(dict_of_tensors)` writes (data.pkl, .format_version,
  .storage_alignment, byteorder, then one `data/<key>` record per storage), through torch's own zip
  writer. The pickle is made from placeholders that reduce to the same `_rebuild_tensor_v2` calls a
  real tensor does, so `torch.load(weights_only=True)` reads it like any torch.save file.
- safetensors: the spec (github.com/huggingface/safetensors): an 8-byte little-endian header length,
  a JSON header (padded with spaces to 8 bytes) of `{name: {dtype, shape, data_offsets}}`, then the
  bytes in header order without holes. Shards (`max_shard_size`) follow Hugging Face's layout:
  `model-00001-of-00003.safetensors` and a `model.safetensors.index.json` weight map.
"""

from __future__ import annotations

import collections
import io
import json
import math
import pickle
import struct
import sys
from dataclasses import dataclass
from typing import Any, SupportsIndex

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"
SAFETENSORS_SHARD = "model-{index:05d}-of-{count:05d}" + SAFETENSORS_SUFFIX
SAFETENSORS_ALIGN = 8  # the header is padded so the data starts 8-byte aligned
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
ZIP_ARCHIVE_VERSION = "1"  # torch.save's `.format_version` record
COMPUTE_CRC32 = True  # an export leaves our format: its zip must pass `unzip -t` (our shards skip the CRC)


@dataclass(frozen=True)
class Planned:
    """One tensor as it will be written: its output name, shape and dtype (after any cast)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in memory order, without a copy when it is contiguous (any dtype, bf16 too)."""
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")  # .data: the array's memoryview


# --- torch.save zip ---


class _StorageStub:
    """Stands for a storage while pickling: persistent_id turns it into torch's storage reference."""

    def __init__(self, key: str, planned: Planned) -> None:
        self.key, self.planned = key, planned


class _TensorStub:
    """Pickles as the call torch.save records for a contiguous CPU tensor of `planned`'s shape and dtype."""

    def __init__(self, storage: _StorageStub) -> None:
        self.storage = storage

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        shape = self.storage.planned.shape
        stride: list[int] = []
        step = 1
        for size in reversed(shape):
            stride.insert(0, step)
            step *= max(size, 1)
        return torch._utils._rebuild_tensor_v2, (
            self.storage,
            0,
            torch.Size(shape),
            tuple(stride),
            False,
            collections.OrderedDict(),
        )


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageStub):
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.planned.dtype])
            numel = math.prod(obj.planned.shape)
            return ("storage", storage_type, obj.key, "cpu", numel)
        return None


class TorchZipWriter:
    """Writes `{key: tensor}` as torch.save would, one tensor record at a time."""

    def __init__(self, handle: Any, plan: list[Planned]) -> None:
        self._plan = {planned.key: (str(index), planned) for index, planned in enumerate(plan)}
        self._writer = torch._C.PyTorchFileWriter(handle, COMPUTE_CRC32, torch.serialization._get_storage_alignment())
        self._finished = False
        state = {planned.key: _TensorStub(_StorageStub(str(index), planned)) for index, planned in enumerate(plan)}
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=torch.serialization.DEFAULT_PROTOCOL).dump(state)
        data = buffer.getvalue()
        self._writer.write_record("data.pkl", data, len(data))
        # the same bytes torch.save writes (it passes these as str, which its own stub does not allow)
        version = ZIP_ARCHIVE_VERSION.encode()
        self._writer.write_record(".format_version", version, len(version))
        alignment = str(torch.serialization._get_storage_alignment()).encode()
        self._writer.write_record(".storage_alignment", alignment, len(alignment))
        byteorder = sys.byteorder.encode()
        self._writer.write_record("byteorder", byteorder, len(byteorder))

    def write(self, key: str, tensor: torch.Tensor) -> None:
        storage_key, planned = self._plan[key]
        storage = tensor.contiguous().untyped_storage()
        # torch's stub says Storage; torch.save itself passes an UntypedStorage, which the writer takes
        self._writer.write_record(f"data/{storage_key}", storage, planned.nbytes)  # type: ignore[arg-type]

    def finish(self) -> None:
        self._writer.write_end_of_file()
        self._finished = True

    def discard(self) -> None:
        # an unfinished torch writer throws from its destructor (FINDINGS.md): finish it, whatever it writes
        if not self._finished:
            try:
                self._writer.write_end_of_file()
            except RuntimeError:
                pass
            self._finished = True


# --- safetensors ---


def safetensors_header(plan: list[Planned], metadata: dict[str, str] | None = None) -> bytes:
    """The length-prefixed, padded JSON header of one safetensors file holding `plan` in order."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for planned in plan:
        if planned.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(
                f"{planned.key}: safetensors has no dtype for {planned.dtype}; export it with --format torch"
            )
        header[planned.key] = {
            "dtype": SAFETENSORS_DTYPES[planned.dtype],
            "shape": list(planned.shape),
            "data_offsets": [offset, offset + planned.nbytes],
        }
        offset += planned.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % SAFETENSORS_ALIGN)
    return struct.pack("<Q", len(text)) + text


def shard_plan(plan: list[Planned], max_shard_size: int | None) -> list[list[Planned]]:
    """Tensors in order, split greedily so no shard passes `max_shard_size` bytes (a larger tensor gets its own)."""
    if not max_shard_size:
        return [plan]
    shards: list[list[Planned]] = [[]]
    size = 0
    for planned in plan:
        if shards[-1] and size + planned.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(planned)
        size += planned.nbytes
    return shards


def safetensors_index(shards: list[list[Planned]], names: list[str]) -> bytes:
    weight_map = {planned.key: name for shard, name in zip(shards, names) for planned in shard}
    total = sum(planned.nbytes for shard in shards for planned in shard)
    return (
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"
    ).encode()


def shard_names(count: int) -> list[str]:
    return [SAFETENSORS_SHARD.format(index=index + 1, count=count) for index in range(count)]
