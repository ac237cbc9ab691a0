"""DCP StorageWriter over fsspec, with a checksum on every chunk (the reader is in reader.py, the read-back
before commit in read_back.py).

Each rank writes one file of its own (`__<rank>_0.distcp`); no tensor bytes travel to rank 0. Bytes are
laid out exactly as DCP's FileSystemWriter lays them out (each item a `torch.save` record at an
offset), and DCP's `.metadata` points at them with DCP's own `_StorageInfo`, so a committed checkpoint
loads with a plain `torch.distributed.checkpoint.load`. What we add travels beside it: per-chunk
receipts (checksum, verification), which the coordinator turns into the manifest.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..config import VerifyConfig
from ..format import signing
from ..format.checksum import HashingWriter, block_size_for
from ..format.names import join, shard_filename
from . import fsio
from .read_back import (  # noqa: F401  (moved to read_back.py; importing them from here keeps working)
    VerifyRead,
    choose_chunks_to_verify,
    choose_reads_to_verify,
    spans_of,
    verify_chunks,
    verify_reads,
)
from .reader import ShardReader  # noqa: F401  (moved to reader.py; `engine.storage.ShardReader` keeps working)

log = logging.getLogger(__name__)

# Named points where tests inject failures (a rank raising or dying); None in production.
FaultHook = Callable[[str], None]

FINITE_SLICE_ELEMENTS = 2**22  # the exact finite check's slice: a 4 MiB mask, not one the tensor's size


@dataclass(frozen=True)
class ChunkReceipt:
    """What a rank reports for one written chunk; the coordinator checks these before committing."""

    relative_path: str
    offset: int
    length: int
    checksum: str
    file_bytes: int  # size of the whole file as this rank wrote it
    verified: bool  # read back from storage (whole, or sampled blocks of it) and matched before the receipt was sent
    finite: bool | None = None  # a floating tensor chunk without NaN/Inf at save time (None: not a float tensor)
    write_s: float | None = (
        None  # how long this rank took to write its whole file: per-rank throughput for health rules
    )
    blocks: tuple[int, tuple[str, ...]] | None = None  # (block size, digests): a large chunk checksummed by block too
    reference: bool = False  # incremental: not written; `relative_path` is '../<sibling>/<file>' holding the bytes
    verified_bytes: int | None = None  # bytes read back (sampled blocks of a large chunk); None: `length` if verified
    file_digest: str | None = None  # signing on: the cryptographic digest of the whole file, from the write pass
    # signing on, format v5: this chunk's own cryptographic digest (and its blocks', when checksummed by block)
    crypto: tuple[str, tuple[str, ...] | None] | None = None
    # the file's size on storage as this rank's read-back found it (None: nothing read back): the coordinator's size
    # check then needs no request of its own (format v2: one HEAD per rank's file on rank 0 otherwise)
    stored_bytes: int | None = None


@dataclass(frozen=True)
class _RankPrefix:
    rank: int


class ChunkFileWriter:
    """Writes one shard file chunk by chunk, checksumming each chunk in the same pass."""

    def __init__(
        self, fs: Any, path: str, file_digest: Any = None, direct_io: bool = False, chunk_digest: str | None = None
    ) -> None:
        """`direct_io`: write past the page cache where the storage allows it (SaveConfig.direct_io).
        `chunk_digest`: each chunk's cryptographic digest of this algorithm (HashingWriter)."""
        self._handle = fsio.open_shard(fs, path, direct_io)
        self._stream = HashingWriter(self._handle, file_digest, chunk_digest)
        self.chunks: list[tuple[int, int, str]] = []
        self.blocks: list[tuple[int, tuple[str, ...]] | None] = []  # per chunk, as HashingWriter.chunk_blocks
        self.crypto: list[tuple[str, tuple[str, ...] | None] | None] = []  # per chunk, HashingWriter.chunk_crypto

    def add_bytes(self, data: Any) -> tuple[int, int, str]:
        self._stream.begin_chunk()
        self._stream.write(data)
        return self._end()

    def add_tensor(self, tensor: torch.Tensor) -> tuple[int, int, str]:
        self._stream.begin_chunk(block_size_for(tensor.numel() * tensor.element_size()))
        save_record(tensor, self._stream)
        return self._end()

    def close(self) -> int:
        """Flush, make durable, close; return the file size."""
        fsio.sync_local_file(self._handle)
        self._handle.close()
        return self._stream.tell()

    @property
    def file_digest(self) -> str | None:
        return self._stream.file_digest

    def abort(self) -> None:
        # never close() a failed upload: on S3 that would commit the partial object or leave a multipart upload
        fsio.abort_write(self._handle)

    def _end(self) -> tuple[int, int, str]:
        chunk = self._stream.end_chunk()
        self.chunks.append(chunk)
        self.blocks.append(self._stream.chunk_blocks)
        self.crypto.append(self._stream.chunk_crypto)
        return chunk


