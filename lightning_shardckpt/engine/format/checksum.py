"""Chunk checksums: xxh3-64, computed while bytes stream to storage and again whenever they are read.

Two algorithms name what a chunk's `checksum` is (FORMAT.md §3), recorded as the manifest's `checksum_algorithm`:
- `xxh3_64` (written before issue 36): the xxh3 of the chunk's bytes, even for a chunk checksummed by block too;
- `xxh3_64_blocks` (written now): the same for a chunk without blocks; for a chunk checksummed by block, the digest
  of its block digests (`checksum_of_checksums`), so the writer hashes each byte once, not twice.
A reader checks a chunk the same way under both (`ChunkCheck.of`): by its block digests when it has them (they mean
the same in both), else by the xxh3 of its bytes.
"""

from __future__ import annotations

from typing import Any, BinaryIO

import xxhash

from .file_digests import digest_of, new_digest


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


def checksum_of_checksums(digests: list[str] | tuple[str, ...]) -> str:
    """A file's checksum: the digest of its chunk digests in offset order (its chunks tile the file); under
    `xxh3_64_blocks` also a blocked chunk's checksum: the digest of its block digests in order (blocks tile it)."""
    return xxhash.xxh3_64("".join(digests).encode()).hexdigest()


class ChunkHasher:
    """Fed a chunk's bytes in order, in pieces of any size: `hexdigest()` is the chunk's checksum as
    `xxh3_64_blocks` defines it (with `block_size`: the digest of its block digests; without: the xxh3).

    With `block_size`, `blocks` holds the digest of every block completed so far (the last, partial one
    is added by `hexdigest`).

    With `crypto` (a signed v5 checkpoint's digest algorithm, "blake3" or "sha256"), the same bytes also feed a
    cryptographic digest in the same pass, by the same rule (FORMAT.md §12.2): `crypto_digest()` is the digest of
    the chunk's bytes, or with `block_size` the digest of its block digests (`crypto_blocks`, one per block).
    """

    def __init__(self, block_size: int | None = None, crypto: str | None = None) -> None:
        self.block_size = block_size
        self._hasher = xxhash.xxh3_64()
        self._filled = 0
        self.blocks: list[str] = []
        self.crypto = crypto
        self._crypto = new_digest(crypto) if crypto is not None else None
        self.crypto_blocks: list[str] = []

    def reset(self, block_size: int | None = None, crypto: str | None = None) -> None:
        self.block_size, self._filled, self.blocks = block_size, 0, []
        self._hasher.reset()
        self.crypto, self.crypto_blocks = crypto, []
        self._crypto = new_digest(crypto) if crypto is not None else None

    def update(self, data: Any) -> None:
        if self.block_size is None:
            self._hasher.update(data)
            if self._crypto is not None:
                self._crypto.update(data)
            return
        view = memoryview(data).cast("B")
        start = 0
        while start < len(view):
            take = min(len(view) - start, self.block_size - self._filled)
            self._hasher.update(view[start : start + take])
            if self._crypto is not None:
                self._crypto.update(view[start : start + take])
            self._filled += take
            start += take
            if self._filled == self.block_size:
                self._end_block()

    def _end_block(self) -> None:
        self.blocks.append(self._hasher.hexdigest())
        self._hasher.reset()
        self._filled = 0
        if self._crypto is not None and self.crypto is not None:
            self.crypto_blocks.append(self._crypto.hexdigest())
            self._crypto = new_digest(self.crypto)  # hashlib's digests have no reset

    def finish_blocks(self) -> tuple[str, ...]:
        """Every block digest, the last (partial) block's included; call once, after the last byte."""
        if self._filled:
            self._end_block()
        return tuple(self.blocks)

    def crypto_digest(self) -> str | None:
        """The chunk's cryptographic digest (None without `crypto`): of its bytes, or with `block_size` of its
        block digests' hex text joined (`crypto_of_blocks`); call after the last byte (after `hexdigest`)."""
        if self._crypto is None or self.crypto is None:
            return None
        if self.block_size is None:
            return self._crypto.hexdigest()
        self.finish_blocks()
        return crypto_of_blocks(self.crypto_blocks, self.crypto)

    def hexdigest(self) -> str:
        if self.block_size is None:
            return self._hasher.hexdigest()
        return checksum_of_checksums(self.finish_blocks())


def crypto_of_blocks(digests: list[str] | tuple[str, ...], algorithm: str) -> str:
    """A blocked chunk's cryptographic digest in a signed v5 part: the digest of its block digests' hex text,
    joined in order (as `checksum_of_checksums` is for xxh3), so each byte is hashed once and a reader of some
    blocks checks each against its own digest."""
    return digest_of("".join(digests).encode(), algorithm)


