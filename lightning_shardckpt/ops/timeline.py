"""What `shardckpt timeline` computes, as a plain JSON-ready dict; cli/investigate.py prints it.

Every checkpoint directory under a root, plus the attempts the event log knows of that left no directory
(failed before writing, or skipped), in the order they happened. A directory without a manifest is *failed*
when an event says so (with its cause) or when it is older than the grace period; younger and without a
failure event, it is *in-flight*. Committed checkpoints that retention deleted are not listed. Committed rows
carry `metrics`, the outcome recorded at save time (engine/format/outcomes.py). Each committed checkpoint is
compared with the previous committed one as `diff` would (ops/diff.py): where a block changed, the row's
`identity_changed` names it. A run that resumed is a row of its own, state *resumed*, with `resume`: the
checkpoint it resumed from and the world size before and after.
"""

from __future__ import annotations

import math
import time
from datetime import datetime, timezone
from typing import Any

from ..engine import catalog
from ..engine.format import drill_records
from ..engine.format.manifest import IDENTITY_BLOCKS, canonical_digest
from ..engine.format.names import join, parse_dirname
from ..engine.format.outcomes import decode_metrics
from ..engine.metrics import COMMITTED, FAILED, SKIPPED, read_events
from ..engine.storage.fsio import Location
from ..errors import ShardCkptError
from .diff import changed_blocks
from .manifest_summary import read_summary

IN_FLIGHT_GRACE_S = 600.0  # an uncommitted directory last written within this is a save still running
IN_FLIGHT = "in-flight"
RESUMED = "resumed"  # a timeline row for a run that resumed from a checkpoint (ROOT/events/resume-*)
RESUME_EVENT = "resume"  # the `event` of what ShardedCheckpoint writes when a run resumes
IDENTITY_DIGESTS = "identity_digests"  # a v4 commit record's summary: each identity block as a digest


def timeline(location: Location, grace_s: float = IN_FLIGHT_GRACE_S) -> dict[str, Any]:
    """The root's checkpoints and attempts in the order they happened, with state, cause and identity changes.

    Costs what `ls` does plus one read of each committed manifest, streamed: the rows are ordered first
    (a committed checkpoint by its commit record's time, which is its manifest's), then each manifest is
    read in that order, its fields outside the tensor table taken (ops/manifest_summary.py) and compared
    with the previous one, and dropped. At most two summaries are held at once, never a tensor table.
    """
    entries = catalog.list_checkpoints(location)
    all_events, events_problem = _read_events(location)
    # save attempts only: a resume (or drill) event is about a run, not an attempt, and has no outcome
    events = [event for event in all_events if event.get("event") is None]
    by_id: dict[str, dict[str, Any]] = {}
    for event in events:  # oldest first: the last event of an id wins
        if event.get("checkpoint_id"):
            by_id[event["checkpoint_id"]] = event
    # (time, step, name, what makes the row): ordered before any manifest is read. A committed
    # checkpoint goes by its commit record's time (its manifest's); the others need no manifest.
    pending: list[tuple[float | None, Any, str, Any]] = []
    for entry in entries:
        if entry.committed:
            pending.append((_record_time(entry), entry.step, entry.name, entry))
        else:
            stamp, row, _ = _entry_item(entry, location, by_id.get(entry.checkpoint_id), grace_s)
            pending.append((stamp, entry.step, entry.name, row))
    # attempts that left no directory: failed before writing, or skipped. Committed ones that left
    # (retention) are not part of the lineage any more.
    on_storage = {entry.checkpoint_id for entry in entries}
    for event in events:
        checkpoint_id = event.get("checkpoint_id")
        if event.get("outcome") == COMMITTED or checkpoint_id in on_storage:
            continue
        if checkpoint_id is None or by_id[checkpoint_id] is event:  # one row per id: its last event
            stamp, row = _event_item(event)
            pending.append((stamp, row["step"], row["name"] or "", row))
    resumes = [event for event in all_events if event.get("event") == RESUME_EVENT]
    for event in resumes:
        stamp = event.get("created_at")
        pending.append((stamp, event.get("step"), "", event))
    # in the order they happened; an attempt with no time at all goes last
    pending.sort(key=lambda item: (item[0] if item[0] is not None else math.inf, item[1], item[2]))
    rows: list[dict[str, Any]] = []
    resume_rows: list[tuple[dict[str, Any], dict[str, Any]]] = []
    world_sizes: dict[str, Any] = {}  # checkpoint name -> its world size: what a resume row shows as before
    previous: tuple[dict[str, Any], str, catalog.CheckpointEntry | None] | None = None
    for _, _, _, source in pending:
        if isinstance(source, catalog.CheckpointEntry):
            _, row, summary = _entry_item(source, location, by_id.get(source.checkpoint_id), grace_s)
        elif source.get("event") == RESUME_EVENT:
            row, summary = {}, None
            resume_rows.append((row, source))  # filled once every world size is known
        else:
            row, summary = source, None
        row["identity_changed"], row["identity_changes"], row["compared_with"] = [], {}, None
        if summary is not None:
            world_sizes[row["name"]] = (summary.get("topology") or {}).get("world_size")
            if previous is not None:
                before, after = previous[0], summary
                if _identity_digests(before) != _identity_digests(after):  # the lines need the blocks themselves
                    before, after = (
                        _with_identity(location, before, previous[2]),
                        _with_identity(location, after, source),
                    )
                else:  # the same identity: only the topology can differ (a v4 record's summary has no blocks)
                    before, after = _without_identity(before), _without_identity(after)
                row["identity_changed"], row["identity_changes"] = changed_blocks(before, after)
                row["compared_with"] = previous[1]
            # the one before is dropped here: two summaries at most
            previous = (summary, row["name"], source if isinstance(source, catalog.CheckpointEntry) else None)
        rows.append(row)
    for row, event in resume_rows:
        changes = {key: row[key] for key in ("identity_changed", "identity_changes", "compared_with")}
        row.clear()  # in place, the rows list holds it; the resume fields come first, as printed
        row.update(_resume_item(event, world_sizes))
        row.update(changes)
    # after the reads: a manifest found corrupt or gone on reading is neither trusted nor last good
    trust = drill_records.trust_states(location, entries)  # one listing of ROOT/drills/
    good = catalog.last_good(location, entries)
    for row in rows:
        if "trust" in row:
            row["trust"] = trust.get(row["name"])
            row["last_good"] = bool(good) and row["name"] == good[-1].name
    return {
        "root": location.url,
        "grace_s": grace_s,
        "events": len(all_events),
        "events_problem": events_problem,
        "last_good": good[-1].name if good else None,
        "checkpoints": rows,
    }


