"""Incremental checkpoints on parts (format v4/v5, FORMAT.md §10.6): a chunk a rank did not write again.

An incremental save on the flat format records an unchanged chunk in the rank's own part, as a chunk record
with one more field, `holder`: an index into the part's `holders`, each the reference
`../<sibling checkpoint directory>/__<h>_0.distcp` of a shard file that physically holds bytes (§9's reference
rules: one level up, one sibling, one file, never a chain) and that file's size. Offset, length, checksum,
blocks and, signed, the cryptographic digests are the holder's record, copied by the rank that wrote it (it keeps
its own part in memory).

So nothing per chunk reaches the manifest. It lists, in `references`, only which shard files of which siblings
the checkpoint reads: per sibling directory the holder ranks as ranges, the bytes and the chunks referenced
there. O(siblings x ranges): one entry of one range when every rank references its own earlier file. That is
what reachability (retention, gc) needs without reading a part, and what binds each part's references: a
reader refuses a part whose reference the manifest does not list.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from .manifest_schema import REFERENCES_FIELD, is_int, reference_problem, split_reference
from .names import checkpoint_dirname, shard_filename

FILE, HOLDER_BYTES = "file", "file_bytes"  # a holder file (`holders` entry): its reference and its size
HOLDERS, HOLDER = "holders", "holder"  # a part's table of holder files; a referenced record's index into it
DIR, RANKS = "dir", "ranks"  # a manifest `references` entry: the sibling directory and its holder-rank ranges
HOLDER_NAME = re.compile(r"__(0|[1-9][0-9]*)_0\.distcp")


def is_referenced(chunk: dict[str, Any]) -> bool:
    """Whether a part's chunk record is a reference (its bytes are in a sibling checkpoint's shard file)."""
    return HOLDER in chunk


def resolve(chunk: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """A validated part's referenced record as a reader uses it: the record with its holder's `file` (the
    reference) and `file_bytes` in place of the `holder` index."""
    held = part[HOLDERS][chunk[HOLDER]]
    record = {name: value for name, value in chunk.items() if name != HOLDER}
    record[FILE], record[HOLDER_BYTES] = held[FILE], held[HOLDER_BYTES]
    return record


def compact(tensor_chunks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(holders, chunks) for a part: the writer's records that name their holder's `file` and `file_bytes` (as
    resolve gives them) rewritten to an index into one table of holder files, sorted by file. A file's name and
    size once per part, not once per chunk (~60 bytes a referenced chunk: a third of a part of FSDP records)."""
    sizes = {chunk[FILE]: chunk[HOLDER_BYTES] for chunk in tensor_chunks if FILE in chunk}
    order = {name: index for index, name in enumerate(sorted(sizes))}
    chunks = [
        {**{k: v for k, v in chunk.items() if k not in (FILE, HOLDER_BYTES)}, HOLDER: order[chunk[FILE]]}
        if FILE in chunk
        else chunk
        for chunk in tensor_chunks
    ]
    return [{FILE: name, HOLDER_BYTES: sizes[name]} for name in sorted(sizes)], chunks


def _holder_of(file: str) -> tuple[str, int]:
    """(sibling directory, holder rank) of a validated holder file."""
    parts = split_reference(file)
    assert parts is not None  # validated: part_problems
    match = HOLDER_NAME.fullmatch(parts[1])
    assert match is not None
    return parts[0], int(match.group(1))


def part_problems(part: dict[str, Any]) -> list[str]:
    """Why a part's references break §10.6 (its `holders` and the records pointing into it); empty when sound.
    `part`'s chunk lists were checked already (parts.part_problems)."""
    holders = part.get(HOLDERS, [])
    if any(HOLDER in chunk for chunk in part["objects"]):
        return ["an object is never a reference (objects are written by every save)"]
    if not isinstance(holders, list) or (HOLDERS in part and not holders):
        return [f"{HOLDERS} is not a non-empty list"]
    problems: list[str] = []
    previous = ""
    for index, held in enumerate(holders):
        where = f"{HOLDERS}[{index}]"
        if not isinstance(held, dict):
            return [f"{where}: {held!r} is not an object"]
        problem = reference_problem(held.get(FILE))
        if problem is not None:
            return [f"{where}: file: {problem}"]
        if HOLDER_NAME.fullmatch(held[FILE].rsplit("/", 1)[1]) is None:
            return [f"{where}: file {held[FILE]!r} names no shard file (a holder is `__<rank>_0.distcp` of a sibling)"]
        if held[FILE] <= previous:
            return [f"{where}: file {held[FILE]!r} is out of order or listed twice (sorted by file)"]
        previous = held[FILE]
        if not is_int(held.get(HOLDER_BYTES)) or held[HOLDER_BYTES] < 0:
            return [f"{where}: file_bytes is {held.get(HOLDER_BYTES)!r}, not an integer >= 0"]
    used: set[int] = set()
    for chunk in part["chunks"]:
        if HOLDER not in chunk:
            continue
        index = chunk[HOLDER]
        if not is_int(index) or not 0 <= index < len(holders):
            return [f"chunk of {chunk['fqn']!r}: holder {index!r} is not an index into {HOLDERS} ({len(holders)})"]
        used.add(index)
        if chunk["offset"] + chunk["length"] > holders[index][HOLDER_BYTES]:
            problems.append(
                f"chunk of {chunk['fqn']!r}: bytes {chunk['offset']}..{chunk['offset'] + chunk['length']} lie past "
                f"the {holders[index][HOLDER_BYTES]} bytes of {holders[index][FILE]}"
            )
    if len(used) != len(holders):
        problems.append(f"{HOLDERS} lists a file no chunk references")
    return problems


