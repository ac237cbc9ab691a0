"""A committed checkpoint's manifest without its tables: what `shardckpt timeline` shows of each checkpoint.

A timeline over thousands of checkpoints must cost what `ls` does, yet it shows fields only the manifest
holds (epoch, verification, metrics, identity, topology). Those are a few hundred bytes; the tables
(`tensors`, `objects`, `files`, `references`) are the rest, and parsing them is what made a timeline take
tens of seconds. So the manifest is read once, its bytes are checked against the commit record's checksum
(proof they are what the writer committed), and only the top-level fields outside the tables are parsed.

The writer's manifest is `json.dumps(indent=1, sort_keys=True)` (manifest.to_bytes): every top-level key
starts a line with exactly one space, and no string holds a raw newline. That is how the tables are
skipped without parsing them. Anything else (a v1 manifest without a commit record, JSON in another layout)
is parsed in full, as `entry.manifest` does, and then reduced to the same summary: never kept whole.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..engine import catalog
from ..engine.format import manifest as manifest_format
from ..engine.format import manifest_schema
from ..engine.format.entry import read_manifest, read_manifest_bytes
from ..engine.format.groups import GROUPS_FIELD
from ..engine.format.names import MANIFEST, PARTS_FORMAT_VERSION, join, parse_dirname
from ..engine.format.parts_manifest import PARTS_FIELD
from ..errors import CheckpointDeleted, CorruptCheckpoint, ShardCkptError

# skipped: the bulk of a manifest (v4: its parts table; v5: its groups table, small, vouched for by the checksum)
TABLES = ("tensors", "objects", "files", manifest_schema.REFERENCES_FIELD, PARTS_FIELD, GROUPS_FIELD)
_TOP_LEVEL_KEY = re.compile(rb'\n "((?:[^"\\\n]|\\.)*)": ')  # indent=1: one space before a top-level key
_KEY_START = b'\n "'
_BRACKETS = {ord("["): ord("]"), ord("{"): ord("}")}


def read_summary(fs: Any, entry: catalog.CheckpointEntry, *, from_record: bool = True) -> dict[str, Any]:
    """The manifest of a listed, committed entry minus its tables; validated like `entry.manifest`.

    A format-v4 commit record carries this summary itself, with each identity block as a digest
    (`identity_digests`): then nothing more is read, unless `from_record` is False (the full identity blocks,
    from the manifest). Raises (and marks the entry) as `entry.manifest` does: CheckpointDeleted when the
    directory went after listing, CorruptCheckpoint when the manifest is not the committed one or does not
    validate. Never stores anything on the entry: the caller drops the summary when done with it.
    """
    record = entry.record or {}
    summary = record.get(manifest_format.SUMMARY_FIELD)
    # a record whose listing fields no longer match the digest the writer put in its summary was edited after
    # commit: read the manifest, whose comparison names the field (and marks the entry corrupt)
    if from_record and isinstance(summary, dict) and _record_unedited(record, summary):
        return {
            **{name: record.get(name) for name in manifest_format.RECORD_FIELDS},
            **record[manifest_format.SUMMARY_FIELD],
        }
    if record.get("manifest_checksum") is None:  # v1: nothing proves the tables sound but parsing them
        return _without_tables(read_manifest(fs, entry))
    path = join(entry.path, MANIFEST)
    try:
        data = read_manifest_bytes(fs, path)
    except CorruptCheckpoint as err:  # a FIFO, a link or a huge file named manifest.json: never read
        entry.state, entry.problem = catalog.CORRUPT, str(err)
        raise
    except FileNotFoundError as err:
        entry.state = catalog.UNCOMMITTED
        raise CheckpointDeleted(
            f"{entry.path} was deleted after it was listed (retention of a job writing into this root, or a person); "
            "pick another checkpoint: shardckpt ls " + entry.path.rsplit("/", 1)[0]
        ) from err
    try:
        manifest_format.check_matches_record(data, record, entry.path)
        manifest_format.check_parse_cost(data, entry.path)  # what opening it would refuse, refused here too
        split = _split_top_level(data)
        if split is None:  # not the writer's layout: parse it all, once, as opening it would
            manifest = manifest_format.parse(data, entry.path)
            manifest_format.check_record_agrees(record, manifest, entry.path)
            return _without_tables(manifest)
        summary, tables = split
        _validate(summary, tables, entry.path)
        manifest_format.check_record_agrees(record, summary, entry.path)
        return summary
    except ShardCkptError as err:
        entry.state, entry.problem = catalog.CORRUPT, str(err)
        raise


def _record_unedited(record: dict[str, Any], summary: dict[str, Any]) -> bool:
    expected = summary.get(manifest_format.RECORD_DIGEST_FIELD)
    return expected is None or expected == manifest_format.record_fields_digest(record)


def _without_tables(manifest: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in manifest.items() if key not in TABLES}


def _split_top_level(data: bytes) -> tuple[dict[str, Any], set[str]] | None:
    """The top-level fields other than the tables, parsed, and the tables' names; None when `data` is not
    in the writer's layout."""
    body = data.rstrip()
    if not (body.startswith(b'{\n "') and body.endswith(b"\n}")):
        return None
    keys = _top_level_keys(body)
    if keys is None:
        return None
    names: set[str] = set()
    tables: set[str] = set()
    fields: list[bytes] = []  # ' "name": value' of every field outside the tables, parsed in one go below
    try:
        for index, match in enumerate(keys):
            start, end = match.end(), keys[index + 1].start() if index + 1 < len(keys) else len(body) - 2
            if index + 1 < len(keys):
                if body[end - 1] != ord(","):
                    return None
                end -= 1
            name = _name(match)
            if name in names:
                return None
            names.add(name)
            if name in TABLES:
                # unparsed (and not copied): it must at least be one bracketed value, or the split was wrong
                if end <= start or _BRACKETS.get(body[start]) != body[end - 1]:
                    return None
                tables.add(name)
                continue
            fields.append(body[match.start() + 1 : end])
        # one parse for all of them: a json.loads per field cost as much as finding the tables' ends
        summary = json.loads(b"{" + b",".join(fields) + b"}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None  # the full parse names the problem
    return summary, tables


def _top_level_keys(body: bytes) -> list[re.Match[bytes]] | None:
    """The top-level keys' matches in order, without scanning the largest table: keys are sorted, and the
    fields after `tensors` (the bulk) are few, so they are found backwards from the end until a table's key,
    the rest forwards from the start up to it. None when a key line does not parse (not the writer's layout)."""
    after: list[re.Match[bytes]] = []
    end = len(body)
    try:
        while (start := body.rfind(_KEY_START, 0, end)) != -1:  # backwards: the last fields, to the last table
            match = _TOP_LEVEL_KEY.match(body, start)
            if match is None:
                return None
            after.append(match)
            if _name(match) in TABLES:
                break
            end = start
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    keys: list[re.Match[bytes]] = []
    stop = after[-1].start() if after else 0
    start = body.find(_KEY_START, 0, stop)
    while start != -1:  # forwards, up to that table; bytes.find runs at memory speed, a regex does not
        match = _TOP_LEVEL_KEY.match(body, start)
        if match is None:
            return None
        keys.append(match)
        start = body.find(_KEY_START, match.end(), stop)
    return keys + after[::-1]


def _name(match: re.Match[bytes]) -> str:
    raw = match[1]
    return raw.decode() if b"\\" not in raw else json.loads(b'"' + raw + b'"')


def _validate(summary: dict[str, Any], tables: set[str], where: str) -> None:
    """The rules of manifest.parse for everything but the tables (the checksum vouched for those)."""
    version = summary.get("format_version")
    if not manifest_schema.is_int(version) or version not in manifest_format.READABLE_FORMAT_VERSIONS:
        manifest_format.parse(json.dumps(summary).encode(), where)  # raises, naming the version problem
        raise CorruptCheckpoint(f"{where}: format_version {version!r} is not one this package reads")  # as parse did
    stand_ins: dict[str, list[Any]] = {"files": [], "tensors": [], "objects": []}
    missing = [name for name in manifest_format.required_fields(version) if name not in summary and name not in tables]
    if missing:
        raise CorruptCheckpoint(f"{where}: manifest lacks required fields {missing}; the checkpoint is damaged")
    if version >= PARTS_FORMAT_VERSION:  # the tables are vouched for by the checksum; the rest is checked here
        problems = manifest_schema.common_problems(summary, parse_dirname(where))
    else:
        problems = manifest_schema.manifest_problems({**summary, **stand_ins}, parse_dirname(where))
    if problems:
        shown = "; ".join(problems[: manifest_schema.MAX_PROBLEMS]) + (
            " …" if len(problems) > manifest_schema.MAX_PROBLEMS else ""
        )
        raise CorruptCheckpoint(
            f"{where}: manifest (format v{version}) is invalid: {shown}. "
            "The checkpoint is damaged or was altered; load another one"
        )
