"""Reading one stored chunk: range reads from a shard file, hashed in order as they land, into a buffer or straight into tensors.

Two ways to read a chunk, both checksumming every byte of it in order:
- buffered: the whole chunk into a reused buffer; the caller then parses the record and copies out.
- direct: the record's header and trailer first (a few KiB at each end), from which torch's own zip
  reader finds where the tensor's bytes begin; then the bytes each read item needs go straight into
  its target tensor, and the bytes no item needs into a small per-thread scratch piece, hashed and
  dropped. No chunk-sized buffer and no second copy. With checksums off, unneeded bytes are not read.
A direct read writes into targets before the chunk's checksum is known: a mismatch still raises
before any item is committed, and a load that raised leaves its state dict unusable, as before.
A chunk checksummed by block (a large one: one embedding table of several GiB) is read by several
threads at once, each a contiguous run of its blocks, every block still hashed on its own: one huge
chunk reads as fast as many medium ones instead of at one thread's speed.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CorruptCheckpoint
from ..format import safe_pickle
from ..format.checksum import ChunkCheck, ChunkHasher
from ..format.names import join
from . import fsio
from .backends import backend_for

PIECE_BYTES = 8 * 2**20  # one range request; hashed right after it lands, while it is still in cache
HEAD_BYTES = 4096  # a record's zip local headers: data.pkl, the tensor's header (torch aligns data to 64 bytes)
TAIL_BYTES = 4096  # a record's trailing records and zip central directory (< 1 KiB for a tensor)
DATA_RECORD = "data/0"  # the one storage of a tensor record as our writer makes it
PARALLEL_MIN_BLOCKS = 8  # a chunk needing this many blocks or more is read by several threads at once


class _OutsideReadParts(OSError):
    """The zip reader asked for bytes between a record's head and tail: not the layout our writer makes."""


class ShardFile:
    """One shard file, open for concurrent range reads from a pool's threads."""

    def __init__(self, fs: Any, path: str) -> None:
        self.path = path
        self._fs = fs
        self._fd: int | None = None
        if backend_for(fs).reads_with_preadv:
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


class InMemoryShard:
    """Runs of a shard file's bytes another rank read and sent (engine/load/shared_reads.py), read like a ShardFile:
    `size` is the file's size on storage when they were read; `covers` says whether a chunk is among them."""

    def __init__(self, path: str, size: int, spans: list[tuple[int, bytes]]) -> None:
        self.path, self.size = path, size
        self._spans = sorted(spans, key=lambda span: span[0])

    def covers(self, offset: int, length: int) -> bool:
        """Whether bytes [offset, offset + length) were read, or all of them the file holds (a cut file: the
        reader's check then names the short chunk, as it would reading storage)."""
        stop = min(offset + length, self.size)
        return any(start <= offset and stop <= start + len(data) for start, data in self._spans)

    def read_into(self, offset: int, view: memoryview) -> int:
        for start, data in self._spans:
            if start <= offset < start + len(data):
                count = min(len(view), start + len(data) - offset)
                view[:count] = data[offset - start : offset - start + count]
                return count
        return 0

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Fetched:
    """What reading one chunk gave."""

    filled: int  # bytes of the chunk storage holds (fewer than its length: the file was cut short)
    read_bytes: int  # bytes actually read (a direct read with checksums off skips what no item needs)
    digest: str | None  # None when checksums are off or the chunk was short
    finished: float  # perf_counter when the last byte landed
    placed: bool = True  # False: a direct read found another record layout and wrote nothing; read it buffered
    blocks: dict[int, str] | None = None  # read by block: the digest of each block read (the chunk digest is None)
    # signed v5 under a policy: the chunk's cryptographic digest (FORMAT.md §12.2), or by block that of each block
    crypto: str | None = None
    crypto_blocks: dict[int, str | None] | None = None


