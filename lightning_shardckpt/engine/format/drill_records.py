"""Drill records: the write-once side files that say whether a committed checkpoint was restored.

A checkpoint directory is never rewritten, so the result of a restore drill lives beside it:
`ROOT/drills/<checkpoint dir>--<drill id>--<verdict>.json`, created once (create-if-absent). The
verdict is in the file name, so the trust state of every checkpoint in a root comes from one listing
of `ROOT/drills/`, without reading a record; the JSON body holds the details (cause, timings, checks).
Drill ids sort by time, so the newest record of a checkpoint is its last by name.

Trust states: `committed` (no drill record yet), `drilled` (the newest drill passed), `drill-failed`
(the newest drill failed; its cause is in the record), `not-drilled` (a drill could not start: never
counted as passed). See docs/FORMAT.md, "Drill records".
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ..storage.fsio import Location
from . import bounded_json
from .entry import CheckpointEntry
from .layout import DRILLS_DIR, join, parse_dirname

log = logging.getLogger(__name__)

PASSED, FAILED, NOT_DRILLED = "passed", "failed", "not-drilled"
VERDICTS = (PASSED, FAILED, NOT_DRILLED)
COMMITTED, DRILLED, DRILL_FAILED = "committed", "drilled", "drill-failed"
TRUST_OF_VERDICT = {PASSED: DRILLED, FAILED: DRILL_FAILED, NOT_DRILLED: NOT_DRILLED}
RECORD_VERSION = 1
_SEPARATOR = "--"


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
    if len(parts) != 3 or parse_dirname(parts[0]) is None or parts[2] not in VERDICTS:
        return None
    return RecordName(*parts)


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


def list_record_names(location: Location) -> dict[str, list[RecordName]]:
    """Checkpoint directory name -> its drill records, oldest first (one listing, no reads)."""
    try:
        names = location.fs.ls(join(location.path, DRILLS_DIR), detail=False)
    except FileNotFoundError:
        return {}
    by_checkpoint: dict[str, list[RecordName]] = {}
    for parsed in sorted(filter(None, map(parse_record_name, names)), key=lambda r: r.drill_id):
        by_checkpoint.setdefault(parsed.checkpoint, []).append(parsed)
    return by_checkpoint


def read_record(location: Location, name: RecordName) -> dict[str, Any] | None:
    """The record's JSON body; None (logged) when it cannot be read or parsed."""
    path = join(location.path, DRILLS_DIR, name.filename)
    try:
        body = bounded_json.loads(location.fs.cat_file(path), bounded_json.SMALL_MAX_BYTES)
    except (OSError, ValueError) as err:
        log.warning("drill record %s is unreadable (%s); ignoring it", path, err)
        return None
    return body if isinstance(body, dict) else None


def trust_state(records: list[RecordName] | None) -> str:
    """committed | drilled | drill-failed | not-drilled, from the newest record."""
    if not records:
        return COMMITTED
    return TRUST_OF_VERDICT[records[-1].verdict]


def trust_states(location: Location, entries: list[CheckpointEntry]) -> dict[str, str]:
    """Trust state of every committed entry, by directory name."""
    records = list_record_names(location)
    return {entry.name: trust_state(records.get(entry.name)) for entry in entries if entry.committed}


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
