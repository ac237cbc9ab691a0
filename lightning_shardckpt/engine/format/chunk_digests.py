"""A signed v5 shard file checked whole against its part's chunk digests (FORMAT.md §12.2), for the tools that
check every file (`shardckpt verify --public-key`, exports, a replicator's copy): the chunks tile the file, so their
digests bind every byte of it, and the file is read once, front to back, each chunk hashed as it streams.

A resume never comes here: each rank hashes the chunks it reads as it reads them (storage/reader.py).
"""

from __future__ import annotations

from typing import Any

from . import part_references
from .checksum import ChunkHasher
from .manifest_schema import BLOCKS_FIELD
from .names import join
from .parts import BLOCK_DIGESTS, DIGEST, OBJECTS, TENSOR_CHUNKS

READ_BYTES = 8 * 2**20  # one read: hashed while it is in cache


def shard_chunk_problem(fs: Any, path: str, part: dict[str, Any], algorithm: str) -> tuple[str | None, int]:
    """(the first chunk of `path` whose bytes differ from its `digest` in `part`, or None; the bytes hashed).
    `part` was checked already: its chunks tile the file and each has a digest (parts.undigested)."""
    own = [chunk for chunk in [*part[TENSOR_CHUNKS], *part[OBJECTS]] if not part_references.is_referenced(chunk)]
    hashed = 0
    with fs.open(path, "rb") as handle:
        for chunk in sorted(own, key=lambda chunk: chunk["offset"]):
            problem, nbytes = _chunk_problem(handle, chunk, algorithm)
            hashed += nbytes
            if problem is not None:
                return problem, hashed
        if handle.read(1):
            return f"bytes past the {part['file_bytes']} its part lists", hashed
    return None, hashed


def referenced_chunk_problem(
    fs: Any, directory: str, part: dict[str, Any], algorithm: str
) -> tuple[str | None, str | None, int]:
    """An incremental part's referenced chunks (FORMAT.md §10.6), each read from its sibling's file where the part
    says and checked against the digests the part records: (the first file whose chunk differs and that chunk, or
    (None, None); the bytes hashed). Only the referenced ranges are read: the holder's other chunks are its own."""
    from .safe_pickle import check_inside

    hashed = 0
    referenced = [
        part_references.resolve(chunk, part) for chunk in part[TENSOR_CHUNKS] if part_references.is_referenced(chunk)
    ]
    for chunk in sorted(referenced, key=lambda chunk: (chunk["file"], chunk["offset"])):
        check_inside(fs, directory, chunk["file"])  # one sibling of the same root, never further
        path = join(directory, chunk["file"])
        try:
            with fs.open(path, "rb") as handle:
                handle.seek(chunk["offset"])
                problem, nbytes = _chunk_problem(handle, chunk, algorithm)
        except FileNotFoundError:
            return path, f"{chunk['fqn']!r}: the referenced file is missing", hashed
        hashed += nbytes
        if problem is not None:
            return path, problem, hashed
    return None, None, hashed


def _chunk_problem(handle: Any, chunk: dict[str, Any], algorithm: str) -> tuple[str | None, int]:
    """One chunk read from `handle`'s position and hashed as it streams: (what differs or None, bytes hashed)."""
    blocks = chunk.get(BLOCKS_FIELD)
    hasher = ChunkHasher(blocks["size"] if isinstance(blocks, dict) else None, algorithm)
    remaining, hashed = chunk["length"], 0
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
    return None, hashed
