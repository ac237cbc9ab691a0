"""DCP StorageReader over fsspec: concurrent range reads per rank, every chunk checksummed as it streams.

A rank's load plan names read items; several items can come from one stored chunk (a rank holding two
shards of one saved tensor, or one row-slice of a chunk saved by fewer ranks). The reader groups items
by chunk and reads each chunk once and whole, as a checksum covers a whole chunk and nothing less can be
checked. Chunks are read by a bounded pool of threads (chunk_reads.py): a tensor chunk whose items are
row ranges of contiguous targets is read straight into them; anything else (objects, column slices,
other record layouts) into a reused buffer that the loading thread copies out of. The loading thread
checks and commits finished chunks while later ones are read. Buffered bytes in flight are bounded by
`read_ahead_bytes` (one larger chunk is let through alone), reads in flight by `read_threads`.
"""

from __future__ import annotations

import io
import logging
import math
import time
import uuid
from collections import deque
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ...errors import CorruptCheckpoint, SignatureRefused
from ..config import DEFAULT_READ_AHEAD_BYTES, DEFAULT_READ_THREADS
from ..format import safe_pickle
from ..format.checksum import ChunkCheck
from ..format.names import DCP_METADATA, join
from .chunk_reads import (
    SHORT_READ,
    BufferPool,
    Destination,
    DirectReader,
    Fetched,
    InMemoryShard,
    ShardFile,
    available_bytes,
    byte_view,
    chunk_mismatch,
    decode_tensor_record,
    fetch_buffered,
)
from .coalesced_reads import CoalescedReads

log = logging.getLogger(__name__)

THREAD_NAME_PREFIX = "shardckpt-read"


@dataclass(frozen=True)
class SignedReads:
    """What a signed v5 checkpoint's parts, checked against its signature's chain (FORMAT.md §12.2), say of the
    bytes one rank reads: each chunk's cryptographic digest (and its blocks'), and each shard file's size."""

    algorithm: str  # the manifest's digest_algorithm
    key_id: str  # whose signature over the manifest was accepted: named in every refusal
    digests: dict[tuple[str, int], tuple[str, list[str] | None]]  # (file, offset) -> (digest, block digests)
    file_bytes: dict[str, int]  # file -> its size as its part records it


@dataclass
class _Chunk:
    """One stored chunk and every read item of this rank that it feeds."""

    relative_path: str
    offset: int
    length: int
    fqn: str
    requests: list[ReadItem] = field(default_factory=list)
    targets: list[torch.Tensor] | None = None  # a direct read: each request's resolved target, in order
    buffer: bytearray | None = None  # a buffered read: where the chunk lands


