"""A rank's part (format v4): the record of every chunk it wrote, written beside its shard file.

Each rank that wrote a shard file `__<r>_0.distcp` writes `__<r>_0.part.json` after it: the file's size and
checksum, and per chunk its place in the global tensor (`fqn`, `offsets`, `sizes`), its byte range in the file
(`offset`, `length`), its checksum (and block checksums of a large chunk) and whether it was finite. The
committed manifest lists each part's size and checksum, so a part is as trustworthy as the manifest, and a
reader reads only the parts holding what it needs. A part without a manifest commits nothing: a torn part is
as invisible as a torn shard.

Parsing is bounded per part (PART_MAX_BYTES), never per checkpoint: no checkpoint is too large to read.
"""

from __future__ import annotations

import json
from typing import Any, TypeGuard

from . import bounded_json, digest_column, part_references
from .checksum import checksum_of_checksums
from .digest_column import BLOCK_DIGESTS as BLOCK_DIGESTS  # signed v5 (FORMAT.md §12.2), re-exported for readers
from .digest_column import DIGEST as DIGEST
from .digest_column import is_crypto_hex
from .manifest_schema import BLOCKS_FIELD, HEX_DIGEST, blocks_problems, is_int, relative_path_problem

PART_VERSION = 1
PART_SUFFIX = ".part.json"
# a part holds ~150 bytes per chunk it lists: 256 MiB is ~1.7 M chunks on one rank, far beyond any rank's share
PART_MAX_BYTES = 256 * 2**20
TENSOR_CHUNKS, OBJECTS = "chunks", "objects"
FINITE_FIELD = "finite"


def part_filename(rank: int) -> str:
    """`__<rank>_0.part.json`: the part of the shard file `__<rank>_0.distcp` (layout.shard_filename)."""
    return f"__{rank}_0{PART_SUFFIX}"


def build_part(
    *,
    checkpoint_id: str,
    rank: int,
    file: str,
    file_bytes: int,
    tensor_chunks: list[dict[str, Any]],
    objects: list[dict[str, Any]],
    verification: dict[str, Any],
    write_s: float | None = None,
) -> dict[str, Any]:
    """A rank's part: its file (size, checksum of its chunks' checksums in file order) and every chunk in it (an
    incremental save's referenced chunks too, given with their holder's `file` and `file_bytes`: their bytes are in a
    sibling's file, listed once in the part's `holders`, part_references.py)."""
    holders, tensor_chunks = part_references.compact(tensor_chunks)
    in_file_order = _own_in_file_order(tensor_chunks + objects)
    part = {
        "part_version": PART_VERSION,
        "checkpoint_id": checkpoint_id,
        "rank": rank,
        "file": file,
        "file_bytes": file_bytes,
        "file_checksum": checksum_of_checksums([chunk["checksum"] for chunk in in_file_order]),
        TENSOR_CHUNKS: tensor_chunks,
        OBJECTS: objects,
        "verification": verification,
        "write_s": write_s,
    }
    if holders:
        part[part_references.HOLDERS] = holders
    return part


def to_bytes(part: dict[str, Any]) -> bytes:
    # compact: a part is read by machines; indent=1 would also force the pure-Python encoder (5x slower); a signed
    # part's digests as one binary column (digest_column.py)
    stored = digest_column.pack(part)
    return (json.dumps(stored, sort_keys=True, separators=(",", ":")) + "\n").encode()


def parse(data: bytes, where: str, *, checkpoint_id: str | None = None, rank: int | None = None) -> dict[str, Any]:
    """Parse and validate a part; ValueError (the caller names the checkpoint as corrupt) naming what is wrong."""
    try:
        part = bounded_json.loads(data, PART_MAX_BYTES, schema_checked=(TENSOR_CHUNKS, OBJECTS))
    except bounded_json.UnreadableJson as err:
        raise ValueError(f"{where}: part is {err}") from err
    if not isinstance(part, dict):
        raise ValueError(f"{where}: part is not a JSON object")
    try:
        digest_column.unpack(part)
    except ValueError as err:
        raise ValueError(f"{where}: part is invalid: {err}") from err
    problems = part_problems(part, checkpoint_id=checkpoint_id, rank=rank)
    if problems:
        raise ValueError(f"{where}: part is invalid: " + "; ".join(problems[:5]) + (" …" if len(problems) > 5 else ""))
    return part


def part_problems(part: dict[str, Any], *, checkpoint_id: str | None, rank: int | None) -> list[str]:
    """Every rule of FORMAT.md §10.2 a reader relies on; empty when the part is sound."""
    problems = []
    if part.get("part_version") != PART_VERSION:
        problems.append(f"part_version is {part.get('part_version')!r}; this reader reads {PART_VERSION}")
        return problems
    if checkpoint_id is not None and part.get("checkpoint_id") != checkpoint_id:
        problems.append(f"checkpoint_id {part.get('checkpoint_id')!r} is not this checkpoint's ({checkpoint_id!r})")
    if rank is not None and part.get("rank") != rank:
        problems.append(f"rank {part.get('rank')!r} is not the rank its name says ({rank})")
    path_problem = relative_path_problem(part.get("file"))
    if path_problem:
        problems.append(f"file: {path_problem}")
    if not is_int(part.get("file_bytes")) or part["file_bytes"] < 0:
        problems.append(f"file_bytes is {part.get('file_bytes')!r}, not an integer >= 0")
    if not _digest(part.get("file_checksum")):
        problems.append(f"file_checksum {part.get('file_checksum')!r} is not 16 lowercase hex characters")
    for table in (TENSOR_CHUNKS, OBJECTS):
        if not isinstance(part.get(table), list):
            problems.append(f"{table} is not a list")
    if problems:
        return problems
    for index, chunk in enumerate(part[TENSOR_CHUNKS]):
        problems.extend(f"chunks[{index}]: {p}" for p in _chunk_problems(chunk, tensor=True))
        if len(problems) > 5:
            return problems
    for index, chunk in enumerate(part[OBJECTS]):
        problems.extend(f"objects[{index}]: {p}" for p in _chunk_problems(chunk, tensor=False))
        if len(problems) > 5:
            return problems
    if problems:
        return problems
    problems = part_references.part_problems(part)  # an incremental part's holders (FORMAT.md §10.6)
    return problems or _tiling_problems(part)


