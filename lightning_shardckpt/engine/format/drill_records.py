"""Drill records: the write-once side files that say whether a committed checkpoint was restored.

A checkpoint directory is never rewritten, so the result of a restore drill lives beside it:
`ROOT/drills/<checkpoint dir>--<drill id>--<verdict>.json`, created once (create-if-absent). The
verdict is in the file name, so the trust state of every checkpoint in a root comes from one listing
of `ROOT/drills/`, without reading a record; the JSON body holds the details (cause, timings, checks).
Drill ids sort by time, so the newest record of a checkpoint is its last by name.

Trust states: `committed` (no drill record yet), `drilled` (the newest drill passed), `drill-failed`
(the newest drill failed; its cause is in the record), `not-drilled` (a drill could not start: never
counted as passed). See docs/FORMAT.md, "Drill records".

Anyone who can write to the root can drop a file into `drills/`, so only well-formed records count: a
name whose drill id is one `new_drill_id` makes, and for a passed verdict (the one that grants trust) a
JSON body naming the same checkpoint, drill id and verdict. Anything else is malformed: logged, listed by
`trust_report` (and `shardckpt ls`), never trusted.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ..storage import fsio
from ..storage.fsio import Location
from . import bounded_json
from .entry import CheckpointEntry
from .names import DRILLS_DIR, join, parse_dirname

log = logging.getLogger(__name__)

PASSED, FAILED, NOT_DRILLED = "passed", "failed", "not-drilled"
VERDICTS = (PASSED, FAILED, NOT_DRILLED)
COMMITTED, DRILLED, DRILL_FAILED = "committed", "drilled", "drill-failed"
TRUST_OF_VERDICT = {PASSED: DRILLED, FAILED: DRILL_FAILED, NOT_DRILLED: NOT_DRILLED}
RECORD_VERSION = 1
_SEPARATOR = "--"
DRILL_ID = re.compile(r"^\d{8}T\d{12}Z-[0-9a-f]{6}$")  # what new_drill_id makes: UTC time, then a random suffix
REQUIRED_FIELDS = ("record_version", "checkpoint", "drill_id", "verdict")


def new_drill_id() -> str:
    """Sortable by time (UTC, microseconds), unique by a random suffix."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ") + "-" + secrets.token_hex(3)


@dataclass(frozen=True)
class RecordName:
    checkpoint: str  # the checkpoint's directory name
    drill_id: str
    verdict: str

    @property
    def filename(self) -> str:
        return f"{self.checkpoint}{_SEPARATOR}{self.drill_id}{_SEPARATOR}{self.verdict}.json"


def parse_record_name(filename: str) -> RecordName | None:
    """A drill record's name parts, or None for any other file."""
    name = filename.rstrip("/").rsplit("/", 1)[-1]
    if not name.endswith(".json"):
        return None
    parts = name[: -len(".json")].split(_SEPARATOR)
    if len(parts) != 3 or parse_dirname(parts[0]) is None or not DRILL_ID.match(parts[1]) or parts[2] not in VERDICTS:
        return None
    return RecordName(*parts)


def outcome_details(outcome: dict[str, Any]) -> dict[str, Any]:
    """What a drill record keeps of rank 0's outcome: checks, timings, bytes, read GB/s, time to resume, and the
    rank processes (kept from an earlier drill or forked for this one, their pids, whether the destination
    tensors were the last drill's)."""
    kept = ("checks", "timings", "bytes_read", "traceback", "rank_process", "rank_pids", "destination_reused")
    details = {key: outcome[key] for key in kept if key in outcome}
    timings = details.get("timings", {})
    if outcome.get("bytes_read") and timings.get("load_s"):
        details["read_gbps"] = outcome["bytes_read"] / timings["load_s"] / 1e9
    if timings.get("time_to_resume_s") is not None:
        details["time_to_resume_s"] = timings["time_to_resume_s"]
    return details


def check_writable(location: Location) -> None:
    """Raise the storage's OSError now if ROOT/drills/ cannot take a record: a drill that runs for minutes
    and then cannot file its verdict wasted them. Writes and removes one small probe file."""
    directory = join(location.path, DRILLS_DIR)
    location.backend.makedirs(directory)
    probe = join(directory, f".writable-{secrets.token_hex(6)}")
    location.fs.pipe_file(probe, b"")
    location.fs.rm_file(probe)


def write_record(location: Location, record: dict[str, Any]) -> str:
    """Create the record once; returns its path. `record` holds checkpoint, drill_id and verdict."""
    if record["verdict"] not in VERDICTS:
        raise ValueError(f"verdict={record['verdict']!r}; use one of {VERDICTS}")
    name = RecordName(record["checkpoint"], record["drill_id"], record["verdict"])
    directory = join(location.path, DRILLS_DIR)
    location.backend.makedirs(directory)
    path = join(directory, name.filename)
    body = {"record_version": RECORD_VERSION, **record}
    location.backend.create_if_absent(path, (json.dumps(body, indent=1, sort_keys=True, default=str) + "\n").encode())
    log.info("drill record %s", path)
    return path


@dataclass(frozen=True)
class Listing:
    records: dict[str, list[RecordName]]  # checkpoint directory name -> its well-named records, oldest first
    malformed: list[str]  # files of ROOT/drills/ that are not a well-formed record name: never trusted


