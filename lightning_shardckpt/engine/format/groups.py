"""Format v5: the per-rank columns of the parts table moved out of the manifest into group tables.

A v4 manifest holds, per rank, its shard file's and part's sizes and checksums (~50 bytes a rank: 1 MB at
~17,000 ranks), and rank 0 receives every rank's summary to write them. In v5 the ranks are grouped by rank
number, `size` ranks a group (the last may hold fewer). Each group's leader (its highest rank) receives its
members' summaries and writes `__g<g>.parts.json`: the v4 columns for its ranks. The manifest's `groups`
table lists per group what a reader needs to trust a group table (its size and checksum) and what listings
sum (its files' bytes, how many of its ranks wrote), so the manifest and rank 0's commit are O(ranks / size).

A reader that needs rank r's part reads group r // size's table (bounded, checked against the manifest before
parsing) and goes on as in v4. `expanded` rebuilds a v4-shaped `parts` table from every group table, for the
tools that handle every file anyway (verify, replication, peer copies, signatures). FORMAT.md §10.5.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...errors import CorruptCheckpoint
from . import bounded_json, parts_manifest
from .checksum import checksum
from .file_digests import DIGEST_CHARS as CRYPTO_CHARS
from .file_digests import DIGEST_FIELD, PART_DIGESTS, digest_of
from .listed_read import read_listed
from .manifest_schema import HEX_DIGEST, is_int
from .names import join

GROUPS_FIELD = "groups"
GROUP_VERSION = 1
GROUP_SUFFIX = ".parts.json"
# the smallest group a writer makes: up to 16,384 ranks, 128 ranks a group; beyond, ceil(sqrt(world)) ranks, so
# that rank 0 (which leads no group) and every leader each hear ~sqrt(world) messages: 362 at 131,072 ranks
DEFAULT_GROUP_SIZE = 128
# for tests only: a smaller group, so a handful of gloo ranks form several groups (a real run keeps the default)
GROUP_SIZE_ENV = "LIGHTNING_SHARDCKPT_TEST_GROUP_SIZE"
# a group table holds ~50 bytes a rank: 4 MiB is ~80,000 ranks in one group, far beyond any group a writer makes
GROUP_TABLE_MAX_BYTES = 4 * 2**20
# the manifest's columns, one entry per group
BYTES, WRITERS, TABLE_BYTES, TABLE_CHECKSUMS = "bytes", "writers", "table_bytes", "table_checksums"
# signed v5 (FORMAT.md §12.2): each table's cryptographic digest, one string of 64 hex characters a group
TABLE_DIGESTS = "table_digests"
GROUP_TABLE = "group"  # what files_of calls a group table
TABLE_READ_THREADS = 8


def writer_group_size(world: int) -> int:
    """This writer's ranks per group for a save by `world` ranks (readers take it from the manifest)."""
    value = os.environ.get(GROUP_SIZE_ENV, "")
    if value.isdigit() and int(value) >= 1:
        return int(value)
    return max(DEFAULT_GROUP_SIZE, math.isqrt(max(world - 1, 0)) + 1)


def group_leader(group: int, size: int, world: int) -> int:
    """The rank that gathers group `group`'s summaries and writes its table: its highest, so that rank 0, the
    coordinator, leads no group (groups of one rank aside) and hears the leaders alone, not also size - 1
    members: at 131,072 ranks 362 messages rather than 724."""
    return group_ranks(group, size, world)[-1]


def group_filename(group: int) -> str:
    """`__g<g>.parts.json`: no rank's name (layout.shard_rank finds no rank in it)."""
    return f"__g{group}{GROUP_SUFFIX}"


