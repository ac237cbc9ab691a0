"""The tables of a format-v4 manifest: tensors with their layout, objects with their rank, and the parts.

A v4 manifest is small and per checkpoint: each tensor once (fqn, shape, dtype, `layout`: chunk_layout.py),
each object once (fqn and the `rank` whose part holds it), and the `parts` table: per rank of the save, the
size and checksum of its shard file and of its part (parts.py), or nothing for a rank that wrote nothing.
Names follow from the rank (`__<r>_0.distcp`, `__<r>_0.part.json`), so the table holds numbers only, and the
checksums of a column are one string of 16 hex characters per rank: ~0.8 MB at 16,384 ranks. Chunks live
in the parts; a reader finds a tensor's chunks through its layout and reads only the parts of the ranks
that wrote them.
"""

from __future__ import annotations

from typing import Any

from . import chunk_layout, part_references
from .checksum import checksum_of_checksums
from .file_digests import DIGEST_CHARS as CRYPTO_CHARS  # signed: the fifth column, 64 hex characters a rank
from .file_digests import NO_DIGEST as NO_CRYPTO
from .file_digests import PART_DIGESTS
from .manifest_schema import BLOCKS_FIELD, HEX_DIGEST, is_int, tiling_problems
from .names import CHECKSUM_ALGORITHM, shard_filename
from .parts import TENSOR_CHUNKS, part_filename

PARTS_FIELD = "parts"
LAYOUT_FIELD = "layout"
# the columns of the parts table, one entry per rank of the save (null: the rank wrote no file)
FILE_BYTES, FILE_CHECKSUMS, PART_BYTES, PART_CHECKSUMS = "file_bytes", "file_checksums", "part_bytes", "part_checksums"
# sizes: a list (null: the rank wrote no file); checksums: one string, DIGEST_CHARS per rank (NO_DIGEST: none)
SIZE_COLUMNS, DIGEST_COLUMNS = (FILE_BYTES, PART_BYTES), (FILE_CHECKSUMS, PART_CHECKSUMS)
DIGEST_CHARS = 16
NO_DIGEST = "-" * DIGEST_CHARS
SHARD, PART = "shard", "part"  # what files_of calls each file
MAX_PROBLEMS = 5


def parts_table(world_size: int, summaries: dict[int, dict[str, Any]], part_digests: bool = False) -> dict[str, Any]:
    """The `parts` table from each writing rank's {file_bytes, file_checksum, part_bytes, part_checksum}; with
    `part_digests` (signed) also the fifth column, from each summary's `part_digest` (FORMAT.md §12)."""
    table: dict[str, Any] = {"count": world_size, **{column: [None] * world_size for column in SIZE_COLUMNS}}
    digests = {column: [NO_DIGEST] * world_size for column in DIGEST_COLUMNS}
    crypto = [NO_CRYPTO] * world_size
    for rank, summary in summaries.items():
        table[FILE_BYTES][rank] = summary["file_bytes"]
        table[PART_BYTES][rank] = summary["part_bytes"]
        digests[FILE_CHECKSUMS][rank] = summary["file_checksum"]
        digests[PART_CHECKSUMS][rank] = summary["part_checksum"]
        crypto[rank] = summary.get("part_digest") or NO_CRYPTO
    table.update({column: "".join(values) for column, values in digests.items()})
    if part_digests:
        table[PART_DIGESTS] = "".join(crypto)
    return table


def digest_at(table: dict[str, Any], column: str, rank: int) -> str | None:
    """Rank `rank`'s checksum in a checksum column; None when it wrote nothing."""
    digest = table[column][rank * DIGEST_CHARS : (rank + 1) * DIGEST_CHARS]
    return None if digest == NO_DIGEST else digest


def bytes_total(manifest: dict[str, Any]) -> int:
    """The bytes of every shard file and part."""
    table = manifest[PARTS_FIELD]
    return sum(size for column in SIZE_COLUMNS for size in table[column] if size is not None)


