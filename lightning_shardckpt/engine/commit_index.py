"""`latest` without listing the root: the `latest` pointer, checked against a small per-run commit index.

A listing of the root costs one LIST plus two reads per checkpoint directory (on S3: thousands of requests for
a root of thousands of checkpoints). Each commit also writes `ROOT/index/<run_id>/<seq:09d>`, holding the
directory name of the run's commit number `seq` (the manifest's `seq`), just before its manifest: so a
committed checkpoint always has its marker, and a marker may name an attempt that never committed.

`latest` then costs a bounded number of small reads and two LISTs of names: the pointer names D (run R, seq k);
D must be committed and be what marker k names (else the index does not cover it: list the root). The run's
newest commit is the highest marker above k that names a committed checkpoint of seq (one LIST of
`ROOT/index/<run_id>/`; a marker of an attempt that never committed is passed over): seqs have gaps, which
are normal (a durable tier holds every n-th commit of the run, retention prunes markers). The answer is then
checked against the root's directory names (one LIST, no reads per directory), because the pointer and the
markers are hints that can be stale or damaged: a directory of a step not below the answer's is read (its
commit record) and must not be a newer commit of the run, and the root may hold no more directories of lower
steps than the index has markers below the answer (else a marker is missing: a rollback's newer commit of a
smaller step may be among them). Whatever the index cannot vouch for, the listing decides: the index never
makes a reader pick an older checkpoint than the listing would. Roots written by more than one run (a shared
root), or by a writer that kept no index, are listed as before.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from ..errors import ShardCkptError
from .format import manifest as manifest_format
from .format.bounded_json import MANIFEST_MAX_BYTES, SMALL_MAX_BYTES
from .format.entry import COMMITTED, CheckpointEntry
from .format.names import COMMIT_RECORD, LATEST, MANIFEST, join, parse_dirname
from .storage import fsio
from .storage.fsio import Location
from .storage.small_files import SmallFileRefused

log = logging.getLogger(__name__)

INDEX_DIR = "index"
_SAFE_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MARKER_MAX_BYTES = 256  # a marker holds one directory name
POINTER_MAX_BYTES = 4096  # `latest` holds one directory name (~30 bytes)
MAX_WALK = 64  # markers above the pointer read, newest first, before giving up on the index (all failed attempts)


def read_latest_pointer(location: Location) -> str | None:
    """The directory name `latest` holds; None when it is absent or cannot be a name (only a hint, see above)."""
    path = join(location.path, LATEST)
    try:
        # a regular file within the bound: a huge file, a FIFO or a link someone put there is never read
        data = fsio.read_small(location.fs, path, POINTER_MAX_BYTES)
        return data.decode().strip() or None
    except SmallFileRefused as err:
        log.warning("%s; not a checkpoint name: ignoring it", err)
        return None
    except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
        return None


def marker_path(root_path: str, run_id: str, seq: int) -> str:
    return join(root_path, INDEX_DIR, run_id, f"{seq:09d}")


def indexable(run_id: Any, seq: Any) -> bool:
    """Whether a commit of `run_id` / `seq` gets a marker: a run id that is a plain file name, a seq >= 1."""
    return index_key(run_id, seq) is not None


def index_key(run_id: Any, seq: Any) -> tuple[str, int] | None:
    """(run_id, seq) of a commit that gets a marker (`indexable`), typed; None for one that gets none."""
    if isinstance(run_id, str) and bool(_SAFE_RUN_ID.match(run_id)) and isinstance(seq, int) and seq >= 1:
        return run_id, seq
    return None


def write_marker(fs: Any, root_path: str, manifest: dict[str, Any], dirname: str) -> None:
    """Record that `dirname` is the run's commit `seq` (written before its manifest; replaces a failed attempt's)."""
    key = index_key(manifest.get("run_id"), manifest.get("seq"))
    if key is None:
        return
    path = marker_path(root_path, *key)
    fsio.makedirs(fs, path.rsplit("/", 1)[0])
    fsio.replace_small_file(fs, path, (dirname + "\n").encode())


def newest_of_run_by_index(location: Location, run_id: str | None) -> CheckpointEntry | None:
    """The newest committed checkpoint of `run_id` (None: of the only run the index knows) from the pointer and the
    index, without listing the root; None when they cannot answer (then list the root)."""
    try:
        return _walk(location, run_id)
    except (OSError, ShardCkptError, ValueError) as err:  # unreadable hints: the listing decides
        log.debug("%s: the commit index cannot answer `latest` (%s); listing the root", location.url, err)
        return None


def _walk(location: Location, run_id: str | None) -> CheckpointEntry | None:
    name = read_latest_pointer(location)
    if name is None or parse_dirname(name) is None:
        return None
    entry = _committed(location, name)
    key = index_key(entry.run_id, entry.seq) if entry is not None else None
    if entry is None or key is None:
        return None
    run, pointed_seq = key
    if run_id is not None and run != run_id:
        return None
    if run_id is None and _runs(location) != [run]:
        return None  # a shared root: which run committed last takes a listing
    if _marker(location, run, pointed_seq) != name:
        return None  # the index does not cover the pointer's checkpoint
    seqs = marker_seqs(location, run)
    newer = sorted((seq for seq in seqs if seq > pointed_seq), reverse=True)
    for seq in newer[:MAX_WALK]:  # newest first, never seq + 1: seqs have gaps (a durable tier holds every n-th)
        following = _marker(location, run, seq)
        candidate = _committed(location, following) if following is not None else None
        if candidate is None:
            continue  # an attempt that never committed (a commit's retry would have replaced its marker)
        if candidate.run_id != run or candidate.seq != seq:
            return None  # the marker names another commit: the index is inconsistent
        entry, pointed_seq = candidate, seq
        break
    else:
        if len(newer) > MAX_WALK:
            return None  # that many markers of attempts that never committed: the listing decides
    return entry if _nothing_newer_unindexed(location, entry, pointed_seq, seqs) else None


def _nothing_newer_unindexed(location: Location, entry: CheckpointEntry, entry_seq: int, seqs: list[int]) -> bool:
    """The root's directory names (one LIST, no reads per directory) leave no room for a commit newer than `entry`
    that the index lacks (its marker deleted, or written by a writer that kept no index)."""
    try:
        listed = location.fs.ls(location.path, detail=False)
    except FileNotFoundError:
        return False
    names = [str(path).rstrip("/").rsplit("/", 1)[-1] for path in listed]
    checkpoints = [(parsed.step, name) for name in names if (parsed := parse_dirname(name)) is not None]
    # within a run's branch steps grow with seq: a directory of a lower step is older, unless a rollback's new
    # branch made it, and then every one of them has a marker of a higher seq, so the root cannot hold more
    # directories below `entry`'s step than the index has markers below its seq
    below = sum(1 for step, _ in checkpoints if step < entry.step)
    if below > sum(1 for seq in seqs if seq < entry_seq):
        return False
    # a directory of a step not below `entry`'s is read: an attempt that never committed, an abandoned branch (of
    # an older seq), or a newer commit whose marker is missing
    others = [join(location.path, name) for step, name in checkpoints if step >= entry.step and name != entry.name]
    records = [join(path, COMMIT_RECORD) for path in others]
    documents = location.backend.read_small_files(records, SMALL_MAX_BYTES) if others else {}
    for path in others:
        document = documents.get(join(path, COMMIT_RECORD), FileNotFoundError(path))
        if isinstance(document, FileNotFoundError):
            continue  # no commit record: never committed (a v1 checkpoint would be older than any indexed one)
        if isinstance(document, SmallFileRefused):
            return False  # a FIFO, a symlink or an oversized record: the listing judges (and shows) it
        if isinstance(document, BaseException):
            raise document  # transient: the caller lists the root
        record = manifest_format.parse_commit_record(document, path)
        if record.get("run_id") != entry.run_id or not isinstance(record.get("seq"), int):
            return False  # another run's commit: which is newest takes a listing
        if record["seq"] > entry_seq:
            return False
    return True


def vouches_newest(location: Location, name: str) -> bool:
    """Whether the index and the root's directory names alone vouch that nothing newer than checkpoint `name` is
    in the root, without one read inside a checkpoint directory (a resume that assembled `name` from peer copies
    reads no object of the durable tier): the root's only run's highest marker names it, no other directory has
    a step as high, and the root holds no more directories of lower steps than the index has lower markers (the
    walk's check, above). False whenever they cannot tell: then read the root."""
    parsed = parse_dirname(name)
    runs = _runs(location)
    if parsed is None or len(runs) != 1:
        return False
    seqs = marker_seqs(location, runs[0])
    if not seqs or _marker(location, runs[0], seqs[-1]) != name:
        return False  # the pointer is never asked: a lost or rewritten one would name an older checkpoint
    try:
        listed = location.fs.ls(location.path, detail=False)
    except FileNotFoundError:
        return False
    steps = [
        (entry.step, other)
        for other in (str(path).rstrip("/").rsplit("/", 1)[-1] for path in listed)
        if (entry := parse_dirname(other)) is not None
    ]
    if any(step >= parsed.step and other != name for step, other in steps):
        return False
    return sum(1 for step, _ in steps if step < parsed.step) <= len(seqs) - 1


def marker_seqs(location: Location, run_id: str) -> list[int]:
    """The seqs the run's index holds markers of: one LIST of `ROOT/index/<run_id>/`."""
    try:
        listed = location.fs.ls(join(location.path, INDEX_DIR, run_id), detail=False)
    except FileNotFoundError:
        return []
    names = (str(path).rstrip("/").rsplit("/", 1)[-1] for path in listed)
    return sorted(int(name) for name in names if name.isdigit())


def prune_markers(location: Location, entries: list[CheckpointEntry]) -> int:
    """Remove the markers of checkpoints that are gone (after retention or gc); returns how many went.

    `entries`: a listing of the root taken before the deletions. Per run, a marker goes when its seq is below the
    run's newest commit and no directory it names is left in the root (one LIST of names, and a small read of
    each such marker). Kept: markers at or above the newest commit (a save in flight writes its marker before
    its manifest), and markers of directories still there (a retired checkpoint whose files a kept incremental
    one still references, a failed attempt gc has not removed yet), which the walk's check counts.
    """
    try:
        listed = location.fs.ls(location.path, detail=False)
    except FileNotFoundError:
        return 0
    present = {str(path).rstrip("/").rsplit("/", 1)[-1] for path in listed}
    removed = 0
    for run_id in _runs(location):
        mine = [e for e in entries if e.committed and e.run_id == run_id and e.name in present and e.seq]
        if not mine or not indexable(run_id, 1):
            continue  # nothing of the run is left committed: whether a save of it is in flight is unknown
        kept = {entry.seq for entry in mine if entry.seq}  # `mine` holds only entries with a seq
        newest = max(kept)
        for seq in marker_seqs(location, run_id):
            if seq >= newest or seq in kept:
                continue
            name = _marker(location, run_id, seq)
            if name is not None and name in present:
                continue
            try:
                location.fs.rm_file(marker_path(location.path, run_id, seq))
                removed += 1
            except FileNotFoundError:  # another pruner (a gc beside retention) removed it first
                pass
    if removed:
        log.info("%s: removed %d commit index marker(s) of deleted checkpoints", location.url, removed)
    return removed


def _committed(location: Location, name: str) -> CheckpointEntry | None:
    """The listing entry of directory `name` when it is committed (manifest present, commit record valid)."""
    parsed = parse_dirname(name)
    if parsed is None:
        return None
    path = join(location.path, name)
    probed = location.backend.probe_files([join(path, MANIFEST)], MANIFEST_MAX_BYTES)[0]
    if isinstance(probed, BaseException):
        if isinstance(probed, (FileNotFoundError, IsADirectoryError, NotADirectoryError, SmallFileRefused)):
            return None
        raise probed
    try:
        data = fsio.read_small(location.fs, join(path, COMMIT_RECORD), SMALL_MAX_BYTES)
    except (FileNotFoundError, SmallFileRefused):
        return None  # v1, or a lost or planted record: the listing reads those (and shows what it is)
    record = manifest_format.parse_commit_record(data, path)
    return CheckpointEntry(name, path, parsed.step, parsed.checkpoint_id, COMMITTED, record=record, _fs=location.fs)


def _marker(location: Location, run_id: str, seq: int) -> str | None:
    path = marker_path(location.path, run_id, seq)
    try:
        data = fsio.read_small(location.fs, path, MARKER_MAX_BYTES)
    except (FileNotFoundError, IsADirectoryError, SmallFileRefused):
        return None  # absent, or not a marker we wrote: the index cannot answer for it
    name = data.decode(errors="replace").strip()
    return name if parse_dirname(name) is not None else None


def _runs(location: Location) -> list[str]:
    """The run ids the index holds markers of: one LIST of `ROOT/index/`, not of the root."""
    try:
        names = location.fs.ls(join(location.path, INDEX_DIR), detail=False)
    except FileNotFoundError:
        return []
    return sorted(str(name).rstrip("/").rsplit("/", 1)[-1] for name in names)
