"""DCP StorageReader over fsspec: concurrent range reads per rank, every chunk checksummed as it streams.

A rank's load plan names read items; several items can come from one stored chunk (a rank holding two
shards of one saved tensor). The reader groups items by chunk and reads each chunk once, as a checksum
covers a whole chunk and nothing less can be checked. Chunks are read by a bounded pool of threads,
piece by piece, each piece hashed while it is still in cache; the calling thread places tensors from
finished chunks while later chunks are read, so reading overlaps placing. Bytes in flight are bounded:
a chunk is fetched only while the chunks read but not yet placed fit in `read_ahead_bytes` (one chunk
always fits, however large). Local files are read with `preadv` straight into reused buffers; any
other fsspec filesystem (S3 and friends) with one range request per piece, so an object store sees
several range GETs in flight.
"""

from __future__ import annotations

import io
import logging
import math
import os
import time
import uuid
from collections import deque
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import CorruptCheckpoint
from . import fsio, safe_pickle
from .checksum import streaming_checksum
from .config import DEFAULT_READ_AHEAD_BYTES, DEFAULT_READ_THREADS
from .layout import DCP_METADATA, join

log = logging.getLogger(__name__)

PIECE_BYTES = 8 * 2**20  # one range request; hashed right after it lands, while it is still in cache
THREAD_NAME_PREFIX = "shardckpt-read"
SHORT_READ = "<{filled} of {length} bytes>"  # the "actual checksum" of a chunk storage cut short


@dataclass
class _Chunk:
    """One stored chunk and every read item of this rank that it feeds."""

    relative_path: str
    offset: int
    length: int
    fqn: str
    requests: list[ReadItem] = field(default_factory=list)


@dataclass(frozen=True)
class _Fetched:
    filled: int  # bytes storage returned (fewer than the chunk's length: the file was cut short)
    digest: str | None  # None when checksums are off
    finished: float  # perf_counter when the last byte landed


class _ShardFile:
    """One shard file, open for concurrent range reads from the pool's threads."""

    def __init__(self, fs: Any, path: str) -> None:
        self.path = path
        self._fs = fs
        self._fd: int | None = None
        if _reads_with_preadv(fs):
            self._fd = os.open(path, os.O_RDONLY)
            self.size = os.fstat(self._fd).st_size
        else:
            self.size = int(fs.size(path))

    def read_into(self, offset: int, view: memoryview) -> int:
        """Fill `view` from `offset`; return the bytes filled (fewer only past the end of the file)."""
        wanted = max(0, min(len(view), self.size - offset))
        if wanted == 0:
            return 0
        if self._fd is not None:
            filled = 0
            while filled < wanted:
                count = os.preadv(self._fd, [view[filled:wanted]], offset + filled)
                if not count:
                    break
                filled += count
            return filled
        data = fsio.read_range(self._fs, self.path, offset, wanted)
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _reads_with_preadv(fs: Any) -> bool:
    # only the plain local filesystem: a subclass (a test's counting or quota filesystem, a wrapper) may
    # change how bytes are read, so it is read through fsspec like any remote store
    return type(fs) is LocalFileSystem and hasattr(os, "preadv")


class _BufferPool:
    """Chunk buffers reused across chunks: a read lands in memory that was used before (first touch is slow)."""

    def __init__(self, keep_bytes: int) -> None:
        self._free: list[bytearray] = []
        self._keep_bytes = keep_bytes

    def take(self, length: int) -> bytearray:
        fitting = [buffer for buffer in self._free if len(buffer) >= length]
        if fitting:
            buffer = min(fitting, key=len)
            self._free.remove(buffer)
            return buffer
        return bytearray(length)

    def give(self, buffer: bytearray) -> None:
        self._free.append(buffer)
        self._free.sort(key=len, reverse=True)
        while len(self._free) > 1 and sum(map(len, self._free)) > self._keep_bytes:
            self._free.pop()  # the smallest: keep what the large chunks need


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview: lets torch's zip reader find a record without a copy."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._position = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._view)}[whence]
        self._position = base + offset
        return self._position

    def readinto(self, target: Any) -> int:
        count = max(0, min(len(target), len(self._view) - self._position))
        target[:count] = self._view[self._position : self._position + count]
        self._position += count
        return count


