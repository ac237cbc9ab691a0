"""What a checkpoint root holds: committed and uncommitted checkpoints, and which one is latest.

Readers trust manifests, never the `latest` pointer alone: a stale or missing pointer falls back to
the newest committed directory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..errors import CheckpointNotFound, ShardCkptError
from . import fsio, retry
from . import manifest as manifest_format
from .fsio import Location
from .layout import LATEST, MANIFEST, join, parse_dirname

log = logging.getLogger(__name__)

COMMITTED, UNCOMMITTED, CORRUPT = "committed", "uncommitted", "corrupt"


@dataclass
class CheckpointEntry:
    """One checkpoint directory in a root."""

    name: str
    path: str
    step: int
    checkpoint_id: str
    state: str  # committed | uncommitted | corrupt
    manifest: dict[str, Any] | None = None
    problem: str | None = None  # why a directory is corrupt
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def committed(self) -> bool:
        return self.state == COMMITTED


def list_checkpoints(location: Location) -> list[CheckpointEntry]:
    """Every checkpoint directory under the root, oldest step first; manifests parsed and validated."""
    fs, root = location.fs, location.path
    try:
        names = [path.rstrip("/").rsplit("/", 1)[-1] for path in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return []
    entries = [
        CheckpointEntry(name, join(root, name), parsed.step, parsed.checkpoint_id, UNCOMMITTED)
        for name in names
        if (parsed := parse_dirname(name)) is not None
    ]
    # one batched read of every manifest (concurrent on object stores); absent means uncommitted
    documents = fs.cat([join(e.path, MANIFEST) for e in entries], on_error="return") if entries else {}
    for entry in entries:
        document = documents.get(join(entry.path, MANIFEST), FileNotFoundError())
        if isinstance(document, FileNotFoundError):
            continue
        if isinstance(document, BaseException):
            raise document  # a transient read error must not make a committed checkpoint look uncommitted
        try:
            entry.manifest = manifest_format.parse(document, entry.path)
            entry.state = COMMITTED
        except ShardCkptError as err:
            entry.state, entry.problem = CORRUPT, str(err)
    entries.sort(key=lambda e: (e.step, (e.manifest or {}).get("created_at", ""), e.name))
    return entries


def read_latest_pointer(location: Location) -> str | None:
    try:
        path = join(location.path, LATEST)
        return retry.call("read", lambda: location.fs.cat_file(path), target=path).decode().strip() or None
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def newest_committed(entries: list[CheckpointEntry]) -> CheckpointEntry | None:
    committed = [e for e in entries if e.committed]
    return committed[-1] if committed else None


def resolve_latest(location: Location, entries: list[CheckpointEntry] | None = None) -> CheckpointEntry | None:
    """The newest committed checkpoint; the pointer is only a hint, checked against the listing."""
    entries = list_checkpoints(location) if entries is None else entries
    newest = newest_committed(entries)
    pointer = read_latest_pointer(location)
    if newest is not None and pointer != newest.name:
        log.warning(
            "%s: `latest` points to %r but the newest committed checkpoint is %r; using %r",
            location.url, pointer, newest.name, newest.name,
        )
    return newest


def latest_committed_quick(location: Location) -> str | None:
    """Id of the newest committed checkpoint, for a new manifest's `parent`: the `latest` pointer when
    it names a committed directory (two small reads), a full listing only when it does not."""
    pointer = read_latest_pointer(location)
    parsed = parse_dirname(pointer) if pointer else None
    manifest = join(location.path, pointer, MANIFEST) if parsed is not None else ""
    if parsed is not None and retry.call("exists", lambda: location.fs.exists(manifest), target=manifest):
        return parsed.checkpoint_id
    newest = newest_committed(list_checkpoints(location))
    return newest.checkpoint_id if newest else None


def find(location: Location, which: str | int = "latest") -> CheckpointEntry:
    """Pick a committed checkpoint by `latest`, a step number, an id or a directory name."""
    entries = list_checkpoints(location)
    if which == "latest":
        chosen = resolve_latest(location, entries)
    else:
        text = str(which)
        matches = [
            e for e in entries
            if e.name == text or e.checkpoint_id == text or (text.isdigit() and e.step == int(text))
        ]
        uncommitted = [e for e in matches if not e.committed]
        matches = [e for e in matches if e.committed]
        if uncommitted and not matches:
            raise CheckpointNotFound(
                f"{uncommitted[-1].path} is {uncommitted[-1].state}, not committed"
                + (f" ({uncommitted[-1].problem})" if uncommitted[-1].problem else "")
                + "; it will never be loaded. Pick a committed one: shardckpt ls " + location.url
            )
        chosen = matches[-1] if matches else None
    if chosen is None:
        committed = [e.name for e in entries if e.committed]
        hint = f"committed here: {committed[-5:]}" if committed else "there is no committed checkpoint here"
        raise CheckpointNotFound(f"no committed checkpoint {which!r} in {location.url}; {hint}")
    return chosen


def open_checkpoint(url: str, which: str | int = "latest", storage_options: dict | None = None) -> tuple[Location, CheckpointEntry]:
    """Accept a root (with `which`) or a checkpoint directory itself; return its root and entry."""
    location = fsio.resolve(url, storage_options)
    if parse_dirname(location.path) is not None:
        root, name = location.path.rstrip("/").rsplit("/", 1)
        root_location = Location(fs=location.fs, path=root, url=root)
        return root_location, find(root_location, name)
    if not location.fs.exists(location.path):
        raise CheckpointNotFound(f"{url} does not exist; check the path (and storage_options for remote storage)")
    return location, find(location, which)


def age_seconds(entry: CheckpointEntry, location: Location) -> float | None:
    """Seconds since the checkpoint was created (manifest time) or last written to (uncommitted)."""
    now = datetime.now(timezone.utc)
    if entry.manifest is not None:
        return (now - datetime.fromisoformat(entry.manifest["created_at"])).total_seconds()
    newest = None
    for info in location.fs.ls(entry.path, detail=True) or []:
        stamp = _modified(info)
        if stamp is not None and (newest is None or stamp > newest):
            newest = stamp
    return None if newest is None else (now - newest).total_seconds()


def size_bytes(entry: CheckpointEntry, location: Location) -> int:
    if entry.manifest is not None:
        return manifest_format.total_bytes(entry.manifest)
    return sum(info.get("size") or 0 for info in location.fs.ls(entry.path, detail=True) if info.get("type") == "file")


def _modified(info: dict[str, Any]) -> datetime | None:
    stamp = info.get("mtime") or info.get("LastModified") or info.get("created")
    if stamp is None:
        return None
    if isinstance(stamp, datetime):
        return stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc)
    return datetime.fromtimestamp(float(stamp), tz=timezone.utc)
