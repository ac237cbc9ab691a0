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


def checksum_of_checksums(digests: list[str]) -> str:
    """A file's checksum: the digest of its chunk digests in offset order (its chunks tile the file)."""
    return xxhash.xxh3_64("".join(digests).encode()).hexdigest()


class HashingWriter:
    """A write-only binary stream that forwards to `raw` and checksums each chunk as it passes.

    `torch.save` streams its zip records through `write`; hashing in the same pass means the bytes are
    read from memory once, and the checksum describes exactly what was handed to storage.
    """

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._position = 0
        self._hasher = xxhash.xxh3_64()
        self._chunk_start = 0

    def begin_chunk(self) -> None:
        self._hasher.reset()
        self._chunk_start = self._position

    def end_chunk(self) -> tuple[int, int, str]:
        """Return (offset, length, checksum) of the bytes written since `begin_chunk`."""
        return self._chunk_start, self._position - self._chunk_start, self._hasher.hexdigest()

    # --- the file-like surface torch.save needs ---
    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._hasher.update(view)
        written = self._raw.write(view)
        size = view.nbytes
        if written is not None and written != size:
            raise OSError(f"short write: {written} of {size} bytes")
        self._position += size
        return size

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False
