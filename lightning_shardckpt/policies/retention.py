"""Which committed checkpoints to delete, and deleting one so that no reader sees half of it.

Retention works per run and in commit order, never across runs and never by step:
- only the run's own checkpoints (its `run_id`) are candidates: in a shared root another run's are
  never touched;
- "the newest N" are the run's N most recent commits (`catalog.run_order`: seq, then time). After a
  rollback (resume from step 6 while step 9 exists) the new branch's commits are the newest; the
  abandoned branch's checkpoints (step 9) stay while they are within the window, and age out of it
  as the new branch commits. They are never `latest` (catalog.newest_committed);
- the checkpoint just committed is kept whatever the order says;
- the run's newest `keep_last_drilled` drilled checkpoints (default 1: the last known-good, see
  engine/format/drill_records.py) are kept on top of the window, so a rollback target always exists.

Two processes may apply retention to one root at once (two jobs of a run, or a job and `shardckpt gc`):
they pick the same checkpoints, and whatever one of them removed first counts as gone for the other,
never as an error.

Deletion goes by reachability (incremental checkpoints, docs/FORMAT.md §9): a deleted checkpoint is
uncommitted first and keeps only the files a kept checkpoint references (engine/format/references.py's
`pinned_files`, which gc uses too), until its last referrer goes.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

from ..engine import catalog, commit_index
from ..engine.format import drill_records
from ..engine.format import references as refs
from ..engine.format.names import MANIFEST, join
from ..engine.storage.fsio import Location

log = logging.getLogger(__name__)


def to_delete(
    entries: list[catalog.CheckpointEntry],
    keep_last: int,
    keep_every_n_steps: int | None,
    *,
    run_id: str | None = None,
    just_committed: str | None = None,
    drilled: set[str] | frozenset[str] = frozenset(),
) -> list[catalog.CheckpointEntry]:
    """The run's committed checkpoints outside its newest `keep_last` commits and not on a
    `keep_every_n_steps` multiple; never `just_committed` (a directory name) nor one named in `drilled`.

    Uncommitted directories are never touched here (garbage collection owns them), so a checkpoint
    being written can never be deleted; `keep_last >= 1` always keeps the run's newest commit.
    `run_id=None`: the run that committed last (in a root with one run, that run).
    """
    if run_id is None:
        newest = catalog.newest_committed(entries)
        run_id = newest.run_id if newest is not None else None
    committed = catalog.committed_of_run(entries, run_id)
    keep = {entry.name for entry in committed[-keep_last:]}
    if just_committed is not None:
        keep.add(just_committed)
    keep |= set(drilled)
    if keep_every_n_steps:
        keep |= {entry.name for entry in committed if entry.step % keep_every_n_steps == 0}
    return [entry for entry in committed if entry.name not in keep]


def delete_checkpoint(
    location: Location, entry: catalog.CheckpointEntry, pinned: dict[str, set[str]] | None = None, fault: Any = None
) -> None:
    """Uncommit first, then delete only what no kept checkpoint references (`pinned`: refs.pinned_files).

    Order, each step safe to crash after: (1) a RETIRED marker (the directory may lose its manifest:
    gc and retention then know it is not a save in flight); (2) the manifest (uncommitted: no reader
    picks it); (3) every file no kept manifest references; (4) the directory, once nothing in it is
    referenced. A referenced file stays until its last referrer goes (`sweep_retired`).
    `pinned=None`: compute reachability now over every other committed checkpoint.
    """
    fs = location.fs
    step = fault or (lambda point: None)
    if pinned is None:
        entries = catalog.list_checkpoints(location)
        pinned = refs.pinned_files(
            location, entries, keep={e.name for e in entries if e.committed and e.name != entry.name}
        )
    try:
        fs.pipe_file(join(entry.path, refs.RETIRED), b"retired by retention\n")
    except FileNotFoundError:  # another deleter removed the directory already
        log.info("retention: %s was already deleted (another process applies retention to this root)", entry.path)
        return
    step("retired")
    _remove_file(fs, join(entry.path, MANIFEST))
    step("uncommitted")
    _remove_unreferenced(location, entry.path, entry.name, pinned, step)
    log.info("retention: deleted %s", entry.path)


def sweep_retired(
    location: Location, entries: list[catalog.CheckpointEntry], pinned: dict[str, set[str]], fault: Any = None
) -> list[str]:
    """Finish retired directories (uncommitted, with a RETIRED marker) whose files are no longer referenced."""
    done = []
    for entry in entries:
        if entry.state != catalog.UNCOMMITTED or not location.fs.exists(join(entry.path, refs.RETIRED)):
            continue
        if _remove_unreferenced(location, entry.path, entry.name, pinned, fault or (lambda point: None)):
            done.append(entry.name)
    return done


def _remove_unreferenced(location: Location, path: str, name: str, pinned: dict[str, set[str]], step: Any) -> bool:
    """Steps (3) and (4) of delete_checkpoint; True when the directory is gone."""
    fs = location.fs
    if refs.everything_pinned(pinned):  # a kept manifest could not be read: its references are unknown
        log.warning("retention: %s is retired but kept: reachability unknown (a damaged manifest)", path)
        return False
    keep = pinned.get(name, set())
    if keep:
        try:
            infos = fs.ls(path, detail=True)
        except FileNotFoundError:  # another deleter got here first
            return True
        for info in infos:
            file = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            if info.get("type") == "file" and file not in keep and file != refs.RETIRED:
                _remove_file(fs, join(path, file))
                step("file_removed")
        log.info("retention: %s keeps %d file(s) that kept checkpoints reference", path, len(keep))
        return False
    if not _remove_directory(fs, path):
        return False
    step("removed")
    return True


def _remove_file(fs: Any, path: str) -> None:
    """Remove one file; one another deleter removed first is gone all the same."""
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


REMOVE_ATTEMPTS = 5


def _remove_directory(fs: Any, path: str) -> bool:
    """Remove `path` and all in it; True once it is gone, whoever removed it.

    Another deleter racing this one removes entries under the walk (FileNotFoundError) or writes its
    RETIRED marker back after the walk listed the directory (not empty): look again, up to a few times.
    """
    for attempt in range(1, REMOVE_ATTEMPTS + 1):
        try:
            fs.rm(path, recursive=True)
            return True
        except FileNotFoundError:
            pass
        except OSError as err:
            if err.errno != errno.ENOTEMPTY:
                raise
        if not fs.exists(path):
            return True
        log.debug("retention: %s changed while it was removed (attempt %d); removing again", path, attempt)
    log.warning(
        "retention: %s is still there after %d attempts (something keeps writing into it); the next retention "
        "pass or `shardckpt gc` removes it",
        path,
        REMOVE_ATTEMPTS,
    )
    return False


def apply(
    location: Location,
    keep_last: int,
    keep_every_n_steps: int | None,
    *,
    run_id: str | None = None,
    just_committed: str | None = None,
    keep_last_drilled: int = 1,
    spare: set[str] | frozenset[str] = frozenset(),
) -> list[str]:
    """Delete the run's checkpoints that fall out of the window (see to_delete); return their names.

    One listing of commit records (no manifest is parsed); safe to run off the training thread.
    """
    deleted = []
    entries = catalog.list_checkpoints(location)
    drilled = (
        {entry.name for entry in catalog.last_good(location, entries, run_id, keep=keep_last_drilled)}
        if keep_last_drilled
        else set()
    )
    drilled |= set(spare)  # e.g. checkpoints a drill is about to restore: deleting them would fail the drill
    doomed = to_delete(
        entries, keep_last, keep_every_n_steps, run_id=run_id, just_committed=just_committed, drilled=drilled
    )
    gone = {entry.name for entry in doomed}
    # one reachability computation (the files every kept checkpoint references), shared with gc
    pinned = refs.pinned_files(location, entries, keep={e.name for e in entries if e.committed and e.name not in gone})
    for entry in doomed:
        delete_checkpoint(location, entry, pinned)
        drill_records.remove_records(
            location, entry.name
        )  # after the checkpoint: a crash leaves records, never a drilled-looking hole
        deleted.append(entry.name)
    sweep_retired(location, entries, pinned)  # earlier deletions whose files no kept checkpoint references any more
    if deleted:
        # the index markers of what went (else a root keeps one per save ever made); the walk tolerates the gaps
        try:
            commit_index.prune_markers(location, entries)
        except OSError as err:  # markers are hints: the next pass, or `shardckpt gc`, prunes them
            log.warning("retention: could not prune the commit index of %s: %s", location.url, err)
    return deleted
