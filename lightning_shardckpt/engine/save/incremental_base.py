"""What an incremental save builds on: the previous commit of this saver, and this rank's own record of it.

The tracker (incremental.py) says which tensors did not change since the previous save of this saver; this
says where their bytes are. On the flat format (v4/v5, FORMAT.md §10.6) each rank kept the part it wrote for
the previous save, in memory: its unchanged chunks are referenced from those records (file, byte range,
checksums, blocks and, signed, the digests it computed then), with no read from storage and nothing sent to any
other rank. Trust stays where it was made: a record a rank copies is one it wrote itself (or copied itself, for a
chunk unchanged over several saves), never re-read from storage, where it may have changed since.

Only when this rank kept no part (the base went down DCP's collective path, or this rank wrote nothing for it)
does `chunk_map` read the base from storage, as format v3's incremental saves always did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..format import part_references
from ..format import references as refs
from ..format.parts import TENSOR_CHUNKS

ChunkMap = dict[tuple[str, tuple[int, ...]], dict[str, Any]]


@dataclass
class IncrementalBase:
    """The base of one incremental save on this rank."""

    dirname: str  # the base checkpoint's directory (a sibling in the same root)
    unchanged: frozenset[str]  # keys the tracker proved unchanged since the base (not staged: they must be referenced)
    part: dict[str, Any] | None = None  # this rank's part of the base as it wrote it; None: it kept none
    digests: dict[str, str] | None = None  # signed v3 base, the coordinator: referenced file -> digest it signed

    def part_references(self, root: Any) -> ChunkMap:
        """(fqn, offsets) -> record to reference, for the flat format: from this rank's own part when it kept one."""
        if self.part is not None:
            return from_part(self.part, self.dirname, self.unchanged)
        base = refs.read_base(root, self.dirname)
        # a part's reference names its holder's size (a signed reader checks it): known for the base's own files
        sizes = {refs.make(self.dirname, item["path"]): item["bytes"] for item in base.get("files") or []}
        return {
            key: {**entry, part_references.HOLDER_BYTES: sizes[entry["file"]]}
            for key, entry in chunk_map(base, self.dirname, self.unchanged).items()
            if entry["file"] in sizes
        }

    def chunk_map(self, root: Any) -> ChunkMap:
        """The same for DCP's collective path (v3): the base's manifest, read from storage (FORMAT.md §9)."""
        return chunk_map(refs.read_base(root, self.dirname), self.dirname, self.unchanged)


def from_part(part: dict[str, Any], dirname: str, keys: frozenset[str]) -> ChunkMap:
    """The records of `part` (checkpoint `dirname`'s, this rank's) for the tensors `keys`, each naming the file that
    holds its bytes: the part's own shard file as `../<dirname>/<file>` with its size, or, for a chunk the part
    referenced already, the same holder (a reference never chains)."""
    out: ChunkMap = {}
    for chunk in part[TENSOR_CHUNKS]:
        if chunk["fqn"] not in keys:
            continue
        if part_references.is_referenced(chunk):
            entry = part_references.resolve(chunk, part)  # its holder already: a reference never chains
        else:
            entry = dict(chunk)
            entry[part_references.FILE] = refs.make(dirname, part["file"])
            entry[part_references.HOLDER_BYTES] = part["file_bytes"]
        out[(chunk["fqn"], tuple(chunk["offsets"]))] = entry
    return out


def chunk_map(manifest: dict[str, Any], dirname: str, keys: frozenset[str]) -> ChunkMap:
    return refs.chunk_map(manifest, dirname, keys)