class ShardReader(StorageReader):
    """A DCP StorageReader over fsspec that checks every chunk it reads against the manifest."""

    def __init__(
        self,
        fs: Any,
        path: str,
        *,
        expected_checksums: dict[tuple[str, int], tuple[str, str]] | None,
        expected_metadata: dict[str, Any] | None = None,
        trust: bool = False,
        read_threads: int = DEFAULT_READ_THREADS,
        read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
    ) -> None:
        """`expected_checksums` maps (file, offset) to (checksum, fqn); None turns checking off.

        `expected_metadata` is the manifest's `dcp_metadata` record (v2; None for v1): `.metadata`'s bytes
        are checked against it before they are unpickled. `trust=False` unpickles `.metadata` and every
        object only through allow-lists (safe_pickle.py); True is the user's opt-in for a trusted source.
        `read_threads` range reads run at once; chunks read but not yet placed hold at most
        `read_ahead_bytes` (or one chunk, when a chunk is larger).
        """
        super().__init__()
        self.fs = fs
        self.path = path
        self._expected = expected_checksums
        self._expected_metadata = expected_metadata
        self._trust = trust
        self._threads = read_threads
        self._read_ahead_bytes = read_ahead_bytes
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self.load_id = uuid.uuid4().hex
        self.bytes_read = 0
        self.chunks_read = 0
        # time-to-resume split for drills and metrics: .metadata (read, check, unpickle); shard bytes (wall
        # time from the first range read to the last chunk read and checksummed, placing overlapped); and
        # the calling thread's time placing tensors. The rest of a load is DCP's planning.
        self.metadata_s = 0.0
        self.read_s = 0.0
        self.place_s = 0.0
        self._chunk_layout: dict[MetadataIndex, tuple[tuple[int, ...], torch.dtype]] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = str(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        started = time.perf_counter()
        with self.fs.open(join(self.path, DCP_METADATA), "rb") as handle:
            data = handle.read()
        # checked, then unpickled through an allow-list: a crafted .metadata must not run code here
        metadata = safe_pickle.load_dcp_metadata(data, self.path, expected=self._expected_metadata, trust=self._trust)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self.metadata_s += time.perf_counter() - started
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self._chunk_layout = {
            MetadataIndex(fqn, chunk.offsets): (tuple(chunk.sizes), item.properties.dtype)
            for fqn, item in metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)
            for chunk in item.chunks
        }

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        chunks = self._chunks_of(plan)
        files: dict[str, _ShardFile] = {}
        pool = _BufferPool(self._read_ahead_bytes)
        executor = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix=THREAD_NAME_PREFIX)
        pending: deque[tuple[_Chunk, bytearray, ThreadFuture[_Fetched]]] = deque()
        in_flight = 0  # bytes of the chunks in `pending`: fetched or being fetched, not yet placed
        started = time.perf_counter()
        last_byte = started
        try:
            for chunk in chunks:
                # place finished chunks first when the next one would not fit the read-ahead budget
                while pending and (in_flight + chunk.length > self._read_ahead_bytes or len(pending) >= 2 * self._threads):
                    in_flight, last_byte = self._place_oldest(pending, planner, pool, in_flight, last_byte)
                if chunk.relative_path not in files:
                    files[chunk.relative_path] = self._open_shard(chunk.relative_path, chunks)
                buffer = pool.take(chunk.length)
                pending.append((chunk, buffer, executor.submit(self._fetch, files[chunk.relative_path], chunk, buffer)))
                in_flight += chunk.length
            while pending:
                in_flight, last_byte = self._place_oldest(pending, planner, pool, in_flight, last_byte)
        finally:
            executor.shutdown(wait=True, cancel_futures=True)  # a failed chunk: stop reading the rest
            for shard in files.values():
                shard.close()
        self.read_s += last_byte - started
        log.debug("read %d chunk(s), %d bytes for %d read item(s) in %.3fs", len(chunks), self.bytes_read, len(plan.items), self.read_s)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    # --- our part ---
    def _chunks_of(self, plan: LoadPlan) -> list[_Chunk]:
        """The plan's read items grouped by the stored chunk they come from, in file and offset order."""
        chunks: dict[tuple[str, int], _Chunk] = {}
        for request in plan.items:
            info = self.storage_data[request.storage_index]
            key = (info.relative_path, info.offset)
            if key not in chunks:
                chunks[key] = _Chunk(info.relative_path, info.offset, info.length, request.storage_index.fqn)
            chunks[key].requests.append(request)
        return [chunks[key] for key in sorted(chunks)]

    def _fetch(self, shard: _ShardFile, chunk: _Chunk, buffer: bytearray) -> _Fetched:
        """On a pool thread: read one chunk piece by piece into `buffer`, hashing each piece as it lands."""
        view = memoryview(buffer)[: chunk.length]
        hasher = streaming_checksum() if self._expected is not None else None
        filled = 0
        while filled < chunk.length:
            piece = view[filled : min(chunk.length, filled + PIECE_BYTES)]
            count = shard.read_into(chunk.offset + filled, piece)
            if hasher is not None:
                hasher.update(piece[:count])
            filled += count
            if count < len(piece):
                break  # the file ends early: the check names the chunk
        return _Fetched(filled, hasher.hexdigest() if hasher is not None else None, time.perf_counter())

    def _place_oldest(
        self, pending: deque, planner: LoadPlanner, pool: _BufferPool, in_flight: int, last_byte: float
    ) -> tuple[int, float]:
        """Wait for the oldest chunk, check it, hand its items to the planner; return the new in-flight bytes."""
        chunk, buffer, future = pending.popleft()
        fetched = future.result()
        started = time.perf_counter()
        data = memoryview(buffer)[: fetched.filled]
        self._check(chunk, fetched)
        self.bytes_read += fetched.filled
        self.chunks_read += 1
        for request in chunk.requests:
            self._place(chunk, request, data, planner)
        pool.give(buffer)
        self.place_s += time.perf_counter() - started
        return in_flight - chunk.length, max(last_byte, fetched.finished)

    def _place(self, chunk: _Chunk, request: ReadItem, data: memoryview, planner: LoadPlanner) -> None:
        if request.type == LoadItemType.BYTE_IO:
            # DCP's planner unpickles objects with weights_only=False: check them first
            safe_pickle.load_object_record(data, request.storage_index.fqn, self.path, trust=self._trust)
            planner.load_bytes(request, io.BytesIO(bytes(data)))
            return
        tensor = self._tensor(data, request.storage_index)
        tensor = narrow_tensor_by_index(tensor, request.storage_offsets, request.lengths)
        target = planner.resolve_tensor(request).detach()
        if target.size() != tensor.size():
            raise CorruptCheckpoint(
                f"{chunk.relative_path}: chunk of {request.storage_index.fqn!r} has shape {tuple(tensor.size())}, "
                f"the load plan expects {tuple(target.size())}"
            )
        target.copy_(tensor)  # before the buffer is reused for another chunk
        planner.commit_tensor(request, target)

    def _tensor(self, data: memoryview, index: MetadataIndex) -> torch.Tensor:
        """The chunk's tensor as a view of `data` (no copy) when its record is what our writer makes."""
        layout = self._chunk_layout.get(index)
        if layout is not None:
            sizes, dtype = layout
            nbytes = math.prod(sizes) * torch.empty((), dtype=dtype).element_size()
            try:
                record = torch._C.PyTorchFileReader(_MemoryFile(data))
                if record.get_all_records().count("data/0") == 1 and record.get_record_size("data/0") == nbytes:
                    offset = record.get_record_offset("data/0")
                    return torch.frombuffer(data, dtype=dtype, count=math.prod(sizes), offset=offset).view(sizes)
            except (AttributeError, RuntimeError, TypeError, ValueError):
                pass  # another record layout or torch version: the general path below
        return torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True)

    def _open_shard(self, relative_path: str, chunks: list[_Chunk]) -> _ShardFile:
        path = join(self.path, relative_path)
        safe_pickle.check_inside(self.fs, self.path, relative_path)
        try:
            return _ShardFile(self.fs, path)
        except FileNotFoundError as err:
            lost = sorted({request.storage_index.fqn for chunk in chunks if chunk.relative_path == relative_path for request in chunk.requests})
            raise CorruptCheckpoint(
                f"{path} is missing: the manifest lists it but storage has no such file ({len(lost)} tensor(s) lost, "
                f"e.g. {lost[:3]}). Restore it from a replica or load an older checkpoint; `shardckpt verify` lists every loss",
                problems=[{"file": relative_path, "tensor": fqn, "expected": "present", "actual": "missing"} for fqn in lost],
            ) from err

    def _check(self, chunk: _Chunk, fetched: _Fetched) -> None:
        if self._expected is None:
            return
        expected = self._expected.get((chunk.relative_path, chunk.offset))
        if expected is None:
            raise CorruptCheckpoint(
                f"{join(self.path, chunk.relative_path)} @ {chunk.offset}: DCP metadata names a chunk of {chunk.fqn!r} "
                "that the manifest does not list; the checkpoint's metadata was altered after commit"
            )
        short = fetched.filled != chunk.length
        actual = SHORT_READ.format(filled=fetched.filled, length=chunk.length) if short else fetched.digest
        if actual != expected[0]:
            problem = {"file": chunk.relative_path, "tensor": chunk.fqn, "expected": expected[0], "actual": actual}
            raise CorruptCheckpoint(
                f"checksum mismatch in {join(self.path, chunk.relative_path)} for {chunk.fqn!r}: expected {expected[0]}, "
                f"read {actual}. Restore this file from a replica or load an older checkpoint",
                problems=[problem],
            )