def save_record(tensor: torch.Tensor, stream: Any) -> None:
    """Exactly what `torch.save(tensor, stream)` writes, without the zip CRC32 of every record.

    The CRC was the largest CPU cost of a save (~0.9 s per GiB here) and adds nothing: our xxh3
    checksum covers the same bytes and is checked on every load, and `torch.load` does not check the
    CRC. torch.save's own switch (`set_crc32_options`) is process-global and would change a training
    thread's saves too, so the record is written through torch's writer directly; on a torch without
    that internal signature it falls back to torch.save.
    """
    sink = _RecordSink(stream)
    try:
        # torch's stub lists str | IO[bytes]; the writer takes any object with a write method, as torch.save's does
        writer = torch._C.PyTorchFileWriter(sink, False, torch.serialization._get_storage_alignment())  # type: ignore[call-overload]
    except (AttributeError, TypeError):
        torch.save(tensor, stream)
        return
    try:
        torch.serialization._save(tensor, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
        writer.write_end_of_file()
    except BaseException:
        _discard(writer, sink)
        raise
    finally:
        del writer  # the only owner: nothing but the (finalised) record writer's own frames may outlive this call


class _RecordSink:
    """The stream a record writer writes through; once `cut`, it accepts and drops every write.

    A `torch._C.PyTorchFileWriter` that was never finalised writes its end-of-file records from its C++
    destructor; when that write fails (the storage that failed a moment ago, still full) the destructor
    throws and the process aborts with SIGABRT, at whatever garbage collection or interpreter exit
    drops the last reference. A failed record is therefore finalised at once into a cut sink: nothing
    more reaches storage, and the destructor has nothing left to do.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._cut = False

    def cut(self) -> None:
        self._cut = True

    def write(self, data: Any) -> int:
        if self._cut:
            return memoryview(data).nbytes
        return self._stream.write(data)

    def flush(self) -> None:
        if not self._cut:
            self._stream.flush()


def _discard(writer: Any, sink: _RecordSink) -> None:
    """Finalise a record writer whose record failed, writing nothing more (see _RecordSink)."""
    sink.cut()
    try:
        writer.write_end_of_file()
    except Exception:  # its position no longer matches the stream; torch marks it finalised all the same
        log.debug("finalising a failed tensor record raised", exc_info=True)


@dataclass
class RankWrite:
    """What one rank wrote: a receipt per chunk, in the order its items were written, and its counters."""

    receipts: list[tuple[Any, ChunkReceipt]]
    stats: dict[str, Any]
    relative: str | None = None  # its file (None: it wrote none)
    file_bytes: int = 0
    stored_bytes: int | None = None  # the file's size on storage, when the read-back saw it
    file_digest: str | None = None  # signing on: the cryptographic digest of the file's bytes, from the write pass


def write_rank_file(
    fs: Any,
    directory: str,
    rank: int,
    plan_items: list[Any],
    resolve: Callable[[Any], Any],
    verify: VerifyConfig,
    rng: random.Random,
    fault: FaultHook,
    reference_of: Callable[[Any], dict[str, Any] | None] = lambda item: None,
    digest: str | None = None,
    direct_io: bool = False,
    chunk_digests: bool = False,
    always_file: bool = False,
) -> RankWrite:
    """Write `plan_items` (DCP write items) as this rank's shard file, checksumming every chunk as it streams,
    then read back what `verify` asks for. Unchanged chunks an incremental save references are not written;
    `always_file` (the parts format, whose part lists a rank's referenced chunks): a rank that references every
    chunk still writes its (empty) shard file, so that it has a part like every rank holding chunks.
    `digest` (signing on: "blake3" or "sha256"): also the file's digest, in the same streaming pass; with
    `chunk_digests` (a signed v5 save) each chunk's digest instead, so a reader checks the chunks it reads. `direct_io`:
    the file is written past the page cache where the storage allows it (direct_file.py).
    Raises on the first failure (the file's upload is abandoned, never committed)."""
    fault("before_write")
    stats: dict[str, Any] = {
        "bytes": 0,
        "chunks": 0,
        "verified_chunks": 0,
        "verified_bytes": 0,
        "write_s": 0.0,
        "verify_s": 0.0,
    }
    if not plan_items:
        return RankWrite([], stats)
    started = time.perf_counter()
    relative = shard_filename(rank)
    full_path = join(directory, relative)
    # Byte items first, then tensors, as DCP orders them. Unchanged chunks (incremental) are referenced.
    referenced = [(item, reference_of(item)) for item in plan_items]
    items = sorted(
        [item for item, ref in referenced if ref is None], key=lambda item: item.type != WriteItemType.BYTE_IO
    )
    reference_receipts = [(item, _reference_receipt(ref)) for item, ref in referenced if ref is not None]
    if not items and not (always_file and reference_receipts):
        stats["chunks"] = len(reference_receipts)
        return RankWrite(reference_receipts, stats)
    whole_file = signing.new_digest(digest) if digest and not chunk_digests else None
    writer = ChunkFileWriter(
        fs, full_path, whole_file, direct_io=direct_io, chunk_digest=digest if chunk_digests else None
    )
    finite: list[bool | None] = []
    try:
        for position, item in enumerate(items):
            if position == len(items) // 2 and position > 0:
                fault("mid_shard")
            data = resolve(item)
            if item.type == WriteItemType.BYTE_IO:
                writer.add_bytes(data.getbuffer())
                finite.append(None)
            else:
                tensor = _plain_cpu_tensor(data)
                finite.append(is_finite(tensor))
                writer.add_tensor(tensor)
        file_bytes = writer.close()
    except BaseException:
        writer.abort()
        raise
    fault("after_write")
    written = time.perf_counter()

    names = [item.index.fqn for item in items]
    reads = choose_reads_to_verify(writer.chunks, writer.blocks, verify, rng)
    stored_bytes = verify_reads(fs, full_path, reads, names)
    read_back = [0] * len(items)  # bytes of each chunk read back
    for read in reads:
        read_back[read.chunk] += read.length

    receipts = []
    for position, (item, (offset, length, digest)) in enumerate(zip(items, writer.chunks)):
        receipt = ChunkReceipt(
            relative,
            offset,
            length,
            digest,
            file_bytes,
            read_back[position] > 0,
            finite[position],
            written - started,
            writer.blocks[position],
            verified_bytes=read_back[position],
            file_digest=writer.file_digest,
            crypto=writer.crypto[position],
            stored_bytes=stored_bytes,
        )
        receipts.append((item, receipt))
    stats.update(
        bytes=file_bytes,
        chunks=len(items),
        verified_chunks=sum(1 for count in read_back if count),
        verified_bytes=sum(read_back),
        write_s=written - started,
        verify_s=time.perf_counter() - written,
        referenced_chunks=len(reference_receipts),
    )
    return RankWrite(receipts + reference_receipts, stats, relative, file_bytes, stored_bytes, writer.file_digest)


class ShardWriter(StorageWriter):
    """A DCP StorageWriter: one checksummed file per rank, read-back verification, commit in `finish`.

    `commit` is called on the coordinator with DCP's global metadata, every rank's receipts and the
    global plan; it owns the commit protocol (see commit.py) and raising from it fails the save on
    every rank.
    """

    def __init__(
        self,
        fs: Any,
        path: str,
        *,
        verify: VerifyConfig,
        commit: Callable[[Metadata, list[list[WriteResult]], list[list[MetadataIndex]]], None],
        fault_hook: FaultHook | None = None,
        references: dict[tuple[str, tuple[int, ...]], dict[str, Any]] | None = None,
        digest: str | None = None,
        direct_io: bool = False,
    ) -> None:
        """`references` (incremental saves): (fqn, chunk offsets) -> the chunk record, from an earlier
        checkpoint of the same root, of a chunk that did not change; it is referenced, not written. `digest`
        (signing on): each rank's file digest too, in the write pass, for the signed manifest's `files`."""
        super().__init__()
        self.references = references or {}
        self.digest = digest
        self.direct_io = direct_io
        self.fs = fs
        self.path = path
        self.verify = verify
        self._commit = commit
        self._fault = fault_hook or (lambda point: None)
        self._rng = random.Random(verify.seed)
        self._rank = 0
        self._planned: list[list[MetadataIndex]] = []
        self.save_id = uuid.uuid4().hex
        self.last_write_stats: dict[str, int] = {}

    # --- DCP protocol ---
    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.path = str(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._rank = kwargs.get("rank") or 0

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        fsio.makedirs(self.fs, self.path)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Remember, on the coordinator, every chunk each rank must write: the completeness check's truth.
        self._planned = [[item.index for item in plan.items] for plan in plans]
        return [dataclasses.replace(plan, storage_data=_RankPrefix(rank)) for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank = plan.storage_data.rank if isinstance(plan.storage_data, _RankPrefix) else self._rank
        future: Future[list[WriteResult]] = Future()
        future.set_result(self._write_rank_file(rank, plan, planner))
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self._commit(metadata, results, self._planned)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never picked implicitly: callers construct it with its filesystem

    # --- our part ---
    def _write_rank_file(self, rank: int, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        self.last_write_stats = {}
        written = write_rank_file(
            self.fs,
            self.path,
            rank,
            plan.items,
            planner.resolve_data,
            self.verify,
            self._rng,
            self._fault,
            self._reference_of,
            digest=self.digest,
            direct_io=self.direct_io,
        )
        self.last_write_stats = written.stats
        if written.relative is not None:
            self._fault("before_receipt")
        return [
            WriteResult(index=item.index, size_in_bytes=receipt.length, storage_data=receipt)
            for item, receipt in written.receipts
        ]

    def _reference_of(self, item: Any) -> dict[str, Any] | None:
        if item.type == WriteItemType.BYTE_IO or not self.references or item.tensor_data is None:
            return None
        entry = self.references.get((item.index.fqn, tuple(item.index.offset)))
        if entry is None or list(entry["sizes"]) != list(item.tensor_data.chunk.sizes):
            return None
        return entry


def _reference_receipt(entry: dict[str, Any]) -> ChunkReceipt:
    """The receipt of an unchanged chunk: the earlier checkpoint's record of it, byte for byte."""
    blocks = entry.get("blocks")
    digest = entry.get("digest")  # signed v5: the holder's chunk digests, as its writer recorded them
    block_digests = blocks.get("digests") if blocks else None
    return ChunkReceipt(
        entry["file"],
        entry["offset"],
        entry["length"],
        entry["checksum"],
        entry.get("file_bytes", 0),  # the holder file's size (parts format: its part's record says it)
        False,
        entry.get("finite"),
        None,
        (blocks["size"], tuple(blocks["checksums"])) if blocks else None,
        reference=True,
        crypto=(digest, tuple(block_digests) if block_digests is not None else None) if digest is not None else None,
    )


def is_finite(tensor: torch.Tensor) -> bool | None:
    """No NaN/Inf in a floating tensor (None for other dtypes), in one pass without a mask the tensor's size.

    A sum in the tensor's own dtype is finite only if every element is (a NaN or Inf makes it NaN or
    Inf), so a finite sum proves the flag at the cost of one read. Only a non-finite sum (a real NaN/Inf,
    or finite values that overflowed the dtype) pays for the exact check, slice by slice. Not
    `sum(dtype=float64)`: that first converts the whole tensor (0.6 CPU-seconds per 512 MiB here, the
    largest cost of a save). Drills compare a restored tensor with this flag: NaN where the writer saw
    none is damage, not training.
    """
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return None
    if tensor.numel() == 0:
        return True
    flat = tensor.reshape(-1)
    if bool(torch.isfinite(flat.sum())):
        return True
    return all(bool(torch.isfinite(piece).all()) for piece in flat.split(FINITE_SLICE_ELEMENTS))


def _plain_cpu_tensor(data: Any) -> torch.Tensor:
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    # torch.save writes a view's whole storage: copy views so a shard holds only its own bytes, and make
    # it contiguous so its record is exactly the chunk's elements in order (the reader maps it directly)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()  # a fresh, compact copy
    elif tensor.untyped_storage().size() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def storage_info_of(receipt: ChunkReceipt) -> _StorageInfo:
    """DCP's own record of where a chunk lives: what a plain `dcp.load` reads."""
    return _StorageInfo(relative_path=receipt.relative_path, offset=receipt.offset, length=receipt.length)