def reference_entries(part: dict[str, Any]) -> list[tuple[str, int, int, int]]:
    """(sibling directory, holder rank, bytes, chunks) per holder file `part` references: what one rank tells its
    leader and the coordinator for the manifest's `references`."""
    totals = [[0, 0] for _ in part.get(HOLDERS, [])]
    for chunk in part["chunks"]:
        if HOLDER in chunk:
            totals[chunk[HOLDER]][0] += chunk["length"]
            totals[chunk[HOLDER]][1] += 1
    out = []
    for index, held in enumerate(part.get(HOLDERS, [])):
        directory, rank = _holder_of(held[FILE])
        out.append((directory, rank, totals[index][0], totals[index][1]))
    return out


def references_table(entries: Iterable[tuple[str, int, int, int]]) -> list[dict[str, Any]]:
    """The manifest's `references`: per sibling directory (sorted), its holder ranks as sorted, disjoint
    inclusive ranges [first, last], the bytes and the chunks referenced there."""
    by_dir: dict[str, tuple[set[int], list[int]]] = {}
    for directory, rank, nbytes, chunks in entries:
        ranks, totals = by_dir.setdefault(directory, (set(), [0, 0]))
        ranks.add(rank)
        totals[0] += nbytes
        totals[1] += chunks
    return [
        {DIR: directory, RANKS: _ranges(ranks), "bytes": totals[0], "chunks": totals[1]}
        for directory, (ranks, totals) in sorted(by_dir.items())
    ]


def merge_tables(tables: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One `references` table from several (each leader's, for its group): O(directories x ranges), never per rank."""
    by_dir: dict[str, tuple[list[list[int]], list[int]]] = {}
    for table in tables:
        for item in table:
            ranges, totals = by_dir.setdefault(item[DIR], ([], [0, 0]))
            ranges.extend([list(pair) for pair in item[RANKS]])
            totals[0] += item["bytes"]
            totals[1] += item["chunks"]
    out = []
    for directory, (ranges, totals) in sorted(by_dir.items()):
        merged: list[list[int]] = []
        for first, last in sorted(ranges):
            if merged and first <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], last)
            else:
                merged.append([first, last])
        out.append({DIR: directory, RANKS: merged, "bytes": totals[0], "chunks": totals[1]})
    return out


def listed(manifest: dict[str, Any]) -> dict[str, list[list[int]]]:
    """Sibling directory -> its holder-rank ranges, of a validated manifest ({} when it references nothing)."""
    return {item[DIR]: item[RANKS] for item in manifest.get(REFERENCES_FIELD) or []}


def unlisted(manifest_listed: dict[str, list[list[int]]], part: dict[str, Any]) -> str | None:
    """The first holder file of `part` the manifest's `references` does not list; None when every one is listed (a
    part cannot send a reader to a file the signed or checksummed manifest does not name)."""
    for held in part.get(HOLDERS, []):
        directory, rank = _holder_of(held[FILE])
        if not any(first <= rank <= last for first, last in manifest_listed.get(directory, ())):
            return held[FILE]
    return None


def files(manifest: dict[str, Any]) -> dict[str, set[str]]:
    """Sibling directory -> the shard files of it the manifest references (reachability)."""
    return {
        directory: {shard_filename(rank) for first, last in ranges for rank in range(first, last + 1)}
        for directory, ranges in listed(manifest).items()
    }


def table_problems(manifest: dict[str, Any]) -> list[str]:
    """The rules of §10.6 for a parts-format manifest's `references` (absent: a full checkpoint)."""
    if REFERENCES_FIELD not in manifest:
        return []
    items = manifest[REFERENCES_FIELD]
    if not isinstance(items, list) or not items:
        return [f"{REFERENCES_FIELD} is not a non-empty list"]
    own = None
    if is_int(manifest.get("step")) and manifest["step"] >= 0 and isinstance(manifest.get("id"), str):
        own = checkpoint_dirname(manifest["step"], manifest["id"])
    problems: list[str] = []
    previous = ""
    for index, item in enumerate(items):
        where = f"{REFERENCES_FIELD}[{index}]"
        if not isinstance(item, dict):
            problems.append(f"{where}: {item!r} is not an object")
            continue
        directory = item.get(DIR)
        if not isinstance(directory, str) or reference_problem(f"../{directory}/{shard_filename(0)}") is not None:
            problems.append(f"{where}: dir {directory!r} is not a checkpoint directory name of this root")
            continue
        if directory == own:
            problems.append(f"{where}: dir {directory!r} is the checkpoint itself")
        if directory <= previous:
            problems.append(f"{where}: dir {directory!r} is out of order or listed twice (sorted by dir)")
        previous = directory
        for name in ("bytes", "chunks"):
            if not is_int(item.get(name)) or item[name] < 0:
                problems.append(f"{where}: {name} is {item.get(name)!r}, not an integer >= 0")
        problems.extend(f"{where}: {p}" for p in _ranges_problems(item.get(RANKS)))
    return problems


def _ranges(ranks: set[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for rank in sorted(ranks):
        if out and out[-1][1] == rank - 1:
            out[-1][1] = rank
        else:
            out.append([rank, rank])
    return out


def _ranges_problems(ranges: Any) -> list[str]:
    if not isinstance(ranges, list) or not ranges:
        return [f"ranks is {ranges!r}, not a non-empty list of [first, last] ranges"]
    end = -1
    for pair in ranges:
        if not (isinstance(pair, list) and len(pair) == 2 and all(is_int(x) for x in pair)):
            return [f"ranks entry {pair!r} is not [first, last]"]
        if not end < pair[0] <= pair[1]:
            return [f"ranks entry {pair!r} is empty, overlaps or is out of order (sorted, disjoint, first <= last)"]
        end = pair[1]
    return []
