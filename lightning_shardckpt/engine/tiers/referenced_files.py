"""The earlier files an incremental checkpoint reads, for every copy that must carry them (peers, a peer restore,
the durable tier).

An incremental checkpoint on parts (FORMAT.md §10.6) reads its unchanged chunks from shard files of sibling
checkpoints (`../<sibling>/__<h>_0.distcp`). A copy of only its own files is no checkpoint where it lands: a peer
node, a replaced node, the durable tier. So each copy also carries the holder files the copied ranks' parts
reference, unless the target holds them already, and checks them as they pass against the referencing records
(offset, length, checksum of each referenced chunk, bound by the part's checksum and, signed, by the signature):
the bytes the checkpoint reads are verified; the rest of a holder file (chunks only the sibling read) is not this
checkpoint's to vouch for.

Each rank's part references its own earlier files (a rank copies the records it wrote: save/incremental_base.py),
so on a node-local tier a rank's referenced files are on its own node, and the rank that sends or uploads its own
files sends or uploads those too. A reference is named by its path relative to the referencing checkpoint's
directory, as parts name it; `join(root, checkpoint, reference)` is its place in any root.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..format import part_references
from ..format import references as refs
from ..format.chunk_index import read_parts
from ..format.names import MANIFEST, join, shard_filename
from ..format.parts import TENSOR_CHUNKS
from .verified_copy import Range, chunk_range


def listed(manifest: dict[str, Any]) -> dict[str, int]:
    """Reference -> holder rank, for every shard file the manifest's `references` lists ({}: a full checkpoint).
    From the manifest alone (no part read): what a target must hold for the checkpoint to be readable there."""
    return {
        refs.make(directory, shard_filename(rank)): rank
        for directory, ranges in part_references.listed(manifest).items()
        for first, last in ranges
        for rank in range(first, last + 1)
    }


def of_rank(manifest: dict[str, Any], rank: int) -> list[str]:
    """The listed references held by `rank` (its own earlier files: the ones it sends or uploads), sorted."""
    return sorted(reference for reference, holder in listed(manifest).items() if holder == rank)


def of_parts(parts: Iterable[dict[str, Any]]) -> dict[str, tuple[int, list[Range]]]:
    """Reference -> (the holder file's size, the ranges the parts read from it, in offset order): what a copy of
    that file is checked against (every referenced chunk's bytes; gaps are chunks only the sibling read)."""
    sizes: dict[str, int] = {}
    ranges: dict[str, dict[int, Range]] = {}
    for part in parts:
        for chunk in part[TENSOR_CHUNKS]:
            if not part_references.is_referenced(chunk):
                continue
            record = part_references.resolve(chunk, part)
            sizes[record[part_references.FILE]] = record[part_references.HOLDER_BYTES]
            # the same chunk referenced by two parts is one range (the same record, copied)
            ranges.setdefault(record[part_references.FILE], {})[record["offset"]] = chunk_range(record)
    return {file: (sizes[file], _covering(ranges[file], sizes[file])) for file in sizes}


def _covering(ranges: dict[int, Range], size: int) -> list[Range]:
    """The referenced ranges in offset order, the bytes between them (and after them) as unchecked ranges: a copy
    checks what the checkpoint reads, and every byte of the file passes in order (verified_copy.RangeCheck)."""
    out: list[Range] = []
    position = 0
    for offset in sorted(ranges):
        if offset > position:
            out.append((position, offset - position, None, None))
        out.append(ranges[offset])
        position = offset + ranges[offset][1]
    if size > position:
        out.append((position, size - position, None, None))
    return out


def of_ranks(fs: Any, directory: str, manifest: dict[str, Any], ranks: Iterable[int]) -> dict[str, tuple[int, list]]:
    """`of_parts` of the parts of `ranks` in `directory` (`manifest` lists their rows: v5, groups.for_ranks), each
    part checked against the manifest as every reader checks it."""
    if not listed(manifest):
        return {}
    return of_parts(read_parts(fs, directory, manifest, ranks).values())


def missing(fs: Any, directory: str, manifest: dict[str, Any], only: Iterable[str] | None = None) -> list[str]:
    """The listed references of the checkpoint in `directory` (of `only`, if given) its root lacks."""
    wanted = listed(manifest) if only is None else only
    return [reference for reference in sorted(wanted) if not fs.exists(join(directory, reference))]


def sibling_dir(directory: str, reference: str) -> str:
    """The sibling checkpoint directory `reference` (relative to the checkpoint in `directory`) is in."""
    return join(directory, reference).rsplit("/", 1)[0]


def mark_kept_for_references(fs: Any, directory: str) -> None:
    """A sibling directory a copy created only to hold referenced files (no manifest of its own there): marked
    RETIRED, as retention marks a deleted checkpoint whose files a kept one still references, so that retention's
    sweep removes it once no kept checkpoint references it (policies/retention.py), and no reader takes it for a
    failed save."""
    if not fs.exists(join(directory, MANIFEST)) and not fs.exists(join(directory, refs.RETIRED)):
        fs.makedirs(directory, exist_ok=True)
        fs.pipe_file(join(directory, refs.RETIRED), b"kept for the references of a later checkpoint\n")
