"""`latest` without listing the root: the `latest` pointer, checked against a small per-run commit index.

A listing of the root costs one LIST plus two reads per checkpoint directory (on S3: thousands of requests for
a root of thousands of checkpoints). Each commit also writes `ROOT/index/<run_id>/<seq:09d>`, holding the
directory name of the run's commit number `seq` (the manifest's `seq`), just before its manifest: so a
committed checkpoint always has its marker, and a marker may name an attempt that never committed.

`latest` then costs a bounded number of small reads: the pointer names D (run R, seq k); D must be committed
and be what marker k names (else the index does not cover it: list the root); marker k+1 absent means D is
the run's newest commit; present, it names the next commit (or a failed attempt, whose retry would have
replaced it) and the walk goes on. The pointer is only a hint here too, as FORMAT.md §4 asks: what decides is
that no newer commit of the run exists. Roots written by more than one run (a shared root), or by a writer
that kept no index, are listed as before.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from ..errors import ShardCkptError
from .format import manifest as manifest_format
from .format.bounded_json import MANIFEST_MAX_BYTES, SMALL_MAX_BYTES
from .format.entry import COMMITTED, CheckpointEntry
from .format.layout import COMMIT_RECORD, LATEST, MANIFEST, join, parse_dirname
from .storage import fsio
from .storage.fsio import Location
from .storage.small_files import SmallFileRefused

log = logging.getLogger(__name__)

INDEX_DIR = "index"
_SAFE_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MARKER_MAX_BYTES = 256  # a marker holds one directory name
POINTER_MAX_BYTES = 4096  # `latest` holds one directory name (~30 bytes)
MAX_WALK = 64  # commits past the pointer followed before giving up on the index (a pointer this stale: list)


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
    return isinstance(run_id, str) and bool(_SAFE_RUN_ID.match(run_id)) and isinstance(seq, int) and seq >= 1


def write_marker(fs: Any, root_path: str, manifest: dict[str, Any], dirname: str) -> None:
    """Record that `dirname` is the run's commit `seq` (written before its manifest; replaces a failed attempt's)."""
    run_id, seq = manifest.get("run_id"), manifest.get("seq")
    if not indexable(run_id, seq):
        return
    path = marker_path(root_path, run_id, seq)
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
    if entry is None or not indexable(entry.run_id, entry.seq):
        return None
    if run_id is not None and entry.run_id != run_id:
        return None
    if run_id is None and _runs(location) != [entry.run_id]:
        return None  # a shared root: which run committed last takes a listing
    if _marker(location, entry.run_id, entry.seq) != name:
        return None  # the index does not cover the pointer's checkpoint
    for _ in range(MAX_WALK):
        following = _marker(location, entry.run_id, entry.seq + 1)
        if following is None:
            return entry
        candidate = _committed(location, following)
        if candidate is None:
            return entry  # an attempt that never committed (a commit's retry would have replaced its marker)
        if candidate.run_id != entry.run_id or candidate.seq != entry.seq + 1:
            return None
        entry = candidate
    return None


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