class ShardReader(StorageReader):
    """A DCP StorageReader over fsspec that checks every chunk it reads against the manifest."""

    def __init__(
        self,
        fs: Any,
        path: str,
        *,
        expected_checksums: dict[tuple[str, int], tuple[str, str]] | None,
        expected_metadata: dict[str, Any] | None = None,
        expected_blocks: dict[tuple[str, int], tuple[int, list[str]]] | None = None,
        trust: bool = False,
        read_threads: int = DEFAULT_READ_THREADS,
        read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
        metadata: Metadata | None = None,
        signed: SignedReads | None = None,
        in_memory: dict[str, InMemoryShard] | None = None,
    ) -> None:
        """`expected_checksums` maps (file, offset) to (checksum, fqn); None turns checking off.

        `signed` (a signed v5 checkpoint under a signature policy): each chunk read is hashed with its digest in
        the same pass as its xxh3 (a chunk read by block: each block read) and checked first, and each shard file
        opened must hold the bytes its part records (appended or cut bytes, which no chunk covers, are refused
        too: its size is known from opening it, no request more); SignatureRefused names the file and the key.
        Needs `expected_checksums`.

        `in_memory` (file -> its bytes another rank read and sent: engine/load/shared_reads.py): chunks those hold
        are served from them, with no request to storage, and checked exactly as chunks read from storage.

        `metadata`: the metadata to plan with, already built (format v4: the rank's own share, from the parts it
        needs, engine/load/resume_plan.py); None reads and checks `.metadata` (format v1-v3).

        `expected_metadata` is the manifest's `dcp_metadata` record (v2; None for v1): `.metadata`'s bytes
        are checked against it before they are unpickled. `expected_blocks` maps (file, offset) to (block
        size, block checksums) of the chunks checksummed by block too: a rank that needs only some rows of
        such a chunk reads and checks only the blocks holding them (and the record's headers). `trust=False` unpickles `.metadata` and every
        object only through allow-lists (safe_pickle.py); True is the user's opt-in for a trusted source.
        `read_threads` range reads run at once; chunks read but not yet placed hold at most
        `read_ahead_bytes` (or one chunk, when a chunk is larger).
        """
        super().__init__()
        self.fs = fs
        self.path = path
        self._expected = expected_checksums
        self._expected_metadata = expected_metadata
        self._expected_blocks = (expected_blocks or {}) if expected_checksums is not None else {}
        self._signed = signed
        if signed is not None and expected_checksums is None:
            raise ValueError("a signed read needs expected_checksums: it hashes what it checks")
        self._trust = trust
        self._threads = read_threads
        self._read_ahead_bytes = read_ahead_bytes
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self.load_id = uuid.uuid4().hex
        self.bytes_read = 0
        self.chunks_read = 0
        self.chunks_reread = 0  # direct reads that found another record layout and were read again buffered
        # time-to-resume split for drills and metrics: .metadata (read, check, unpickle); shard bytes (wall
        # time from the first range read to the last chunk read and checksummed, placing overlapped); and
        # the calling thread's time placing tensors. The rest of a load is DCP's planning.
        self.metadata_s = 0.0
        self.read_s = 0.0
        self.place_s = 0.0
        self._chunk_layout: dict[MetadataIndex, tuple[tuple[int, ...], torch.dtype]] = {}
        self._metadata = metadata
        self._in_memory = in_memory or {}

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = str(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        started = time.perf_counter()
        if self._metadata is not None:
            metadata = self._metadata
        else:
            with self.fs.open(join(self.path, DCP_METADATA), "rb") as handle:
                data = handle.read()
            # checked, then unpickled through an allow-list: a crafted .metadata must not run code here
            metadata = safe_pickle.load_dcp_metadata(
                data, self.path, expected=self._expected_metadata, trust=self._trust
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None  # set just above when the file had none
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
        files: dict[str, ShardFile] = {}
        pool = BufferPool(self._read_ahead_bytes)
        crypto = self._signed.algorithm if self._signed is not None else None
        direct = DirectReader(hashing=self._expected is not None, range_threads=self._threads, crypto=crypto)
        executor = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix=THREAD_NAME_PREFIX)
        pending: deque[tuple[_Chunk, ThreadFuture[Fetched]]] = deque()
        buffered = 0  # bytes of the chunk buffers in `pending`: read or being read, not yet placed
        started = time.perf_counter()
        last_byte = started
        coalesced = CoalescedReads([chunk for chunk in chunks if self._shared(chunk) is None])
        try:
            for chunk in chunks:
                memory = self._shared(chunk)
                if memory is None and chunk.relative_path not in files:
                    files[chunk.relative_path] = self._open_shard(chunk.relative_path, chunks)
                    self._check_size(chunk.relative_path, files[chunk.relative_path])
                if memory is None:  # a small chunk with small neighbours: their run, read in one request
                    memory = coalesced.serve(chunk, files[chunk.relative_path])
                shard: ShardFile | InMemoryShard = files[chunk.relative_path] if memory is None else memory
                # bytes in memory already are placed as a buffered read's are
                chunk.targets = self._direct_targets(chunk, planner) if memory is None else None
                needs = 0 if chunk.targets is not None else chunk.length
                # place finished chunks first while the next would overrun the read-ahead budget or queue
                while pending and (buffered + needs > self._read_ahead_bytes or len(pending) >= 2 * self._threads):
                    buffered, last_byte = self._place_oldest(pending, planner, pool, buffered, last_byte)
                if chunk.targets is not None:
                    layout = self._chunk_layout[chunk.requests[0].storage_index]
                    destinations = self._destinations(chunk, layout)
                    data_bytes = math.prod(layout[0]) * _element_size(layout[1])
                    blocks = self._expected_blocks.get((chunk.relative_path, chunk.offset))
                    future = executor.submit(
                        direct.fetch,
                        files[chunk.relative_path],
                        chunk.offset,
                        chunk.length,
                        data_bytes,
                        destinations,
                        blocks[0] if blocks else None,
                    )
                else:
                    # what the file holds of it, not what the metadata claims: a forged length of 3 GiB in an 8 KB
                    # file would be zero-filled here before the short read is found
                    chunk.buffer = pool.take(available_bytes(shard, chunk.offset, chunk.length))
                    future = executor.submit(
                        fetch_buffered,
                        shard,
                        chunk.offset,
                        chunk.length,
                        chunk.buffer,
                        self._expected is not None,
                        self._block_size(chunk),
                        crypto,
                    )
                pending.append((chunk, future))
                buffered += needs
            while pending:
                buffered, last_byte = self._place_oldest(pending, planner, pool, buffered, last_byte)
        finally:
            executor.shutdown(wait=True, cancel_futures=True)  # a failed chunk: stop reading the rest
            direct.close()
            for opened in files.values():
                opened.close()
        self.read_s += last_byte - started
        log.debug(
            "read %d chunk(s) (%d read again buffered, %d run(s) of small chunks in one request each), %d bytes for "
            "%d read item(s) in %.3fs",
            len(chunks),
            self.chunks_reread,
            coalesced.runs,
            self.bytes_read,
            len(plan.items),
            self.read_s,
        )
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    # --- our part ---
    def _shared(self, chunk: _Chunk) -> InMemoryShard | None:
        """The in-memory bytes holding `chunk` (its file's size checked as an opened file's is), or None."""
        shard = self._in_memory.get(chunk.relative_path)
        if shard is None or not shard.covers(chunk.offset, chunk.length):
            return None
        self._check_size(chunk.relative_path, shard)
        return shard

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

    def _direct_targets(self, chunk: _Chunk, planner: LoadPlanner) -> list[torch.Tensor] | None:
        """Each request's target when every request of the chunk can be read straight into it, else None.

        That is: a tensor chunk of known layout whose requests are row ranges (narrowed along dim 0 only,
        so their bytes are contiguous in the record) into contiguous CPU targets of its dtype, not
        overlapping one another.
        """
        layout = self._chunk_layout.get(chunk.requests[0].storage_index)
        if layout is None or any(request.type != LoadItemType.TENSOR for request in chunk.requests):
            return None
        sizes, dtype = layout
        rows: list[tuple[int, int]] = []
        for request in chunk.requests:
            offsets, lengths = list(request.storage_offsets), list(request.lengths)
            if len(sizes) != len(lengths) or any(offsets[1:]) or lengths[1:] != list(sizes[1:]):
                return None
            rows.append((offsets[0], offsets[0] + lengths[0]) if sizes else (0, 1))
        ordered = sorted(rows)
        if any(previous[1] > following[0] for previous, following in zip(ordered, ordered[1:])):
            return None
        targets = []
        for request in chunk.requests:
            target = planner.resolve_tensor(request).detach()
            if (
                target.device.type != "cpu"
                or target.dtype != dtype
                or not target.is_contiguous()
                or list(target.size()) != list(request.lengths)
            ):
                return None
            targets.append(target)
        return targets

    def _destinations(self, chunk: _Chunk, layout: tuple[tuple[int, ...], torch.dtype]) -> list[Destination]:
        sizes, dtype = layout
        row_bytes = math.prod(sizes[1:]) * _element_size(dtype)
        destinations = []
        for request, target in zip(chunk.requests, chunk.targets or []):
            first = request.storage_offsets[0] if sizes else 0
            start = first * row_bytes
            destinations.append(Destination(start, start + target.numel() * target.element_size(), byte_view(target)))
        return destinations

    def _place_oldest(
        self, pending: deque, planner: LoadPlanner, pool: BufferPool, buffered: int, last_byte: float
    ) -> tuple[int, float]:
        """Wait for the oldest chunk, check it, commit its items; return the new buffered bytes and last-byte time."""
        chunk, future = pending.popleft()
        fetched = future.result()
        started = time.perf_counter()
        was_buffered = chunk.buffer is not None
        if not fetched.placed:  # not our record layout after all: read it again, whole, here
            self.chunks_reread += 1
            file = ShardFile(self.fs, join(self.path, chunk.relative_path))
            chunk.targets, chunk.buffer = None, pool.take(available_bytes(file, chunk.offset, chunk.length))
            try:
                fetched = fetch_buffered(
                    file,
                    chunk.offset,
                    chunk.length,
                    chunk.buffer,
                    self._expected is not None,
                    self._block_size(chunk),
                    self._signed.algorithm if self._signed is not None else None,
                )
            finally:
                file.close()
        self._check(chunk, fetched)
        self.bytes_read += fetched.read_bytes
        self.chunks_read += 1
        if chunk.targets is not None:
            for request, target in zip(chunk.requests, chunk.targets):
                planner.commit_tensor(request, target)
        else:
            data = memoryview(chunk.buffer)[: fetched.filled]
            for request in chunk.requests:
                self._place(chunk, request, data, planner)
            pool.give(chunk.buffer)
        chunk.buffer = chunk.targets = None
        self.place_s += time.perf_counter() - started
        return buffered - (chunk.length if was_buffered else 0), max(last_byte, fetched.finished)

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
        layout = self._chunk_layout.get(index)
        return decode_tensor_record(data, *(layout if layout is not None else (None, None)))

    def _open_shard(self, relative_path: str, chunks: list[_Chunk]) -> ShardFile:
        path = join(self.path, relative_path)
        safe_pickle.check_inside(self.fs, self.path, relative_path)
        try:
            return ShardFile(self.fs, path)
        except FileNotFoundError as err:
            lost = sorted(
                {
                    request.storage_index.fqn
                    for chunk in chunks
                    if chunk.relative_path == relative_path
                    for request in chunk.requests
                }
            )
            raise CorruptCheckpoint(
                f"{path} is missing: the manifest lists it but storage has no such file ({len(lost)} tensor(s) lost, "
                f"e.g. {lost[:3]}). Restore it from a replica or load an older checkpoint; `shardckpt verify` lists every loss",
                problems=[
                    {"file": relative_path, "tensor": fqn, "expected": "present", "actual": "missing"} for fqn in lost
                ],
            ) from err

    def _check(self, chunk: _Chunk, fetched: Fetched) -> None:
        if self._expected is None:
            return
        expected = self._expected.get((chunk.relative_path, chunk.offset))
        if expected is None:
            raise CorruptCheckpoint(
                f"{join(self.path, chunk.relative_path)} @ {chunk.offset}: DCP metadata names a chunk of {chunk.fqn!r} "
                "that the manifest does not list; the checkpoint's metadata was altered after commit"
            )
        short = fetched.filled != chunk.length
        if not short and self._signed is not None:
            self._check_digest(chunk, fetched)
        if not short and fetched.blocks is not None:  # read by block: check each block read
            expected_blocks = self._expected_blocks[(chunk.relative_path, chunk.offset)][1]
            for index, digest in sorted(fetched.blocks.items()):
                if digest != expected_blocks[index]:
                    raise chunk_mismatch(
                        self.path, chunk.relative_path, chunk.fqn, f"block {index}: {expected_blocks[index]}", digest
                    )
            return
        # read whole: by the digest of its block digests when it has blocks, as the buffered read hashed it
        check = ChunkCheck.of(expected[0], self._expected_blocks.get((chunk.relative_path, chunk.offset)))
        if short:
            actual = SHORT_READ.format(filled=fetched.filled, length=chunk.length)
        else:
            assert fetched.digest is not None  # checksums are on (`_expected`): a whole, full read hashes the chunk
            actual = fetched.digest
        if actual != check.expected:
            raise chunk_mismatch(self.path, chunk.relative_path, chunk.fqn, check.expected, actual)

    def _check_size(self, relative_path: str, shard: ShardFile | InMemoryShard) -> None:
        """A signed v5 shard file holds exactly the bytes its part records: bytes appended after its last chunk, or
        cut, are in no chunk a digest covers, and would pass unseen otherwise."""
        if self._signed is None:
            return
        expected = self._signed.file_bytes.get(relative_path)
        if expected != shard.size:
            raise SignatureRefused(
                f"{join(self.path, relative_path)}: its {self._signed.algorithm} digest differs from what the manifest "
                f"signed by key {self._signed.key_id[:16]} binds: it holds {shard.size} bytes, its part lists "
                f"{expected}; bytes were added or cut after it was signed. Resume a checkpoint whose files are intact"
            )

    def _check_digest(self, chunk: _Chunk, fetched: Fetched) -> None:
        """A signed v5 chunk's bytes (or the blocks read of it) against the cryptographic digests its part records,
        before its xxh3: bytes forged with every checksum recomputed are refused here, naming the file."""
        assert self._signed is not None
        algorithm, kid = self._signed.algorithm, self._signed.key_id
        digest, blocks = self._signed.digests.get((chunk.relative_path, chunk.offset), (None, None))
        if fetched.crypto_blocks is not None:
            wrong = [
                index
                for index, actual in sorted(fetched.crypto_blocks.items())
                if blocks is None or index >= len(blocks) or actual != blocks[index]
            ]
            where = f"block {wrong[0]} of " if wrong else ""
        else:
            wrong = [0] if digest is None or fetched.crypto != digest else []
            where = ""
        if wrong:
            raise SignatureRefused(
                f"{join(self.path, chunk.relative_path)} @ {chunk.offset}: the {algorithm} digest of {where}its chunk "
                f"of {chunk.fqn!r} differs from the one its part records under the manifest signed by key {kid[:16]}; "
                "the file was changed after it was signed. Resume a checkpoint whose files are intact"
            )

    def _block_size(self, chunk: _Chunk) -> int | None:
        """The block size a whole read of `chunk` hashes by (ChunkCheck): its blocks', or None without blocks."""
        blocks = self._expected_blocks.get((chunk.relative_path, chunk.offset))
        return blocks[0] if blocks else None


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
