"""Per-checkpoint records, run counters, and the event log under the checkpoint root.

The event log is one small JSON file per checkpoint attempt (`ROOT/events/<…>.json`), written once by
the coordinator with create-if-absent, rather than one appended file: object stores cannot append,
and a file written once can never be interleaved or half-overwritten by another rank or another run.
`read_events` returns them in order as the log's lines.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from .format import bounded_json
from .format.names import EVENTS_DIR, join
from .storage import fsio
from .storage.fsio import Location
from .storage.small_files import SmallFileRefused

log = logging.getLogger(__name__)

COMMITTED, FAILED, SKIPPED = "committed", "failed", "skipped"


@dataclass
class CheckpointRecord:
    """What one checkpoint attempt cost and how it ended, as seen by one rank."""

    step: int
    rank: int
    outcome: str  # committed | failed | skipped
    checkpoint_id: str | None = None
    path: str | None = None
    cause: str | None = None  # why it failed or was skipped
    pause_s: float = 0.0  # time the training thread was blocked (waiting for a slot + staging)
    stage_s: float = (
        0.0  # copy into staging buffers (with overlap_staging: only the part the training thread waits for)
    )
    overlap_copy_s: float = 0.0  # overlap_staging: the background copy of parameters and optimizer state
    # overlap_staging: time the training thread blocked at the fence for that copy (the in-loop stall beyond pause_s)
    overlap_wait_s: float = 0.0
    write_s: float = 0.0  # writing this rank's shard file
    verify_s: float = 0.0  # reading back the sampled chunks
    commit_s: float = 0.0  # coordinator: completeness check, metadata, manifest, latest
    total_s: float = 0.0  # from the save call until the outcome was known
    bytes_rank: int = 0
    bytes_total: int | None = None  # all ranks' files (known on the coordinator)
    write_gbps: float = 0.0  # this rank's bytes / write_s, in GB/s
    storage_retries: int = 0  # transient storage errors retried while this save ran (timeouts, 5xx)
    cleanup: str | None = None  # coordinator, failed save: "removed" (its directory) or "left" (for `shardckpt gc`)
    ranks: list[dict[str, Any]] = field(
        default_factory=list
    )  # coordinator, committed: per rank bytes, write_s, write_gbps
    run_id: str | None = None  # the run this attempt belongs to (the saver's run id)
    created_at: float = field(default_factory=time.time)
    manifest: dict[str, Any] | None = field(default=None, repr=False)  # the coordinator's, when committed

    def as_dict(self) -> dict[str, Any]:
        # not dataclasses.asdict: it deep-copies `manifest` (an entry per tensor) on every save, only to drop it
        out = {item.name: getattr(self, item.name) for item in fields(self) if item.name != "manifest"}
        out["ranks"] = [dict(rank) for rank in self.ranks]  # the one mutable field left: a copy, as asdict gave
        return out

    def metrics(self, prefix: str = "checkpoint/") -> dict[str, float]:
        """The numeric fields, named for a logger."""
        numeric = {
            key: float(value)
            for key, value in self.as_dict().items()
            if isinstance(value, (int, float))
            and not isinstance(value, bool)
            and key not in ("step", "rank", "created_at")
        }
        return {f"{prefix}{key}": value for key, value in numeric.items()}


# housekeeping counters (RunCounters.note): what the engine cleaned up, or could not, around the saves
FAILED_DIRS_REMOVED = "failed_dirs_removed"  # failed attempts whose directory the coordinator removed
FAILED_DIRS_LEFT = "failed_dirs_left"  # failed attempts left for `shardckpt gc` (no common verdict, or removal failed)
RETENTION_ERRORS = "retention_errors"  # retention passes that raised (logged; the next commit's pass retries)


class RunCounters:
    """attempted / committed / failed / skipped over the life of one saver, and housekeeping notes; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {"attempted": 0, COMMITTED: 0, FAILED: 0, SKIPPED: 0}
        self._notes: dict[str, int] = {}

    def count(self, outcome: str) -> None:
        with self._lock:
            self._counts["attempted"] += 1
            self._counts[outcome] += 1

    def note(self, name: str) -> None:
        """Count a housekeeping event (FAILED_DIRS_REMOVED, FAILED_DIRS_LEFT, RETENTION_ERRORS)."""
        with self._lock:
            self._notes[name] = self._notes.get(name, 0) + 1

    def snapshot(self) -> dict[str, int]:
        """The save outcomes: attempted, committed, failed, skipped."""
        with self._lock:
            return dict(self._counts)

    def notes(self) -> dict[str, int]:
        """The housekeeping counters that happened at least once."""
        with self._lock:
            return dict(self._notes)


def event_payload(
    record: CheckpointRecord, counters: dict[str, int], notes: dict[str, int] | None = None
) -> dict[str, Any]:
    """What an attempt's event file holds: the record, the run's outcome counters and housekeeping notes.

    Health rules evaluate exactly this document, online (from the saver) and offline (from ROOT/events/),
    so both see the same numbers.
    """
    return {**record.as_dict(), "counters": counters, **({"housekeeping": notes} if notes else {})}


def write_event(
    root: Location, record: CheckpointRecord, counters: dict[str, int], notes: dict[str, int] | None = None
) -> None:
    """Write the record as this attempt's event file; never raises (metrics must not fail a run)."""
    prefix = f"step-{record.step:09d}-{record.checkpoint_id or 'none'}-{record.outcome}"
    write_json_event(root, prefix, event_payload(record, counters, notes))


def write_json_event(root: Location, prefix: str, payload: dict[str, Any]) -> None:
    """Write a non-checkpoint event (e.g. a resume and its identity comparison) once; never raises."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}.json"
    try:
        root.backend.makedirs(join(root.path, EVENTS_DIR))
        document = json.dumps({"created_at": time.time(), **payload}, sort_keys=True, default=str).encode()
        # not fsynced: an event is written after its checkpoint's commit, which it does not decide, so a crash
        # can lose the event, never a checkpoint (two fsyncs per save, ~5 ms of the saver thread's time here)
        root.backend.create_if_absent_not_durable(join(root.path, EVENTS_DIR, name), document)
    except Exception:
        log.warning("could not write event %s", name, exc_info=True)


def read_events(root: Location | str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every event under the checkpoint root (a Location or URL), oldest first."""
    if not isinstance(root, Location):
        root = fsio.resolve(root, storage_options)
    try:
        paths = root.fs.glob(join(root.path, EVENTS_DIR, "*.json"))
    except FileNotFoundError:
        return []
    events = [event for event in (_read_event(root, path) for path in paths) if event is not None]
    return sorted(events, key=lambda event: (event["created_at"], event.get("step", -1)))


def _read_event(root: Location, path: str) -> dict[str, Any] | None:
    """One event file; None (logged, naming it) when it is unreadable: one bad file never hides the others."""
    try:
        event = bounded_json.loads(
            fsio.read_small(root.fs, path, bounded_json.SMALL_MAX_BYTES), bounded_json.SMALL_MAX_BYTES
        )
    except FileNotFoundError:  # removed since the glob
        return None
    except (bounded_json.UnreadableJson, SmallFileRefused) as err:  # a FIFO, a link, a huge file: never read
        log.warning("event %s is unreadable (%s); skipping it. Delete it if nothing else reads it", path, err)
        return None
    if not isinstance(event, dict) or not isinstance(event.get("created_at"), (int, float)):
        log.warning("event %s is not an event of lightning_shardckpt (no created_at); skipping it", path)
        return None
    return event