@dataclass(frozen=True)
class Destination:
    """Bytes [start, stop) of a tensor record's data go to `view` (a target tensor's memory)."""

    start: int
    stop: int
    view: memoryview


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (any dtype, bfloat16 included)."""
    return (
        tensor.reshape(-1).view(torch.uint8).numpy().data
    )  # the array's memoryview (typed, unlike memoryview(ndarray))


def available_bytes(shard: ShardFile | InMemoryShard, offset: int, length: int) -> int:
    return max(0, min(length, shard.size - offset))


def fetch_buffered(
    shard: ShardFile | InMemoryShard,
    offset: int,
    length: int,
    buffer: bytearray,
    hashing: bool,
    block_size: int | None = None,
    crypto: str | None = None,
) -> Fetched:
    """The whole chunk into `buffer`, piece by piece, hashing each piece as it lands (`block_size`: the chunk's
    ChunkCheck's, so its digest is made of block digests; `crypto`: its cryptographic digest too, same pass).
    `buffer` needs only `available_bytes(...)`: what the file holds of the chunk (a `length` past the file's end
    is short, not read)."""
    wanted = available_bytes(shard, offset, length)
    view = memoryview(buffer)[:wanted]
    hasher = ChunkHasher(block_size, crypto) if hashing else None
    filled = 0
    while filled < wanted:
        piece = view[filled : min(wanted, filled + PIECE_BYTES)]
        count = shard.read_into(offset + filled, piece)
        if hasher is not None:
            hasher.update(piece[:count])
        filled += count
        if count < len(piece):
            break  # the file ends early: the check names the chunk
    digest = hasher.hexdigest() if hasher is not None and filled == length else None
    signed = hasher.crypto_digest() if hasher is not None and filled == length else None
    return Fetched(filled, filled, digest, time.perf_counter(), crypto=signed)


class DirectReader:
    """Direct chunk reads (see the module docstring); one scratch piece per pool thread.

    `range_threads` > 1: the blocks of one large chunk are read by that many threads of a pool of its own
    (never the caller's: a pool thread waiting on tasks of its own pool could wait forever). close() ends it.
    """

    def __init__(self, hashing: bool, range_threads: int = 1, crypto: str | None = None) -> None:
        """`crypto` (signed v5 under a policy): each chunk's (or block's) cryptographic digest too, same pass."""
        self._hashing = hashing
        self._crypto = crypto if hashing else None
        self._local = threading.local()
        self._range_threads = max(1, range_threads)
        self._ranges = (
            ThreadPoolExecutor(self._range_threads, thread_name_prefix="shardckpt-read-range")
            if self._range_threads > 1
            else None
        )

    def close(self) -> None:
        if self._ranges is not None:
            self._ranges.shutdown(wait=True, cancel_futures=True)

    def fetch(
        self,
        shard: ShardFile,
        offset: int,
        length: int,
        data_bytes: int,
        destinations: list[Destination],
        block_size: int | None = None,
    ) -> Fetched:
        """Read the chunk at `offset` into `destinations`; with `block_size` (and hashing), only the blocks
        holding destination bytes or the record's headers are read, each hashed on its own."""
        available = available_bytes(shard, offset, length)
        if available < length:
            return Fetched(available, 0, None, time.perf_counter())  # a short chunk fails its check unread
        head = bytearray(min(HEAD_BYTES, length))
        tail_start = max(len(head), length - TAIL_BYTES)
        tail = bytearray(length - tail_start)
        read_bytes = shard.read_into(offset, memoryview(head)) + shard.read_into(offset + tail_start, memoryview(tail))
        data_start = record_data_offset(head, tail, tail_start, length, data_bytes)
        if data_start is None:
            return Fetched(length, read_bytes, None, time.perf_counter(), placed=False)
        chunk = _ChunkBytes(shard, offset, length, head, tail, tail_start, _segments(length, data_start, destinations))
        if block_size is None or not self._hashing:
            # no block size here: the chunk has no blocks
            hasher = ChunkHasher(crypto=self._crypto) if self._hashing else None
            read_bytes, short_at = self._copy(chunk, 0, length, hasher, read_bytes)
            if short_at is not None:
                return Fetched(short_at, read_bytes, None, time.perf_counter())
            if hasher is None:
                return Fetched(length, read_bytes, None, time.perf_counter())
            return Fetched(length, read_bytes, hasher.hexdigest(), time.perf_counter(), crypto=hasher.crypto_digest())
        needed = needed_blocks(length, block_size, data_start, destinations)
        if self._ranges is None or len(needed) < PARALLEL_MIN_BLOCKS:
            runs = [self._read_blocks(chunk, needed, block_size)]
        else:
            runs = list(
                self._ranges.map(
                    lambda group: self._read_blocks(chunk, group, block_size), _split(needed, self._range_threads)
                )
            )
        digests = {index: digest[0] for run_digests, _, _ in runs for index, digest in run_digests.items()}
        read_bytes += sum(count for _, count, _ in runs)
        short = [short_at for _, _, short_at in runs if short_at is not None]
        if short:
            return Fetched(min(short), read_bytes, None, time.perf_counter())
        crypto = None
        if self._crypto is not None:
            crypto = {index: digest[1] for run_digests, _, _ in runs for index, digest in run_digests.items()}
        return Fetched(length, read_bytes, None, time.perf_counter(), blocks=digests, crypto_blocks=crypto)

    def _read_blocks(
        self, chunk: _ChunkBytes, indices: list[int], block_size: int
    ) -> tuple[dict[int, tuple[str, str | None]], int, int | None]:
        """Blocks `indices` of the chunk to their destinations, each hashed on its own: ((xxh3, cryptographic
        digest or None) per block, bytes read, where a short read stopped or None)."""
        digests: dict[int, tuple[str, str | None]] = {}
        read_bytes = 0
        for index in indices:
            hasher = ChunkHasher(crypto=self._crypto)  # one block: its plain xxh3 (and its own digest)
            read_bytes, short_at = self._copy(
                chunk, index * block_size, min(chunk.length, (index + 1) * block_size), hasher, read_bytes
            )
            if short_at is not None:
                return digests, read_bytes, short_at
            digests[index] = (hasher.hexdigest(), hasher.crypto_digest())
        return digests, read_bytes, None

    def _copy(self, chunk: _ChunkBytes, low: int, high: int, hasher: Any, read_bytes: int) -> tuple[int, int | None]:
        """Bytes [low, high) of the chunk to their segments' views, hashed in order; (read bytes, where a
        short read stopped or None)."""
        for start, stop, view in chunk.segments:
            position, stop = max(start, low), min(stop, high)
            while position < stop:
                if position < len(chunk.head) or position >= chunk.tail_start:
                    source, base = (chunk.head, 0) if position < len(chunk.head) else (chunk.tail, chunk.tail_start)
                    count = min(stop, base + len(source)) - position
                    piece = memoryview(source)[position - base : position - base + count]
                    if view is not None:
                        view[position - start : position - start + count] = piece
                else:
                    count = min(stop, chunk.tail_start, position + PIECE_BYTES) - position
                    if view is None and hasher is None:
                        position += count  # checksums off: bytes no item needs are not read
                        continue
                    piece = (
                        view[position - start : position - start + count]
                        if view is not None
                        else self._scratch()[:count]
                    )
                    got = chunk.shard.read_into(chunk.offset + position, piece)
                    read_bytes += got
                    if got < count:  # the file shrank while it was read
                        return read_bytes, position + got
                if hasher is not None:
                    hasher.update(piece)
                position += count
        return read_bytes, None

    def _scratch(self) -> memoryview:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = memoryview(bytearray(PIECE_BYTES))
        return scratch


@dataclass(frozen=True)
class _ChunkBytes:
    """One chunk being read directly: where it is, its headers already read, and where its bytes go."""

    shard: ShardFile
    offset: int
    length: int
    head: bytearray
    tail: bytearray
    tail_start: int
    segments: list[tuple[int, int, memoryview | None]]


def _split(indices: list[int], parts: int) -> list[list[int]]:
    """`indices` in at most `parts` runs of nearly equal length, in order (each thread reads forward)."""
    size, extra = divmod(len(indices), parts)
    runs, start = [], 0
    for part in range(parts):
        stop = start + size + (1 if part < extra else 0)
        if stop > start:
            runs.append(indices[start:stop])
        start = stop
    return runs


def needed_blocks(length: int, block_size: int, data_start: int, destinations: list[Destination]) -> list[int]:
    """Indices of the blocks holding destination bytes or the record's headers (head and tail), in order.

    The headers are what locate the data; their blocks are checked too, so no byte that decides where
    data goes is trusted unchecked.
    """
    ranges = [(0, min(HEAD_BYTES, length)), (max(0, length - TAIL_BYTES), length)]
    ranges += [(data_start + d.start, data_start + d.stop) for d in destinations if d.stop > d.start]
    return sorted({index for low, high in ranges for index in range(low // block_size, (high - 1) // block_size + 1)})


def _segments(
    length: int, data_start: int, destinations: list[Destination]
) -> list[tuple[int, int, memoryview | None]]:
    """The chunk's bytes in order as (start, stop, where to): a destination's view, or None (hash only)."""
    segments: list[tuple[int, int, memoryview | None]] = []
    cursor = 0
    for destination in sorted(destinations, key=lambda d: d.start):
        start, stop = data_start + destination.start, data_start + destination.stop
        if start > cursor:
            segments.append((cursor, start, None))
        segments.append((start, stop, destination.view))
        cursor = stop
    if cursor < length:
        segments.append((cursor, length, None))
    return segments


def record_data_offset(head: bytearray, tail: bytearray, tail_start: int, length: int, data_bytes: int) -> int | None:
    """Where a tensor record's bytes begin, found by torch's own zip reader from its head and tail alone.

    None when the record is not one tensor storage of `data_bytes` bytes, or its headers lie elsewhere.
    """
    try:
        # torch types its reader as taking str | IO[bytes]; it takes any object with read, seek and tell
        record = torch._C.PyTorchFileReader(PartsFile(length, [(0, head), (tail_start, tail)]))  # type: ignore[call-overload]
        if record.get_all_records().count(DATA_RECORD) != 1 or record.get_record_size(DATA_RECORD) != data_bytes:
            return None
        start = record.get_record_offset(DATA_RECORD)
    except (AttributeError, RuntimeError, TypeError, ValueError, OSError):
        return None  # another record layout or torch version: the buffered path parses the whole record
    return start if 0 <= start and start + data_bytes <= length else None


class PartsFile(io.RawIOBase):
    """A read-only file of `length` bytes of which only some parts are in memory; reading elsewhere raises.

    Lets torch's zip reader parse a record from memory without a copy (one part: the whole record), or
    from its head and tail alone.
    """

    def __init__(self, length: int, parts: list[tuple[int, Any]]) -> None:
        self._length, self._parts, self._position = length, parts, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = base + offset
        return self._position

    def readinto(self, target: Any) -> int:
        count = max(0, min(len(target), self._length - self._position))
        for start, data in self._parts:
            if start <= self._position and self._position + count <= start + len(data):
                target[:count] = data[self._position - start : self._position - start + count]
                self._position += count
                return count
        raise _OutsideReadParts(f"bytes {self._position}..{self._position + count} are not in the parts read")


class BufferPool:
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


SHORT_READ = "<{filled} of {length} bytes>"  # the "actual checksum" of a chunk storage cut short


def read_at(handle: Any, offset: int, view: memoryview) -> memoryview:
    """Read `len(view)` bytes at `offset` into `view`; return the part filled (shorter at end of file)."""
    handle.seek(offset)
    filled = 0
    while filled < len(view):
        count = handle.readinto(view[filled:])
        if not count:
            break
        filled += count
    return view[:filled]


def chunk_mismatch(directory: str, relative_path: str, fqn: str, expected: str, actual: str) -> CorruptCheckpoint:
    """The error every reader raises when a chunk's bytes are not the ones the manifest recorded."""
    problem = {"file": relative_path, "tensor": fqn, "expected": expected, "actual": actual}
    return CorruptCheckpoint(
        f"checksum mismatch in {join(directory, relative_path)} for {fqn!r}: expected {expected}, "
        f"read {actual}. Restore this file from a replica or load an older checkpoint",
        problems=[problem],
    )


def check_chunk(directory: str, relative_path: str, length: int, data: memoryview, check: ChunkCheck, fqn: str) -> None:
    """Raise CorruptCheckpoint, naming the file and the tensor, unless `data` is the chunk the manifest recorded
    (`check`: ChunkCheck.of_record of its record)."""
    actual = check.actual(data) if len(data) == length else SHORT_READ.format(filled=len(data), length=length)
    if actual != check.expected:
        raise chunk_mismatch(directory, relative_path, fqn, check.expected, actual)


def decode_tensor_record(data: memoryview, sizes: tuple[int, ...] | None, dtype: torch.dtype | None) -> torch.Tensor:
    """A chunk's tensor as a view of `data` (no copy) when its record is what our writer makes.

    `sizes` and `dtype` are the chunk's as the metadata records them (None: unknown, always the general path).
    The view shares `data`: copy it out before the buffer is reused.
    """
    if sizes is not None and dtype is not None:
        nbytes = math.prod(sizes) * torch.empty((), dtype=dtype).element_size()
        try:
            record = torch._C.PyTorchFileReader(PartsFile(len(data), [(0, data)]))  # type: ignore[call-overload]  # as above
            if record.get_all_records().count("data/0") == 1 and record.get_record_size("data/0") == nbytes:
                offset = record.get_record_offset("data/0")
                return torch.frombuffer(data, dtype=dtype, count=math.prod(sizes), offset=offset).view(sizes)
        except (AttributeError, RuntimeError, TypeError, ValueError, OSError):
            pass  # another record layout or torch version: the general path below
    try:  # the allow-list and an allocation bound of the record's size: a crafted record is refused, not run
        tensor = safe_pickle.load_torch_record(data)
    except pickle.UnpicklingError as err:
        raise CorruptCheckpoint(
            f"a tensor chunk's record does not unpickle as a plain tensor ({err}); it is damaged or crafted"
        ) from err
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpoint(f"a tensor chunk's record holds a {type(tensor).__name__}, not a tensor")
    return tensor