def _identity_digests(summary: dict[str, Any]) -> dict[str, str | None]:
    """Each compared identity block's digest: recorded by a v4 commit record, else computed from the block."""
    recorded = summary.get(IDENTITY_DIGESTS)
    if isinstance(recorded, dict):
        return {block: recorded.get(block) for block in IDENTITY_BLOCKS}
    identity = summary.get("identity") or {}
    return {
        block: None if identity.get(block) is None else canonical_digest(identity[block]) for block in IDENTITY_BLOCKS
    }


def _without_identity(summary: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in summary.items() if key != "identity"}


def _with_identity(
    location: Location, summary: dict[str, Any], entry: catalog.CheckpointEntry | None
) -> dict[str, Any]:
    """The summary with its identity blocks: a v4 record's summary holds digests only, so its manifest is read."""
    if "identity" in summary or entry is None:
        return summary
    try:
        return read_summary(location.fs, entry, from_record=False)
    except ShardCkptError:
        return summary  # unreadable now: compared by digests alone (no lines)


def _record_time(entry: catalog.CheckpointEntry) -> float | None:
    stamp = entry.created_at
    return None if stamp is None else stamp.timestamp()


def _entry_item(
    entry: catalog.CheckpointEntry, location: Location, event: dict[str, Any] | None, grace_s: float
) -> tuple[float | None, dict[str, Any], dict[str, Any] | None]:
    summary = None
    if entry.committed:
        try:
            # read now, tables skipped; a bad or vanished one marks the entry, never stops the timeline
            summary = read_summary(location.fs, entry)
        except ShardCkptError:
            summary = None
    age = catalog.age_seconds(entry, location)
    if age is None and summary is None:  # an empty directory: the directory's own time
        age = _directory_age(location, entry.path)
    stamp = None if age is None else time.time() - age
    cause = None
    if entry.state == catalog.COMMITTED:  # its summary was read above (an unreadable one marks the entry)
        stamp = datetime.fromisoformat((summary or {})["created_at"]).timestamp()
        state = COMMITTED
        if event is not None and event.get("outcome") != COMMITTED:  # the manifest decides; the event is a note
            cause = f"the writer reported {event.get('outcome')} after the commit: {event.get('cause')}"
    elif entry.state == catalog.CORRUPT:
        state, cause = catalog.CORRUPT, entry.problem
    elif event is not None and event.get("outcome") == COMMITTED:
        state, cause = (
            catalog.UNCOMMITTED,
            "committed when saved, but manifest.json is gone: deleted, or a deletion was interrupted",
        )
    elif event is not None:
        state, cause = FAILED, event.get("cause") or event.get("outcome")
        stamp = event.get("created_at", stamp)
    elif age is not None and age < grace_s:
        state = IN_FLIGHT
    else:
        state = FAILED
        cause = "uncommitted, and no event recorded: the writer died, or write_events was off"
    row = {
        "name": entry.name,
        "path": join(location.url, entry.name),
        "id": entry.checkpoint_id,
        "parent": (summary or {}).get("parent"),
        "step": entry.step,
        "epoch": (summary or {}).get("epoch"),
        "created_at": _iso(stamp),
        "age_s": None if stamp is None else round(time.time() - stamp, 3),
        "bytes": catalog.size_bytes(entry, location),
        "state": state,
        "cause": cause,
        "verification": (summary or {}).get("verification"),
        "metrics": decode_metrics(summary),  # the outcome at save time: {} when none was recorded
        "event": _event_summary(event),
        "trust": None,  # set once every manifest is read (timeline)
        "last_good": False,
    }
    return stamp, row, summary