def list_records(location: Location) -> Listing:
    """One listing of ROOT/drills/, no reads: the well-named records by checkpoint, and every other file."""
    try:
        names = location.fs.ls(join(location.path, DRILLS_DIR), detail=False)
    except FileNotFoundError:
        return Listing({}, [])
    by_checkpoint: dict[str, list[RecordName]] = {}
    malformed = []
    parsed_names = []
    for name in names:
        if name.rstrip("/").rsplit("/", 1)[-1].startswith("."):
            continue  # a follower's drill lease (policies/drills/leases.py), a write in progress: never a record
        parsed = parse_record_name(name)
        if parsed is None:
            malformed.append(name.rstrip("/").rsplit("/", 1)[-1])
        else:
            parsed_names.append(parsed)
    for parsed in sorted(parsed_names, key=lambda r: r.drill_id):
        by_checkpoint.setdefault(parsed.checkpoint, []).append(parsed)
    return Listing(by_checkpoint, sorted(malformed))


def list_record_names(location: Location) -> dict[str, list[RecordName]]:
    """Checkpoint directory name -> its well-named drill records, oldest first (one listing, no reads)."""
    return list_records(location).records


def record_problem(body: Any, name: RecordName) -> str | None:
    """Why `body` is not the record its file `name` says it is (None when it is)."""
    if not isinstance(body, dict):
        return f"its body is {type(body).__name__}, not a JSON object"
    missing = [field for field in REQUIRED_FIELDS if field not in body]
    if missing:
        return f"its body lacks {missing}"
    for field, expected in (("checkpoint", name.checkpoint), ("drill_id", name.drill_id), ("verdict", name.verdict)):
        if body[field] != expected:
            return f"its body says {field}={body[field]!r}, its name {expected!r}"
    return None


def read_record(location: Location, name: RecordName) -> dict[str, Any] | None:
    """The record's JSON body; None (logged) when it cannot be read or parsed."""
    path = join(location.path, DRILLS_DIR, name.filename)
    try:
        body = bounded_json.loads(_read(location, path), bounded_json.SMALL_MAX_BYTES)
    except (OSError, ValueError) as err:
        log.warning("drill record %s is unreadable (%s); ignoring it", path, err)
        return None
    return body if isinstance(body, dict) else None


def trust_state(records: list[RecordName] | None) -> str:
    """committed | drilled | drill-failed | not-drilled, from the newest record."""
    if not records:
        return COMMITTED
    return TRUST_OF_VERDICT[records[-1].verdict]


@dataclass(frozen=True)
class TrustReport:
    states: dict[str, str]  # committed entry's directory name -> its trust state
    malformed: list[str]  # drill record files that were not trusted, each with why


def trust_report(location: Location, entries: list[CheckpointEntry]) -> TrustReport:
    """Trust state of every committed entry from its newest well-formed record, and the malformed ones.

    A passed record grants trust, so its body is read and must match its name; a malformed one is skipped
    (the record before it decides). Failed and not-drilled records withhold trust and are not read.
    """
    listing = list_records(location)
    malformed = [f"{name}: not named <checkpoint>--<drill id>--<verdict>.json" for name in listing.malformed]
    states = {}
    for entry in entries:
        if not entry.committed:
            continue
        records = list(listing.records.get(entry.name, []))
        while records and records[-1].verdict == PASSED:
            problem = _body_problem(location, records[-1])
            if problem is None:
                break
            malformed.append(f"{records[-1].filename}: {problem}")
            records.pop()
        states[entry.name] = trust_state(records)
    for line in malformed:
        log.warning("%s: drill record %s; not trusted. Delete the file if nobody's drill wrote it", location.url, line)
    return TrustReport(states, malformed)


def _body_problem(location: Location, name: RecordName) -> str | None:
    path = join(location.path, DRILLS_DIR, name.filename)
    try:
        body = bounded_json.loads(_read(location, path), bounded_json.SMALL_MAX_BYTES)
    except (OSError, ValueError) as err:  # a FIFO, a link or a huge file is an OSError here, never a hang
        return f"its body is not readable JSON ({type(err).__name__})"
    return record_problem(body, name)


def _read(location: Location, path: str) -> bytes:
    """A record's bytes: a regular file within the bound, or an OSError (never a hang on a FIFO or a link)."""
    return fsio.read_small(location.fs, path, bounded_json.SMALL_MAX_BYTES)


def trust_states(location: Location, entries: list[CheckpointEntry]) -> dict[str, str]:
    """Trust state of every committed entry, by directory name (malformed records logged, never trusted)."""
    return trust_report(location, entries).states


def newest_drilled(ordered: list[CheckpointEntry], states: dict[str, str], keep: int = 1) -> list[CheckpointEntry]:
    """The newest `keep` drilled checkpoints of `ordered` (oldest commit first), newest last."""
    drilled = [entry for entry in ordered if entry.committed and states.get(entry.name) == DRILLED]
    return drilled[-keep:] if keep > 0 else []


def remove_records(location: Location, checkpoint_name: str) -> int:
    """Delete a deleted checkpoint's drill records (best effort); returns how many went."""
    removed = 0
    for name in list_record_names(location).get(checkpoint_name, []):
        try:
            location.fs.rm_file(join(location.path, DRILLS_DIR, name.filename))
            removed += 1
        except FileNotFoundError:
            pass
    return removed
