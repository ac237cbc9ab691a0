"""A signed v5 part's chunk digests as one binary column (FORMAT.md §12.2): how they are stored, not what they are.

In memory every record keeps its `digest` (and a blocked chunk its `blocks.digests`) as 64 lowercase hex
characters, the form the signing chain is defined in. On storage the writer moves them into one base64 string,
`digest_column`: 32 bytes per digest instead of the 75 a `"digest":"<64 hex>",` member costs. A resharded rank
reads whole parts (every record overlaps what it holds), so this column is the part of a signed resume's reads
that signing adds: 44 bytes per chunk instead of 76 (FORMAT.md §12.2 has the arithmetic).

The column is read back into the records before anything validates or uses them, so every reader sees the
in-memory form; a part written before the column (digests in the records) reads unchanged.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from .manifest_schema import BLOCKS_FIELD

DIGEST_COLUMN = "digest_column"
DIGEST_BYTES = 32  # BLAKE3 and SHA-256 alike
# a record's digest and a blocked chunk's per block, in memory (FORMAT.md §12.2)
DIGEST, BLOCK_DIGESTS = "digest", "digests"
CRYPTO_HEX = re.compile(r"[0-9a-f]{64}")
_CHECKSUMS = "checksums"


def records_in_column_order(part: dict[str, Any]) -> list[dict[str, Any]]:
    """The records whose digests the column holds, in its order: `chunks` as listed, then `objects`."""
    return [*part["chunks"], *part["objects"]]


def pack(part: dict[str, Any]) -> dict[str, Any]:
    """`part` as stored: when every record has its digest(s), a copy with them moved into `digest_column`
    (record order; per record its `digest`, then its `blocks.digests` in order); otherwise `part` itself."""
    records = records_in_column_order(part)
    if not records or not all(_has_digests(record) for record in records):
        return part
    column = bytearray()
    stored = []
    for record in records:
        column += bytes.fromhex(record[DIGEST])
        stripped = {key: value for key, value in record.items() if key != DIGEST}
        blocks = record.get(BLOCKS_FIELD)
        if isinstance(blocks, dict):
            for digest in blocks[BLOCK_DIGESTS]:
                column += bytes.fromhex(digest)
            stripped[BLOCKS_FIELD] = {key: value for key, value in blocks.items() if key != BLOCK_DIGESTS}
        stored.append(stripped)
    count = len(part["chunks"])
    return {
        **part,
        "chunks": stored[:count],
        "objects": stored[count:],
        DIGEST_COLUMN: base64.b64encode(bytes(column)).decode("ascii"),
    }


def unpack(part: dict[str, Any]) -> dict[str, Any]:
    """`part` as every reader uses it: `digest_column` (if any) moved back into the records, in place.
    ValueError naming what is wrong when the column does not fit the records (the caller names the file)."""
    if DIGEST_COLUMN not in part:
        return part
    encoded = part.pop(DIGEST_COLUMN)
    if not isinstance(encoded, str):
        raise ValueError(f"{DIGEST_COLUMN} is {type(encoded).__name__}, not a base64 string")
    try:
        column = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"{DIGEST_COLUMN} is not base64 ({err})") from err
    if not (isinstance(part.get("chunks"), list) and isinstance(part.get("objects"), list)):
        return part  # the part's own checks name the missing tables
    records = records_in_column_order(part)
    wanted = sum(_digests_in(record) for record in records)
    if len(column) != wanted * DIGEST_BYTES:
        raise ValueError(
            f"{DIGEST_COLUMN} holds {len(column)} bytes; its {len(records)} records need "
            f"{wanted} digests of {DIGEST_BYTES} bytes ({wanted * DIGEST_BYTES})"
        )
    at = 0

    def take() -> str:
        nonlocal at
        at += DIGEST_BYTES
        return column[at - DIGEST_BYTES : at].hex()

    for record in records:
        if DIGEST in record or (isinstance(record.get(BLOCKS_FIELD), dict) and BLOCK_DIGESTS in record[BLOCKS_FIELD]):
            raise ValueError(f"record {record.get('fqn')!r} holds its own digest beside {DIGEST_COLUMN}")
        record[DIGEST] = take()
        blocks = record.get(BLOCKS_FIELD)
        if isinstance(blocks, dict):
            blocks[BLOCK_DIGESTS] = [take() for _ in blocks[_CHECKSUMS]]
    return part


def _has_digests(record: dict[str, Any]) -> bool:
    """Whether `record` holds digests the column can carry exactly: anything else stays in the record, where the
    part's checks name it."""
    blocks = record.get(BLOCKS_FIELD)
    if not is_crypto_hex(record.get(DIGEST)):
        return False
    if not isinstance(blocks, dict):
        return True
    digests, checksums = blocks.get(BLOCK_DIGESTS), blocks.get(_CHECKSUMS)
    return (
        isinstance(digests, list)
        and isinstance(checksums, list)
        and len(digests) == len(checksums)
        and all(is_crypto_hex(digest) for digest in digests)
    )


def is_crypto_hex(value: Any) -> bool:
    return isinstance(value, str) and CRYPTO_HEX.fullmatch(value) is not None


def _digests_in(record: Any) -> int:
    """How many digests the column holds for `record`: its own, and one per block checksum of a blocked chunk."""
    if not isinstance(record, dict):
        raise ValueError(f"{record!r} is not an object")
    blocks = record.get(BLOCKS_FIELD)
    if not isinstance(blocks, dict):
        return 1
    checksums = blocks.get(_CHECKSUMS)
    if not isinstance(checksums, list):
        raise ValueError(f"record {record.get('fqn')!r}: blocks.checksums is not a list")
    return 1 + len(checksums)