def _event_item(event: dict[str, Any]) -> tuple[float | None, dict[str, Any]]:
    stamp = event.get("created_at")
    outcome = event.get("outcome")
    row = {
        "name": None,
        "path": event.get("path"),
        "id": event.get("checkpoint_id"),
        "parent": None,
        "step": event.get("step"),
        "epoch": None,
        "created_at": _iso(stamp),
        "age_s": None if stamp is None else round(time.time() - stamp, 3),
        "bytes": None,
        "state": SKIPPED if outcome == SKIPPED else FAILED,
        "cause": event.get("cause") or outcome,
        "verification": None,
        "event": _event_summary(event),
    }
    return stamp, row


def _resume_item(event: dict[str, Any], world_sizes: dict[str, Any]) -> dict[str, Any]:
    """A run resumed: from which checkpoint, on how many ranks before and after, how long it took."""
    stamp = event.get("created_at")
    source = str(event.get("from") or "")
    name = source.rstrip("/").rsplit("/", 1)[-1] or None
    before = event.get("from_world_size")
    if before is None:  # events written before they carried it: the checkpoint's own topology, when it read
        before = world_sizes.get(name) if name is not None else None
    parsed = parse_dirname(name) if name else None
    resume = {
        "from": name,
        "from_path": source or None,
        "from_id": event.get("from_id") or (parsed.checkpoint_id if parsed else None),
        "world_size_before": before,
        "world_size_after": event.get("world_size"),
        "seconds": event.get("seconds"),
        "identity_differences": sorted(event.get("differences") or {}),
    }
    row = {
        "name": None,
        "path": None,
        "id": None,
        "parent": resume["from_id"],
        "step": event.get("step"),
        "epoch": None,
        "created_at": _iso(stamp),
        "age_s": None if stamp is None else round(time.time() - stamp, 3),
        "bytes": None,
        "state": RESUMED,
        "cause": None,
        "verification": None,
        "event": None,
        "resume": resume,
    }
    return row


def _event_summary(event: dict[str, Any] | None) -> dict[str, Any] | None:
    if event is None:
        return None
    keys = ("outcome", "cause", "pause_s", "stage_s", "write_s", "verify_s", "commit_s", "total_s", "bytes_total")
    return {key: event.get(key) for key in keys}


def _read_events(location: Location) -> tuple[list[dict[str, Any]], str | None]:
    try:
        return read_events(location), None
    except (OSError, ValueError, KeyError, TypeError) as err:  # the log is informational: show the checkpoints anyway
        return [], f"the event log under {join(location.url, 'events')} could not be read ({type(err).__name__}: {err})"


def _directory_age(location: Location, path: str) -> float | None:
    try:
        stamp = location.fs.info(path).get("mtime")  # local filesystems; object stores have no directory times
        return None if stamp is None else time.time() - float(stamp)
    except (OSError, ValueError, TypeError):
        return None


def _iso(stamp: float | None) -> str | None:
    if stamp is None:
        return None
    return datetime.fromtimestamp(stamp, tz=timezone.utc).isoformat(timespec="milliseconds")
