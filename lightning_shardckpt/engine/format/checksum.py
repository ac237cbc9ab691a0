"""Chunk checksums: xxh3-64, computed while bytes stream to storage and again whenever they are read."""

from __future__ import annotations

from typing import Any, BinaryIO

import xxhash


def checksum(data: Any) -> str:
    """Hex digest of a bytes-like object."""
    return xxhash.xxh3_64(data).hexdigest()


def streaming_checksum() -> Any:
    """A hasher fed piece by piece (`update`, then `hexdigest`): equals `checksum` of the pieces joined."""
    return xxhash.xxh3_64()


# Block checksums let a rank that needs part of a large chunk (a resharded restore: 2 saved ranks -> 4)
# read and check only the blocks holding its rows, instead of the whole chunk for one whole-chunk checksum.
# Blocks tile the chunk from its first byte; a chunk has at most MAX_BLOCKS_PER_CHUNK of them, so the
# manifest grows by at most that many digests per chunk, and a rank reads at most two blocks it does not
# need per chunk it needs part of (the record's headers, at both ends of the chunk, are always checked).
BLOCK_MIN_BYTES = 2**20
MAX_BLOCKS_PER_CHUNK = 64
BLOCKED_CHUNK_MIN_BYTES = 4 * BLOCK_MIN_BYTES  # below this a chunk is read whole: one checksum is enough
WRITE_PIECE_BYTES = 2**20  # HashingWriter hashes and forwards a large write in pieces that stay in cache


def block_size_for(nbytes: int) -> int | None:
    """The block size for a chunk of about `nbytes` (a power of two), or None for a chunk read whole."""
    if nbytes < BLOCKED_CHUNK_MIN_BYTES:
        return None
    size = BLOCK_MIN_BYTES
    while size * MAX_BLOCKS_PER_CHUNK < nbytes:
        size *= 2
    return size


def checksum_of_checksums(digests: list[str]) -> str:
    """A file's checksum: the digest of its chunk digests in offset order (its chunks tile the file)."""
    return xxhash.xxh3_64("".join(digests).encode()).hexdigest()


class HashingWriter:
    """A write-only binary stream that forwards to `raw` and checksums each chunk as it passes.

    `torch.save` streams its zip records through `write`; hashing in the same pass means the bytes are
    read from memory once, and the checksum describes exactly what was handed to storage.
    """

    def __init__(self, raw: BinaryIO, file_digest: Any = None) -> None:
        """`file_digest` (signing on): a hashlib-style hasher fed every byte of the file in the same pass."""
        self._raw = raw
        self._file_digest = file_digest
        self._position = 0
        self._hasher = xxhash.xxh3_64()
        self._chunk_start = 0
        self._block_size: int | None = None
        self._block_hasher = xxhash.xxh3_64()
        self._block_filled = 0
        self._blocks: list[str] = []

    def begin_chunk(self, block_size: int | None = None) -> None:
        """Start a chunk; with `block_size`, also checksum each `block_size` bytes of it (block_size_for)."""
        self._hasher.reset()
        self._chunk_start = self._position
        self._block_size, self._block_filled, self._blocks = block_size, 0, []
        self._block_hasher.reset()

    def end_chunk(self) -> tuple[int, int, str]:
        """Return (offset, length, checksum) of the bytes written since `begin_chunk`."""
        if self._block_size is not None and self._block_filled:
            self._blocks.append(self._block_hasher.hexdigest())
        return self._chunk_start, self._position - self._chunk_start, self._hasher.hexdigest()

    @property
    def chunk_blocks(self) -> tuple[int, tuple[str, ...]] | None:
        """(block size, digests) of the chunk just ended, or None when it was not checksummed by block."""
        return (self._block_size, tuple(self._blocks)) if self._block_size is not None else None

    def _hash_blocks(self, view: memoryview) -> None:
        assert self._block_size is not None
        start = 0
        while start < len(view):
            take = min(len(view) - start, self._block_size - self._block_filled)
            self._block_hasher.update(view[start : start + take])
            self._block_filled += take
            start += take
            if self._block_filled == self._block_size:
                self._blocks.append(self._block_hasher.hexdigest())
                self._block_hasher.reset()
                self._block_filled = 0

    # --- the file-like surface torch.save needs ---
    def write(self, data: Any) -> int:
        # piece by piece: the chunk hash, the block hash and the copy to storage then read each piece while
        # it is still in cache, instead of three passes over a tensor's bytes from memory (-25% CPU here)
        view = memoryview(data).cast("B")
        size = view.nbytes
        for start in range(0, size, WRITE_PIECE_BYTES):
            piece = view[start : start + WRITE_PIECE_BYTES]
            self._hasher.update(piece)
            if self._block_size is not None:
                self._hash_blocks(piece)
            if self._file_digest is not None:
                self._file_digest.update(piece)  # hashlib drops the GIL on a 1 MiB piece
            written = self._raw.write(piece)
            if written is not None and written != piece.nbytes:
                raise OSError(f"short write: {written} of {piece.nbytes} bytes")
        self._position += size
        return size

    def tell(self) -> int:
        return self._position

    @property
    def file_digest(self) -> str | None:
        """The hex digest of every byte written so far, when a file digest was asked for."""
        return None if self._file_digest is None else self._file_digest.hexdigest()

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False