def group_count(world: int, size: int) -> int:
    return -(-world // size)


def group_ranks(group: int, size: int, world: int) -> range:
    return range(group * size, min((group + 1) * size, world))


def build_group_table(
    checkpoint_id: str,
    group: int,
    size: int,
    world: int,
    summaries: dict[int, dict[str, Any]],
    part_digests: bool = False,
) -> dict[str, Any]:
    """Group `group`'s table from its writing ranks' {file_bytes, file_checksum, part_bytes, part_checksum[,
    part_digest]} (keyed by global rank): the v4 parts columns for its ranks, first rank first; with
    `part_digests` (signed) also the fifth column."""
    ranks = group_ranks(group, size, world)
    table = parts_manifest.parts_table(
        len(ranks), {rank - ranks.start: s for rank, s in summaries.items()}, part_digests
    )
    return {
        "group_version": GROUP_VERSION,
        "checkpoint_id": checkpoint_id,
        "group": group,
        "first_rank": ranks.start,
        **table,
    }


def to_bytes(table: dict[str, Any]) -> bytes:
    return (json.dumps(table, sort_keys=True, separators=(",", ":")) + "\n").encode()


def group_entry(table: dict[str, Any], data: bytes, digest: str | None = None) -> dict[str, Any]:
    """What the manifest lists of a written group table (`data`: its exact bytes); with `digest` (signed) also
    its cryptographic digest."""
    entry = {
        BYTES: sum(size for column in parts_manifest.SIZE_COLUMNS for size in table[column] if size is not None),
        WRITERS: sum(size is not None for size in table[parts_manifest.FILE_BYTES]),
        TABLE_BYTES: len(data),
        TABLE_CHECKSUMS: checksum(data),
    }
    if digest is not None:
        entry[TABLE_DIGESTS] = digest_of(data, digest)
    return entry


def groups_table(world: int, size: int, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's `groups` table from each group's group_entry, in group order (signed: with every table's
    digest, which the signature over the manifest then covers)."""
    table = {
        "count": world,
        "size": size,
        BYTES: [entry[BYTES] for entry in entries],
        WRITERS: [entry[WRITERS] for entry in entries],
        TABLE_BYTES: [entry[TABLE_BYTES] for entry in entries],
        TABLE_CHECKSUMS: "".join(entry[TABLE_CHECKSUMS] for entry in entries),
    }
    if entries and all(TABLE_DIGESTS in entry for entry in entries):
        table[TABLE_DIGESTS] = "".join(entry[TABLE_DIGESTS] for entry in entries)
    return table


def is_signed(manifest: dict[str, Any]) -> bool:
    """A signed v5 manifest's shape: a digest algorithm and a digest of every group table (FORMAT.md §12.2)."""
    table = manifest.get(GROUPS_FIELD)
    return DIGEST_FIELD in manifest and isinstance(table, dict) and TABLE_DIGESTS in table


def is_grouped(manifest: dict[str, Any]) -> bool:
    return GROUPS_FIELD in manifest


def world_of(manifest: dict[str, Any]) -> int:
    return manifest[GROUPS_FIELD]["count"]


def bytes_total(manifest: dict[str, Any]) -> int:
    """The bytes of every shard file, part and group table: O(groups), no table read."""
    table = manifest[GROUPS_FIELD]
    return sum(table[BYTES]) + sum(table[TABLE_BYTES])


def file_count(manifest: dict[str, Any]) -> int:
    """How many files the checkpoint holds (a shard file and a part per writing rank, a table per group)."""
    table = manifest[GROUPS_FIELD]
    return 2 * sum(table[WRITERS]) + len(table[TABLE_BYTES])


def table_files(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The group tables as files_of entries."""
    table = manifest[GROUPS_FIELD]
    return [
        {"path": group_filename(g), "bytes": size, "checksum": _digest_at(table, g), "kind": GROUP_TABLE}
        for g, size in enumerate(table[TABLE_BYTES])
    ]


def manifest_problems(manifest: dict[str, Any]) -> list[str]:
    """The rules of FORMAT.md §10.5 for a v5 manifest's tables; empty when they are sound."""
    problems: list[str] = []
    table = manifest.get(GROUPS_FIELD)
    if parts_manifest.PARTS_FIELD in manifest:
        problems.append(f"{parts_manifest.PARTS_FIELD} is present in a format v5 manifest (its groups' tables hold it)")
    if not isinstance(table, dict):
        return [*problems, f"{GROUPS_FIELD} is not an object"]
    world, size = table.get("count"), table.get("size")
    if not is_int(world) or world < 1 or not is_int(size) or size < 1:
        return [*problems, f"{GROUPS_FIELD}.count and .size are {world!r} and {size!r}, not integers >= 1"]
    groups = group_count(world, size)
    for column in (BYTES, WRITERS, TABLE_BYTES):
        values = table.get(column)
        if not (isinstance(values, list) and len(values) == groups and all(is_int(v) and v >= 0 for v in values)):
            problems.append(f"{GROUPS_FIELD}.{column} is not a list of {groups} integers >= 0")
    digests = table.get(TABLE_CHECKSUMS)
    if not (isinstance(digests, str) and len(digests) == groups * parts_manifest.DIGEST_CHARS):
        problems.append(f"{GROUPS_FIELD}.{TABLE_CHECKSUMS} is not a string of {groups} x 16 characters")
    elif not all(HEX_DIGEST.match(_digest_at(table, g)) for g in range(groups)):
        problems.append(f"{GROUPS_FIELD}.{TABLE_CHECKSUMS} holds a checksum that is not 16 lowercase hex characters")
    if TABLE_DIGESTS in table:
        crypto = table[TABLE_DIGESTS]
        if not (
            isinstance(crypto, str)
            and len(crypto) == groups * CRYPTO_CHARS
            and all(c in "0123456789abcdef" for c in crypto)
        ):
            problems.append(f"{GROUPS_FIELD}.{TABLE_DIGESTS} is not a string of {groups} x 64 lowercase hex characters")
    if not problems:
        problems.extend(
            f"{GROUPS_FIELD} group {g}: {writers} writers, more than its {len(group_ranks(g, size, world))} ranks"
            for g, writers in enumerate(table[WRITERS])
            if writers > len(group_ranks(g, size, world))
        )
    if problems:
        return problems
    return parts_manifest.layout_problems(manifest, world, None)


class GroupTables:
    """The group tables of one committed v5 checkpoint, read when asked, each once, each checked against the
    manifest (size bound, size, checksum) before it is parsed, then against its place and the manifest's sums."""

    def __init__(self, fs: Any, directory: str, manifest: dict[str, Any], signed_by: str | None = None) -> None:
        """`signed_by` (a reader with a signature policy: the id of the key whose signature over the manifest it
        accepted): each table is checked against the manifest's `table_digests` before anything else, and must
        carry its ranks' `part_digests`."""
        self.fs, self.directory, self.manifest = fs, directory, manifest
        self.table = manifest[GROUPS_FIELD]
        self.world, self.size = self.table["count"], self.table["size"]
        self.signed_by = signed_by
        self._read: dict[int, dict[str, Any]] = {}
        self.tables_read = 0

    def groups_of(self, ranks: Iterable[int]) -> set[int]:
        return {rank // self.size for rank in ranks if 0 <= rank < self.world}

    def load(self, groups: Iterable[int]) -> dict[int, dict[str, Any]]:
        """The tables of `groups` (read concurrently the first time)."""
        wanted = sorted(set(groups))
        missing = [g for g in wanted if g not in self._read]
        if len(missing) == 1:
            self._read[missing[0]] = self._read_one(missing[0])
        elif missing:
            with ThreadPoolExecutor(
                min(TABLE_READ_THREADS, len(missing)), thread_name_prefix="shardckpt-groups"
            ) as pool:
                self._read.update(zip(missing, pool.map(self._read_one, missing)))
        self.tables_read += len(missing)
        return {g: self._read[g] for g in wanted}

    def parts_table(self, ranks: Iterable[int] | None = None) -> dict[str, Any]:
        """A v4-shaped `parts` table holding the entries of `ranks` (None: every rank) from their groups' tables;
        ranks of groups not read show as having written nothing: ask only about `ranks`."""
        groups = range(group_count(self.world, self.size)) if ranks is None else self.groups_of(ranks)
        tables = self.load(groups)
        merged: dict[str, Any] = {"count": self.world}
        for column in parts_manifest.SIZE_COLUMNS:
            values: list[Any] = [None] * self.world
            for g, table in tables.items():
                values[g * self.size : g * self.size + table["count"]] = table[column]
            merged[column] = values
        for column in parts_manifest.DIGEST_COLUMNS:
            pieces = [
                tables[g][column]
                if g in tables
                else parts_manifest.NO_DIGEST * len(group_ranks(g, self.size, self.world))
                for g in range(group_count(self.world, self.size))
            ]
            merged[column] = "".join(pieces)
        return merged

    def part_digests(self, ranks: Iterable[int]) -> dict[int, str]:
        """Signed v5: the digest each of `ranks`' group tables records of its part (`part_digests`), by rank; never
        merged into parts_table's world-wide columns (64 characters a rank: 8 MB at 131,072 ranks, per plan)."""
        wanted = [rank for rank in ranks if 0 <= rank < self.world]
        tables = self.load(self.groups_of(wanted))
        out = {}
        for rank in wanted:
            table, at = tables[rank // self.size], (rank % self.size) * CRYPTO_CHARS
            out[rank] = table.get(PART_DIGESTS, parts_manifest.NO_CRYPTO * table["count"])[at : at + CRYPTO_CHARS]
        return out

    def _read_one(self, group: int) -> dict[str, Any]:
        name = group_filename(group)
        path = join(self.directory, name)
        size, digest = self.table[TABLE_BYTES][group], _digest_at(self.table, group)
        if size > GROUP_TABLE_MAX_BYTES:
            raise CorruptCheckpoint(
                f"{path}: the manifest says {size} bytes, over the {GROUP_TABLE_MAX_BYTES} a group table may hold; "
                "the manifest is damaged"
            )
        crypto = None
        if self.signed_by is not None:  # before its xxh3: a table whose bytes changed is refused as a forgery
            expected = self.table[TABLE_DIGESTS][group * CRYPTO_CHARS : (group + 1) * CRYPTO_CHARS]
            crypto = (self.manifest[DIGEST_FIELD], expected, self.signed_by)
        data = read_listed(self.fs, self.directory, name, size, digest, "group table", crypto)
        problems = []
        try:
            table = bounded_json.loads(data, GROUP_TABLE_MAX_BYTES, schema_checked=parts_manifest.SIZE_COLUMNS)
        except bounded_json.UnreadableJson as err:
            problems, table = [str(err)], None
        if table is not None:
            problems = self._table_problems(group, table)
        if problems:
            raise CorruptCheckpoint(
                f"{path}: group table is invalid: {'; '.join(problems[:5])}; the checkpoint is damaged, load an "
                "older one",
                problems=[{"file": name, "tensor": None, "expected": "a valid group table", "actual": problems[0]}],
            )
        return table

    def _table_problems(self, group: int, table: Any) -> list[str]:
        if not isinstance(table, dict):
            return ["not a JSON object"]
        if table.get("group_version") != GROUP_VERSION:
            return [f"group_version is {table.get('group_version')!r}; this reader reads {GROUP_VERSION}"]
        ranks = group_ranks(group, self.size, self.world)
        expected = {"checkpoint_id": self.manifest["id"], "group": group, "first_rank": ranks.start}
        problems = [f"{k} is {table.get(k)!r}, not {v!r}" for k, v in expected.items() if table.get(k) != v]
        if table.get("count") != len(ranks):
            problems.append(f"count is {table.get('count')!r}, the group has {len(ranks)} ranks")
        if problems or parts_manifest.columns_problems(table, f"group {group}", problems) is None:
            return problems
        crypto = table.get(PART_DIGESTS)
        if crypto is not None or self.signed_by is not None:
            problems.extend(parts_manifest.crypto_column_problems(table, f"group {group}"))
        entry = group_entry(table, b"")
        for column in (BYTES, WRITERS):
            if entry[column] != self.table[column][group]:
                problems.append(
                    f"its {column} add up to {entry[column]}, the manifest says {self.table[column][group]}"
                )
        return problems


def expanded(fs: Any, directory: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` with a v4-shaped `parts` table built from every group table (v1-v4: itself): for tools that
    handle every file of a checkpoint. O(ranks) bytes read, in O(ranks / size) bounded reads."""
    if not is_grouped(manifest) or parts_manifest.PARTS_FIELD in manifest:
        return manifest
    return {**manifest, parts_manifest.PARTS_FIELD: GroupTables(fs, directory, manifest).parts_table()}


def for_ranks(fs: Any, directory: str, manifest: dict[str, Any], ranks: Iterable[int]) -> dict[str, Any]:
    """`manifest` with a v4-shaped `parts` table holding the rows of `ranks` only (v1-v4: itself), read from their
    groups' tables in `directory`: what a rank needs to send, receive or upload its own files. One table read,
    never every group's, and only tables on the disk of the ranks they list (a node-local root holds its own
    groups' tables: engine/save/node_groups.py)."""
    if not is_grouped(manifest) or parts_manifest.PARTS_FIELD in manifest:
        return manifest
    return {**manifest, parts_manifest.PARTS_FIELD: GroupTables(fs, directory, manifest).parts_table(ranks)}


def table_led_by(manifest: dict[str, Any], rank: int) -> str | None:
    """The group table `rank` wrote as its group's leader (group_leader), or None (v1-v4, or not a leader)."""
    if not is_grouped(manifest):
        return None
    table = manifest[GROUPS_FIELD]
    group = rank // table["size"]
    return (
        group_filename(group)
        if 0 <= rank < table["count"] and group_leader(group, table["size"], table["count"]) == rank
        else None
    )


def _digest_at(table: dict[str, Any], group: int) -> str:
    return table[TABLE_CHECKSUMS][group * parts_manifest.DIGEST_CHARS : (group + 1) * parts_manifest.DIGEST_CHARS]