def writing_ranks(manifest: dict[str, Any]) -> list[int]:
    """The ranks that wrote a shard file (and its part), in rank order."""
    return [rank for rank, size in enumerate(manifest[PARTS_FIELD][FILE_BYTES]) if size is not None]


def part_of(manifest: dict[str, Any], rank: int) -> tuple[str, int, str]:
    """(name, bytes, checksum) of rank `rank`'s part; KeyError when that rank wrote nothing."""
    table = manifest[PARTS_FIELD]
    if not 0 <= rank < table["count"] or table[PART_BYTES][rank] is None:
        raise KeyError(f"rank {rank} wrote no part")
    digest = digest_at(table, PART_CHECKSUMS, rank)
    if digest is None:  # a validated table pairs every size with a digest (table_problems)
        raise KeyError(f"rank {rank}'s part has a size but no checksum in {PARTS_FIELD}")
    size: int = table[PART_BYTES][rank]
    return part_filename(rank), size, digest


def files_of(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every file the checkpoint holds (shard files, then parts), as v2's `files` entries plus `kind`."""
    table = manifest[PARTS_FIELD]
    out = []
    for rank in writing_ranks(manifest):
        out.append(
            {
                "path": shard_filename(rank),
                "bytes": table[FILE_BYTES][rank],
                "checksum": digest_at(table, FILE_CHECKSUMS, rank),
                "kind": SHARD,
            }
        )
        out.append(
            {
                "path": part_filename(rank),
                "bytes": table[PART_BYTES][rank],
                "checksum": digest_at(table, PART_CHECKSUMS, rank),
                "kind": PART,
            }
        )
    return sorted(out, key=lambda item: item["path"])


def part_entry_problems(manifest: dict[str, Any], rank: int, part: dict[str, Any]) -> list[str]:
    """Where rank `rank`'s part disagrees with the manifest's record of that rank (FORMAT.md §10.2): its shard
    file is `__<rank>_0.distcp`, of the size and checksum the parts table lists. The part's own bytes were checked
    against the table already; this keeps a part from sending readers to another file."""
    table = manifest[PARTS_FIELD]
    expected = {
        "file": shard_filename(rank),
        "file_bytes": table[FILE_BYTES][rank],
        "file_checksum": digest_at(table, FILE_CHECKSUMS, rank),
    }
    problems = [
        f"{name} is {part.get(name)!r}, the manifest says {value!r}"
        for name, value in expected.items()
        if part.get(name) != value
    ]
    if manifest.get("checksum_algorithm") == CHECKSUM_ALGORITHM:
        # xxh3_64_blocks: a blocked chunk's checksum is the digest of its block digests (FORMAT.md §3); readers
        # check its bytes by the blocks, so a checksum that disagrees would make the file checksum mean nothing
        problems.extend(
            f"chunk of {chunk['fqn']!r} at byte {chunk['offset']}: checksum {chunk['checksum']} is not the digest "
            "of its block checksums, as checksum_algorithm xxh3_64_blocks requires"
            for chunk in part[TENSOR_CHUNKS]
            if BLOCKS_FIELD in chunk and chunk["checksum"] != checksum_of_checksums(chunk[BLOCKS_FIELD]["checksums"])
        )
    return problems


def layouts(manifest: dict[str, Any]) -> dict[str, chunk_layout.Layout]:
    """fqn -> parsed layout of every tensor (the manifest was validated, so each parses)."""
    return {tensor["fqn"]: chunk_layout.from_json(tensor[LAYOUT_FIELD]) for tensor in manifest["tensors"]}


def table_problems(manifest: dict[str, Any]) -> list[str]:
    """The rules of FORMAT.md §10.1 for the v4 tables; empty when they are sound."""
    problems: list[str] = []
    table = manifest.get(PARTS_FIELD)
    world = columns_problems(table, PARTS_FIELD, problems)
    if world is None or table is None:  # columns_problems named what is missing
        return problems
    writers = {rank for rank, size in enumerate(table[FILE_BYTES]) if size is not None}
    return layout_problems(manifest, world, writers)


def layout_problems(manifest: dict[str, Any], world: int, writers: set[int] | None) -> list[str]:
    """The rules of FORMAT.md §10.1 for `tensors` and `objects` of a save of `world` ranks; `writers`: the ranks
    that wrote a part, checked against the layouts (None: not known from the manifest, as in v5, whose readers
    find a rank without a part when they look it up: §10.5)."""
    problems: list[str] = []
    topology_world = (manifest.get("topology") or {}).get("world_size")
    if is_int(topology_world) and topology_world != world:
        problems.append(f"topology.world_size is {topology_world}, the parts table has {world} ranks")
    names: set[str] = set()
    for name in ("tensors", "objects"):
        if not isinstance(manifest.get(name), list):
            problems.append(f"{name} is not a list")
    if problems:
        return problems
    checked_patterns: dict[tuple, str | None] = {}
    for index, tensor in enumerate(manifest["tensors"]):
        problems.extend(f"tensors[{index}]: {p}" for p in _tensor_problems(tensor, world, writers, checked_patterns))
        if isinstance(tensor, dict) and isinstance(tensor.get("fqn"), str):
            if tensor["fqn"] in names:
                problems.append(f"tensors[{index}]: fqn {tensor['fqn']!r} is listed twice")
            names.add(tensor["fqn"])
        if len(problems) > MAX_PROBLEMS:
            return problems
    for index, item in enumerate(manifest["objects"]):
        problems.extend(f"objects[{index}]: {p}" for p in _object_problems(item, world, writers))
        if isinstance(item, dict) and isinstance(item.get("fqn"), str):
            if item["fqn"] in names:
                problems.append(f"objects[{index}]: fqn {item['fqn']!r} is listed twice")
            names.add(item["fqn"])
        if len(problems) > MAX_PROBLEMS:
            return problems
    # an incremental checkpoint's sibling files (FORMAT.md §10.6); the chunks referencing them are in the parts
    problems.extend(part_references.table_problems(manifest))
    return problems


def columns_problems(table: Any, name: str, problems: list[str]) -> int | None:
    """Checks the v4 columns of `table` (the manifest's `parts`, or a v5 group table: §10.5), appending to
    `problems`; its `count` when sound, else None."""
    if not isinstance(table, dict):
        problems.append(f"{name} is not an object")
        return None
    world = table.get("count")
    if not is_int(world) or world < 1:
        problems.append(f"{name}.count is {world!r}, not an integer >= 1")
        return None
    for column in SIZE_COLUMNS:
        if not isinstance(table.get(column), list) or len(table[column]) != world:
            problems.append(f"{name}.{column} is not a list of {world} entries")
    for column in DIGEST_COLUMNS:
        value = table.get(column)
        if not isinstance(value, str) or len(value) != world * DIGEST_CHARS:
            problems.append(f"{name}.{column} is not a string of {world} x {DIGEST_CHARS} characters")
    if problems:
        return None
    for rank, (file_bytes, part_bytes) in enumerate(zip(table[FILE_BYTES], table[PART_BYTES])):
        file_sum, part_sum = (table[c][rank * DIGEST_CHARS : (rank + 1) * DIGEST_CHARS] for c in DIGEST_COLUMNS)
        if file_bytes is None and part_bytes is None and file_sum == NO_DIGEST and part_sum == NO_DIGEST:
            continue  # this rank wrote nothing
        if not (_size(file_bytes) and _size(part_bytes) and _digest(file_sum) and _digest(part_sum)):
            problems.append(
                f"{name} rank {rank}: {[file_bytes, file_sum, part_bytes, part_sum]} is not two sizes and "
                f"two 16-hex-character checksums, nor two nulls and two {NO_DIGEST!r}"
            )
            if len(problems) > MAX_PROBLEMS:
                return None
    return world if not problems else None


def crypto_column_problems(table: dict[str, Any], name: str) -> list[str]:
    """A signed table's fifth column (FORMAT.md §12): `part_digests`, one string of 64 lowercase hex characters
    per rank that wrote, 64 `-` per rank that did not. `table`'s four columns were checked (columns_problems)."""
    value = table.get(PART_DIGESTS)
    world = table["count"]
    if not isinstance(value, str) or len(value) != world * CRYPTO_CHARS:
        return [f"{name}.{PART_DIGESTS} is not a string of {world} x {CRYPTO_CHARS} characters"]
    for rank, size in enumerate(table[PART_BYTES]):
        digest = value[rank * CRYPTO_CHARS : (rank + 1) * CRYPTO_CHARS]
        sound = digest == NO_CRYPTO if size is None else all(c in "0123456789abcdef" for c in digest)
        if not sound:
            return [f"{name}.{PART_DIGESTS} rank {rank}: {digest!r} does not fit its part (size {size})"]
    return []


def _tensor_problems(tensor: Any, world: int, writers: set[int] | None, checked: dict[tuple, str | None]) -> list[str]:
    if not isinstance(tensor, dict):
        return [f"{tensor!r} is not an object"]
    problems = []
    if not isinstance(tensor.get("fqn"), str):
        problems.append(f"fqn is {tensor.get('fqn')!r}, not a string")
    shape = tensor.get("shape")
    if not (isinstance(shape, list) and all(is_int(x) and x >= 0 for x in shape)):
        return [*problems, f"shape {shape!r} is not a list of integers >= 0"]
    if not isinstance(tensor.get("dtype"), str):
        problems.append(f"dtype is {tensor.get('dtype')!r}, not a string")
    if "finite" in tensor and not isinstance(tensor["finite"], bool):
        problems.append(f"finite is {tensor['finite']!r}, not true or false")
    value = tensor.get(LAYOUT_FIELD)
    layout_problems = chunk_layout.layout_problems(value, shape, world)
    if layout_problems:
        return problems + layout_problems
    layout = chunk_layout.from_json(value)
    if not layout.is_rule:
        boxes = [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in layout.chunks or ()]
        problems.extend(
            f"{p} (its chunks must cover every element exactly once)" for p in tiling_problems(shape, boxes)
        )
    # every recorded chunk's rank wrote a part (an empty cell has no record, so its rank may have written
    # nothing): checked once per stored pattern, however many tensors share it
    pattern = chunk_layout.stored_pattern(layout, shape)
    if writers is not None and pattern not in checked:
        stored = chunk_layout.stored_ranks_within(layout, shape, 0, world)
        silent = sorted({rank for rank in stored if rank not in writers})
        checked[pattern] = f"rank {silent[0]} holds a chunk but wrote no part" if silent else None
    if (silent_rank := checked.get(pattern)) is not None:
        problems.append(silent_rank)
    return problems


def _object_problems(item: Any, world: int, writers: set[int] | None) -> list[str]:
    if not isinstance(item, dict):
        return [f"{item!r} is not an object"]
    problems = []
    if not isinstance(item.get("fqn"), str):
        problems.append(f"fqn is {item.get('fqn')!r}, not a string")
    rank = item.get("rank")
    if not is_int(rank) or not 0 <= rank < world:
        problems.append(f"rank is {rank!r}, not a rank of the save (0..{world - 1})")
    elif writers is not None and rank not in writers:
        problems.append(f"rank {rank} holds it but wrote no part")
    return problems


def _size(value: Any) -> bool:
    return is_int(value) and value >= 0


def _digest(value: Any) -> bool:
    return isinstance(value, str) and HEX_DIGEST.match(value) is not None
