"""Which committed checkpoints to delete, and deleting one so that no reader sees half of it."""

from __future__ import annotations

import logging

from ..engine import catalog
from ..engine.fsio import Location
from ..engine.layout import MANIFEST, join

log = logging.getLogger(__name__)


def to_delete(entries: list[catalog.CheckpointEntry], keep_last: int, keep_every_n_steps: int | None) -> list[catalog.CheckpointEntry]:
    """Committed checkpoints outside the newest `keep_last` and not on a `keep_every_n_steps` multiple.

    Uncommitted directories are never touched here (garbage collection owns them), so a checkpoint
    being written can never be deleted; `keep_last >= 1` always keeps the newest committed one.
    """
    committed = [entry for entry in entries if entry.committed]
    keep = {entry.name for entry in committed[-keep_last:]}
    if keep_every_n_steps:
        keep |= {entry.name for entry in committed if entry.step % keep_every_n_steps == 0}
    return [entry for entry in committed if entry.name not in keep]


def delete_checkpoint(location: Location, entry: catalog.CheckpointEntry) -> None:
    """Uncommit first (remove the manifest), then the rest: a crash midway leaves an uncommitted dir."""
    location.fs.rm_file(join(entry.path, MANIFEST))
    location.fs.rm(entry.path, recursive=True)
    log.info("retention: deleted %s", entry.path)


def apply(location: Location, keep_last: int, keep_every_n_steps: int | None) -> list[str]:
    deleted = []
    for entry in to_delete(catalog.list_checkpoints(location), keep_last, keep_every_n_steps):
        delete_checkpoint(location, entry)
        deleted.append(entry.name)
    return deleted