def tensor_index(part: dict[str, Any]) -> dict[tuple[str, tuple[int, ...]], dict[str, Any]]:
    """(fqn, offsets) -> tensor chunk record, for finding the chunks a layout names."""
    return {(chunk["fqn"], tuple(chunk["offsets"])): chunk for chunk in part[TENSOR_CHUNKS]}


def object_index(part: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {chunk["fqn"]: chunk for chunk in part[OBJECTS]}


def _chunk_problems(chunk: Any, *, tensor: bool) -> list[str]:
    if not isinstance(chunk, dict):
        return [f"{chunk!r} is not an object"]
    problems = []
    if not isinstance(chunk.get("fqn"), str):
        problems.append(f"fqn is {chunk.get('fqn')!r}, not a string")
    for name in ("offset", "length"):
        if not is_int(chunk.get(name)) or chunk[name] < 0:
            problems.append(f"{name} is {chunk.get(name)!r}, not an integer >= 0")
    if not _digest(chunk.get("checksum")):
        problems.append(f"checksum {chunk.get('checksum')!r} is not 16 lowercase hex characters")
    if tensor:
        offsets, sizes = chunk.get("offsets"), chunk.get("sizes")
        if not (_ints(offsets) and _ints(sizes) and len(offsets) == len(sizes)):
            problems.append("offsets and sizes must be lists of integers >= 0 of one length")
        if FINITE_FIELD in chunk and not isinstance(chunk[FINITE_FIELD], bool):
            problems.append(f"finite is {chunk[FINITE_FIELD]!r}, not true or false")
        if BLOCKS_FIELD in chunk:
            problems.extend(blocks_problems(chunk[BLOCKS_FIELD], chunk.get("length")))
    if DIGEST in chunk:
        problems.extend(chunk_digest_problems(chunk))
    return problems


def chunk_digest_problems(chunk: dict[str, Any]) -> list[str]:
    """A signed v5 chunk record's digests (FORMAT.md §12.2): `digest`, 64 lowercase hex characters, and for a
    chunk checksummed by block one digest per block in `blocks.digests`. Empty when sound."""
    if not is_crypto_hex(chunk.get(DIGEST)):
        return [f"digest {chunk.get(DIGEST)!r} is not 64 lowercase hex characters"]
    blocks = chunk.get(BLOCKS_FIELD)
    if isinstance(blocks, dict):
        digests, checksums = blocks.get(BLOCK_DIGESTS), blocks.get("checksums")
        if not (isinstance(digests, list) and all(is_crypto_hex(d) for d in digests)):
            return [f"{BLOCKS_FIELD}.{BLOCK_DIGESTS} is not a list of 64-hex-character digests"]
        if isinstance(checksums, list) and len(digests) != len(checksums):
            return [f"{BLOCKS_FIELD} has {len(checksums)} checksum(s) and {len(digests)} digest(s)"]
    return []


def undigested(part: dict[str, Any]) -> str | None:
    """The first chunk of a part that records no cryptographic digest (a signed v5 part must digest every chunk
    and object, FORMAT.md §12.2), as `fqn @ offset`; None when every chunk has one."""
    for chunk in [*part[TENSOR_CHUNKS], *part[OBJECTS]]:
        blocks = chunk.get(BLOCKS_FIELD)
        if DIGEST not in chunk or (isinstance(blocks, dict) and BLOCK_DIGESTS not in blocks):
            return f"{chunk['fqn']!r} at byte {chunk['offset']}"
    return None


def _tiling_problems(part: dict[str, Any]) -> list[str]:
    """The chunks tile the file: sorted by offset, each starts where the last ended, the last ends at its size;
    and the file checksum is the digest of their checksums in that order (FORMAT.md §3). Referenced chunks are in
    a sibling's file, not this one (§10.6)."""
    chunks = _own_in_file_order(part[TENSOR_CHUNKS] + part[OBJECTS])
    position = 0
    for chunk in chunks:
        if chunk["offset"] != position:
            return [f"bytes {position}..{chunk['offset']} of {part['file']} are in no chunk, or chunks overlap"]
        position += chunk["length"]
    if position != part["file_bytes"]:
        return [f"the chunks cover {position} bytes, the file has {part['file_bytes']}"]
    if checksum_of_checksums([chunk["checksum"] for chunk in chunks]) != part["file_checksum"]:
        return ["file_checksum is not the digest of the chunks' checksums in file order"]
    return []


def _own_in_file_order(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chunks whose bytes are in the part's own file, by offset."""
    own = [chunk for chunk in chunks if not part_references.is_referenced(chunk)]
    return sorted(own, key=lambda chunk: chunk["offset"])


def _digest(value: Any) -> bool:
    return isinstance(value, str) and HEX_DIGEST.match(value) is not None


def _ints(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(is_int(item) and item >= 0 for item in value)
