"""A signed v5 shard file checked whole against its part's chunk digests (FORMAT.md §12.2), for the tools that
check every file (`shardckpt verify --public-key`, exports, a replicator's copy): the chunks tile the file, so their
digests bind every byte of it, and the file is read once, front to back, each chunk hashed as it streams.

A resume never comes here: each rank hashes the chunks it reads as it reads them (storage/reader.py).
"""

from __future__ import annotations

from typing import Any

from .checksum import ChunkHasher
from .manifest_schema import BLOCKS_FIELD
from .parts import BLOCK_DIGESTS, DIGEST, OBJECTS, TENSOR_CHUNKS

READ_BYTES = 8 * 2**20  # one read: hashed while it is in cache


def shard_chunk_problem(fs: Any, path: str, part: dict[str, Any], algorithm: str) -> tuple[str | None, int]:
    """(the first chunk of `path` whose bytes differ from its `digest` in `part`, or None; the bytes hashed).
    `part` was checked already: its chunks tile the file and each has a digest (parts.undigested)."""
    chunks = sorted([*part[TENSOR_CHUNKS], *part[OBJECTS]], key=lambda chunk: chunk["offset"])
    hashed = 0
    with fs.open(path, "rb") as handle:
        for chunk in chunks:
            blocks = chunk.get(BLOCKS_FIELD)
            hasher = ChunkHasher(blocks["size"] if isinstance(blocks, dict) else None, algorithm)
            remaining = chunk["length"]
            while remaining:
                piece = handle.read(min(READ_BYTES, remaining))
                if not piece:
                    return f"{chunk['fqn']!r} at byte {chunk['offset']}: the file ends early", hashed
                hasher.update(piece)
                hashed += len(piece)
                remaining -= len(piece)
            hasher.hexdigest()  # ends the last block
            if isinstance(blocks, dict) and list(hasher.crypto_blocks) != list(blocks[BLOCK_DIGESTS]):
                return f"a block of {chunk['fqn']!r} at byte {chunk['offset']}", hashed
            if hasher.crypto_digest() != chunk[DIGEST]:
                return f"{chunk['fqn']!r} at byte {chunk['offset']}", hashed
        if handle.read(1):
            return f"bytes past the {part['file_bytes']} its part lists", hashed
    return None, hashed