def chunk_checksum(data: Any, block_size: int | None = None) -> str:
    """The checksum of a chunk's bytes as ChunkHasher defines it."""
    hasher = ChunkHasher(block_size)
    hasher.update(data)
    return hasher.hexdigest()


class ChunkCheck:
    """How a reader checks one chunk's bytes, the same under both algorithms: hash them with
    `ChunkHasher(block_size)` and compare with `expected`.

    A chunk with block digests is checked by them: `expected` is the digest of the recorded block digests,
    which every block of the bytes read must match for the digest of the read ones to equal it (a
    `xxh3_64` checkpoint records the same block digests; its chunk `checksum`, the xxh3 of the bytes, is
    then not needed). A chunk without them is checked by its `checksum`, the xxh3 of its bytes in both.
    """

    __slots__ = ("expected", "block_size")

    def __init__(self, expected: str, block_size: int | None) -> None:
        self.expected, self.block_size = expected, block_size

    @classmethod
    def of(cls, checksum: str, blocks: tuple[int, Any] | None) -> ChunkCheck:
        """From a chunk record's `checksum` and its block record as (size, digests), or None."""
        if blocks is None:
            return cls(checksum, None)
        return cls(checksum_of_checksums(list(blocks[1])), blocks[0])

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> ChunkCheck:
        """From a chunk record (`checksum`, optional `blocks: {size, checksums}`, FORMAT.md §3)."""
        blocks = record.get("blocks")
        return cls.of(record["checksum"], (blocks["size"], blocks["checksums"]) if blocks else None)

    def hasher(self) -> ChunkHasher:
        return ChunkHasher(self.block_size)

    def actual(self, data: Any) -> str:
        return chunk_checksum(data, self.block_size)


class HashingWriter:
    """A write-only binary stream that forwards to `raw` and checksums each chunk as it passes.

    `torch.save` streams its zip records through `write`; hashing in the same pass means the bytes are
    read from memory once, and the checksum describes exactly what was handed to storage.
    """

    def __init__(self, raw: BinaryIO, file_digest: Any = None, chunk_digest: str | None = None) -> None:
        """`file_digest` (signing on, format v4): a hashlib-style hasher fed every byte of the file in the same
        pass. `chunk_digest` (signing on, format v5): the algorithm of each chunk's own cryptographic digest."""
        self._raw = raw
        self._file_digest = file_digest
        self._chunk_digest = chunk_digest
        self._position = 0
        self._chunk_start = 0
        self._hasher = ChunkHasher()
        self._blocks: tuple[str, ...] | None = None
        self._crypto: tuple[str, tuple[str, ...] | None] | None = None

    def begin_chunk(self, block_size: int | None = None) -> None:
        """Start a chunk; with `block_size`, checksum each `block_size` bytes of it (block_size_for) and make
        the chunk's checksum the digest of those (`xxh3_64_blocks`): every byte is hashed once."""
        self._hasher.reset(block_size, self._chunk_digest)
        self._chunk_start = self._position
        self._blocks = None
        self._crypto = None

    def end_chunk(self) -> tuple[int, int, str]:
        """Return (offset, length, checksum) of the bytes written since `begin_chunk`."""
        if self._hasher.block_size is not None:
            self._blocks = self._hasher.finish_blocks()
        digest = self._hasher.hexdigest()
        crypto = self._hasher.crypto_digest()
        if crypto is not None:
            blocks = tuple(self._hasher.crypto_blocks) if self._hasher.block_size is not None else None
            self._crypto = (crypto, blocks)
        return self._chunk_start, self._position - self._chunk_start, digest

    @property
    def chunk_crypto(self) -> tuple[str, tuple[str, ...] | None] | None:
        """(cryptographic digest, block digests or None) of the chunk just ended; None without `chunk_digest`."""
        return self._crypto

    @property
    def chunk_blocks(self) -> tuple[int, tuple[str, ...]] | None:
        """(block size, digests) of the chunk just ended, or None when it was not checksummed by block."""
        block_size = self._hasher.block_size
        return (block_size, self._blocks) if block_size is not None and self._blocks is not None else None

    # --- the file-like surface torch.save needs ---
    def write(self, data: Any) -> int:
        # piece by piece: the hash (one: a blocked chunk's checksum is made of its block digests) and the
        # copy to storage then read each piece while it is still in cache, not two passes over memory
        view = memoryview(data).cast("B")
        size = view.nbytes
        for start in range(0, size, WRITE_PIECE_BYTES):
            piece = view[start : start + WRITE_PIECE_BYTES]
            self._hasher.update(piece)
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
