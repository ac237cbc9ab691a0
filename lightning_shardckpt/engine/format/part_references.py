"""Incremental checkpoints on parts (format v4/v5, FORMAT.md §10.6): a chunk a rank did not write again.

An incremental save on the flat format records an unchanged chunk in the rank's own part, as a chunk record
with two more fields: `file`, the reference `../<sibling checkpoint directory>/__<h>_0.distcp` of the shard
file that physically holds the bytes (§9's reference rules: one level up, one sibling, one file, never a chain),
and `file_bytes`, that holder file's size. Offset, length, checksum, blocks and, signed, the cryptographic
digests are the holder's record, copied by the rank that wrote it (it keeps its own part in memory).

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

FILE, HOLDER_BYTES = "file", "file_bytes"  # a referenced chunk record's holder file and that file's size
DIR, RANKS = "dir", "ranks"  # a manifest `references` entry: the sibling directory and its holder-rank ranges
HOLDER = re.compile(r"__(0|[1-9][0-9]*)_0\.distcp")


def is_referenced(chunk: dict[str, Any]) -> bool:
    """Whether a part's chunk record is a reference (its bytes are in a sibling checkpoint's shard file)."""
    return FILE in chunk


def holder(chunk: dict[str, Any]) -> tuple[str, int]:
    """(sibling directory, holder rank) of a validated referenced record."""
    parts = split_reference(chunk[FILE])
    assert parts is not None  # validated: record_problems
    match = HOLDER.fullmatch(parts[1])
    assert match is not None
    return parts[0], int(match.group(1))


def record_problems(chunk: dict[str, Any]) -> list[str]:
    """Why a part's referenced chunk record breaks §10.6 (its reference fields only); empty when sound."""
    problem = reference_problem(chunk.get(FILE))
    if problem is not None:
        return [f"file: {problem}"]
    name = chunk[FILE].rsplit("/", 1)[1]
    if HOLDER.fullmatch(name) is None:
        return [f"file {chunk[FILE]!r} names no shard file (a reference holds `__<rank>_0.distcp` of a sibling)"]
    size = chunk.get(HOLDER_BYTES)
    end = (chunk.get("offset") or 0) + (chunk.get("length") or 0)
    if not is_int(size) or not is_int(end) or size < end:
        return [f"file_bytes is {size!r}, not the size of a holder file that holds bytes up to {end}"]
    return []


def reference_entries(records: Iterable[dict[str, Any]]) -> list[tuple[str, int, int, int]]:
    """(sibling directory, holder rank, bytes, chunks) per holder file the `records` reference: what one rank
    tells its leader and the coordinator for the manifest's `references`."""
    out: dict[tuple[str, int], list[int]] = {}
    for record in records:
        if is_referenced(record):
            totals = out.setdefault(holder(record), [0, 0])
            totals[0] += record["length"]
            totals[1] += 1
    return [(directory, rank, total[0], total[1]) for (directory, rank), total in sorted(out.items())]


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
    """The first reference of `part` the manifest's `references` does not list, as `fqn -> file`; None when every
    one is listed (a part cannot send a reader to a file the signed or checksummed manifest does not name)."""
    for chunk in part["chunks"]:
        if not is_referenced(chunk):
            continue
        directory, rank = holder(chunk)
        if not any(first <= rank <= last for first, last in manifest_listed.get(directory, ())):
            return f"{chunk['fqn']!r} -> {chunk[FILE]}"
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
