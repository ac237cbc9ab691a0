"""Garbage collection: remove uncommitted checkpoint directories that no save will ever finish.

A failed or abandoned save leaves a directory without a manifest (docs/FORMAT.md §4). Readers ignore
it, but it holds shard bytes. `collect` removes such a directory once its newest file is older than
the grace period, and nothing else:

- committed directories are never touched (retention owns them);
- corrupt ones (a manifest that does not parse or validate) are only reported: a person should look
  before their bytes go;
- an uncommitted directory younger than the grace may be a save in flight, and is kept;
- names that are not checkpoint directories (`latest`, `events/`, `.owner.json`, user files, a crashed
  writer's `latest.<hex>.tmp`) are never looked at, let alone removed.

Age is the time since the newest file in the directory was written (`catalog.age_seconds`); stray
`.manifest.json.<hex>.tmp` files of a failed manifest create count like any other file, and go with
their directory. A directory with no file at all has no file time:
- local storage: the directory's own mtime is its age (creating a file in it updates it, so a save
  that has just made its directory is young);
- object stores: a "directory" is a key prefix, and one with no objects has no time of its own and
  no bytes. It is removed whatever the grace: there is nothing in it that a save could lose, and a
  writer still uploading into it needs no parent (keys have none), so removing it cannot break one.

The grace must exceed the longest a save may take (write + verify + commit); the default, an hour, is
far above the collective timeouts that bound every save's waiting. Right before a directory goes, its
manifest's absence and its age are checked again, so a save that committed or wrote meanwhile is kept.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from ..engine import catalog, commit_index
from ..engine.format import references as refs
from ..engine.format.names import MANIFEST, join
from ..engine.storage.fsio import Location
from ..engine.validate import require_number

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 3600.0
MANIFEST_TMP_PREFIX = f".{MANIFEST}."  # a failed create-if-absent's temp file: .manifest.json.<hex>.tmp

# Reasons, as `--json` reports them.
REMOVE_OLD = "uncommitted and older than the grace"
REMOVE_EMPTY = "uncommitted, empty prefix on an object store (nothing to lose)"
KEEP_COMMITTED = "committed"
KEEP_CORRUPT = "corrupt: report only"
KEEP_YOUNG = "uncommitted but younger than the grace: may be a save in flight"
KEEP_UNDATED = "uncommitted, but no file has a modification time: age unknown"
KEEP_CHANGED = "changed while being collected"
KEEP_REFERENCED = "uncommitted, but a committed incremental checkpoint references its files"


@dataclass
class GcItem:
    """One checkpoint directory and what garbage collection does with it."""

    name: str
    path: str
    step: int
    id: str
    state: str  # committed | uncommitted | corrupt
    action: str  # remove | keep
    reason: str
    age_s: float | None = None
    bytes: int | None = None
    files: int | None = None  # files inside (uncommitted only)
    temp_files: int | None = None  # of which stray `.manifest.json.<hex>.tmp`
    problem: str | None = None  # corrupt: why; keep after a failed removal: the error
    removed: bool = False  # the directory is gone (never in a dry run)

    def as_dict(self) -> dict[str, Any]:
        out = {key: value for key, value in asdict(self).items() if value is not None}
        if self.action == "keep":
            out.pop("removed")
        return out


@dataclass
class GcReport:
    root: str
    grace_s: float
    dry_run: bool
    items: list[GcItem]
    markers_removed: int = 0  # commit index markers of deleted checkpoints (engine/commit_index.py)

    @property
    def to_remove(self) -> list[GcItem]:
        return [item for item in self.items if item.action == "remove"]

    @property
    def kept(self) -> list[GcItem]:
        return [item for item in self.items if item.action == "keep"]

    @property
    def failed(self) -> list[GcItem]:
        """Items that were to be removed and could not be (never in a dry run)."""
        return [
            item for item in self.items if item.action == "keep" and item.problem and item.state == catalog.UNCOMMITTED
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "grace_s": self.grace_s,
            "dry_run": self.dry_run,
            "removed": [item.as_dict() for item in self.to_remove],  # in a dry run: what would be removed
            "kept": [item.as_dict() for item in self.kept],
            "bytes_reclaimed": sum(item.bytes or 0 for item in self.to_remove if item.removed),
            "markers_removed": self.markers_removed,
        }


def plan(location: Location, grace_s: float = DEFAULT_GRACE_S) -> list[GcItem]:
    """What `collect` would do with each checkpoint directory under the root, oldest step first."""
    require_number(
        "grace_s", grace_s, at_least=0, too_small="is negative", hint="seconds; 0 removes every uncommitted directory"
    )
    entries = catalog.list_checkpoints(location)
    pinned = refs.pinned_files(location, entries)  # the reachability retention uses (engine/format/references.py)
    return [_decide(entry, location, grace_s, pinned) for entry in entries]


def collect(location: Location, grace_s: float = DEFAULT_GRACE_S, *, dry_run: bool = True) -> GcReport:
    """Remove (unless `dry_run`) every uncommitted checkpoint directory older than `grace_s` seconds."""
    items = plan(location, grace_s)
    markers = 0
    if not dry_run:
        for item in items:
            if item.action == "remove":
                _remove(location, item, grace_s)
        # the index markers of checkpoints no longer there (deleted by retention before it pruned them, by hand)
        markers = commit_index.prune_markers(location, catalog.list_checkpoints(location))
    return GcReport(location.url, grace_s, dry_run, items, markers)


# --- internals ---


def _decide(
    entry: catalog.CheckpointEntry, location: Location, grace_s: float, pinned: dict[str, set[str]] | None = None
) -> GcItem:
    item = GcItem(entry.name, join(location.url, entry.name), entry.step, entry.checkpoint_id, entry.state, "keep", "")
    if entry.state == catalog.COMMITTED:
        item.reason = KEEP_COMMITTED
        return item
    if entry.state == catalog.CORRUPT:
        item.reason, item.problem = KEEP_CORRUPT, entry.problem
        return item
    files = _files(location, entry.path)
    item.files = len(files)
    item.temp_files = sum(1 for info in files if _is_manifest_tmp(info))
    item.bytes = sum(int(info.get("size") or 0) for info in files)
    age = _age(location, entry, files)
    item.age_s = None if age is None else round(age, 3)
    if pinned is not None and (refs.everything_pinned(pinned) or pinned.get(entry.name)):
        item.reason = KEEP_REFERENCED  # retention removes it once its last referrer goes
    elif not files and not location.backend.has_directories:
        item.action, item.reason = "remove", REMOVE_EMPTY
    elif age is None:
        item.reason = KEEP_UNDATED
    elif age >= grace_s:
        item.action, item.reason = "remove", REMOVE_OLD
    else:
        item.reason = KEEP_YOUNG
    return item


def _files(location: Location, path: str) -> list[dict[str, Any]]:
    try:
        return [info for info in location.fs.ls(path, detail=True) if info.get("type") == "file"]
    except FileNotFoundError:
        return []


def _age(location: Location, entry: catalog.CheckpointEntry, files: list[dict[str, Any]]) -> float | None:
    try:
        age = catalog.age_seconds(entry, location)
    except FileNotFoundError:
        age = None
    if age is None and not files:  # an empty directory: its own mtime, where storage keeps one
        age = location.backend.directory_age_s(entry.path)
    return age


def _is_manifest_tmp(info: dict[str, Any]) -> bool:
    name = str(info.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
    return name.startswith(MANIFEST_TMP_PREFIX) and name.endswith(".tmp")


def _remove(location: Location, item: GcItem, grace_s: float) -> None:
    """Remove one uncommitted directory after checking again that it is still uncommitted and old."""
    fs, path = location.fs, join(location.path, item.name)
    try:
        if fs.exists(join(path, MANIFEST)):  # a save slower than the grace committed after all
            item.action, item.reason = "keep", f"{KEEP_CHANGED}: {MANIFEST} appeared"
            return
        entries = catalog.list_checkpoints(location)
        again = _decide(
            catalog.CheckpointEntry(item.name, path, item.step, item.id, catalog.UNCOMMITTED),
            location,
            grace_s,
            refs.pinned_files(location, entries),
        )
        if again.action != "remove":
            item.action, item.reason, item.age_s = "keep", f"{KEEP_CHANGED}: {again.reason}", again.age_s
            return
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:  # an object-store prefix whose last object went meanwhile: gone all the same
            pass
        item.removed = True
        log.info("gc: removed %s (%s, %s bytes)", path, item.reason, item.bytes)
    except OSError as err:
        item.action, item.reason, item.problem = "keep", "could not be removed", f"{type(err).__name__}: {err}"
        log.warning("gc: could not remove %s: %s", path, err)
