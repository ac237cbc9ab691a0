"""`latest` without listing the root: the `latest` pointer, checked against a small per-run commit index.

A listing of the root costs one LIST plus two reads per checkpoint directory (on S3: thousands of requests for
a root of thousands of checkpoints). Each commit also writes a marker `ROOT/index/<run_id>/<seq:09d>.<dirname>`:
its file name says that directory `dirname` is the run's commit number `seq` (the manifest's `seq`), so one LIST
of `ROOT/index/<run_id>/` gives every (seq, directory) pair without a read per marker. It is written just before
the manifest: a committed checkpoint always has its marker, and a marker may name an attempt that never committed.
(Writers before this named the marker `<seq:09d>` and kept the directory name only inside it; such markers are
still read, see `RunIndex`.)

`latest` then costs a few small reads and three LISTs of names: the pointer names D (run R, seq k); D must be
committed and a marker of seq k must name D (else the index does not cover it: list the root). The run's newest
commit A is the highest marker above k that names a committed checkpoint of its seq (a marker of an attempt that
never committed is passed over): seqs have gaps, which are normal (a durable tier holds every n-th commit of the
run, retention prunes markers). The answer is then checked, exactly, against the root's directory names, because
the pointer and the markers are hints that can be stale or damaged: every checkpoint directory but A that no
marker of a seq below A's names (a marker deleted, a writer that kept no index, another run's commit, a marker in
the first format) has its commit record read, and must not be a commit of the run of A's seq or higher, nor
another run's. So whatever the pointer says and whichever markers are missing, the index never makes a reader
pick an older checkpoint than the listing would: where it cannot vouch, the listing decides. Roots written by
more than one run (a shared root), or by a writer that kept no index, are listed as before.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
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
# "." is in neither part: a seq is digits, a directory name `step-<digits>-<hex>`; a writer's temp file
# (`<marker>.<hex>.tmp`) parses as neither format
MARKER_SEPARATOR = "."
_SAFE_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SEQ = re.compile(r"[0-9]{9,}")
MARKER_MAX_BYTES = 256  # a marker holds one directory name
POINTER_MAX_BYTES = 4096  # `latest` holds one directory name (~30 bytes)
MAX_WALK = 64  # markers above the pointer probed, newest first, before giving up on the index (all failed attempts)


class _ListTheRoot(Exception):
    """The index cannot vouch for an answer: the caller lists the root (the reason is logged)."""


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


def marker_name(seq: int, dirname: str) -> str:
    """The file name of the marker saying that directory `dirname` is its run's commit `seq`."""
    return f"{seq:09d}{MARKER_SEPARATOR}{dirname}"


def marker_path(root_path: str, run_id: str, seq: int, dirname: str) -> str:
    return join(root_path, INDEX_DIR, run_id, marker_name(seq, dirname))


def parse_marker_name(name: str) -> tuple[int, str | None] | None:
    """(seq, directory name) of a marker's file name; (seq, None) for a marker in the first format (`<seq:09d>`,
    the directory name only inside it); None for any other name (a temp file, a stray file)."""
    seq, separator, dirname = name.partition(MARKER_SEPARATOR)
    if not _SEQ.fullmatch(seq):
        return None
    if not separator:
        return int(seq), None
    parsed = parse_dirname(dirname)
    if parsed is None or dirname != dirname.strip() or "/" in dirname:
        return None
    return int(seq), dirname


def indexable(run_id: Any, seq: Any) -> bool:
    """Whether a commit of `run_id` / `seq` gets a marker: a run id that is a plain file name, a seq >= 1."""
    return index_key(run_id, seq) is not None


def index_key(run_id: Any, seq: Any) -> tuple[str, int] | None:
    """(run_id, seq) of a commit that gets a marker (`indexable`), typed; None for one that gets none."""
    if isinstance(run_id, str) and bool(_SAFE_RUN_ID.match(run_id)) and isinstance(seq, int) and seq >= 1:
        return run_id, seq
    return None


def write_marker(fs: Any, root_path: str, manifest: dict[str, Any], dirname: str) -> None:
    """Record that `dirname` is the run's commit `seq` (written before its manifest), then remove the markers of
    earlier attempts at that seq, best effort (a reader takes the one naming a committed directory of the seq)."""
    key = index_key(manifest.get("run_id"), manifest.get("seq"))
    if key is None:
        return
    run_id, seq = key
    directory = join(root_path, INDEX_DIR, run_id)
    fsio.makedirs(fs, directory)
    # the name is what readers go by; the content repeats it for a person, or a reader that cross-checks
    fsio.replace_small_file(fs, join(directory, marker_name(seq, dirname)), (dirname + "\n").encode())
    _remove_earlier_attempts(fs, directory, seq, dirname)


def _remove_earlier_attempts(fs: Any, directory: str, seq: int, dirname: str) -> None:
    """A failed attempt at `seq` left its marker (in either format) naming another directory: it goes, so the index
    stays one marker per commit. Best effort: one left behind costs a reader a probe, and retention prunes it."""
    try:
        listed = fs.ls(directory, detail=False)
    except Exception:  # noqa: BLE001 - the commit goes on; the stale marker is harmless
        log.debug("cannot list %s to remove earlier attempts' markers", directory, exc_info=True)
        return
    for path in listed:
        name = str(path).rstrip("/").rsplit("/", 1)[-1]
        parsed = parse_marker_name(name)
        if parsed is None or parsed[0] != seq or parsed[1] == dirname:
            continue
        try:
            fs.rm_file(join(directory, name))
        except Exception:  # noqa: BLE001 - as above
            log.debug("cannot remove %s/%s, an earlier attempt's marker", directory, name, exc_info=True)


@dataclass(frozen=True)
class RunIndex:
    """A run's markers, from one LIST of `ROOT/index/<run_id>/`.

    `named`: seq -> the directory names its markers carry in their file names (more than one when a failed
    attempt's marker is left beside its retry's). `legacy`: the seqs of markers in the first format (`<seq:09d>`),
    whose directory name takes a read: a root written before markers carried names, or an old run's root resumed
    by this writer (both formats then sit side by side, and both are read).
    """

    run_id: str
    named: dict[int, tuple[str, ...]] = field(default_factory=dict)
    legacy: frozenset[int] = frozenset()

    @property
    def seqs(self) -> list[int]:
        return sorted(set(self.named) | self.legacy)

    def names_at(self, location: Location, seq: int) -> list[str]:
        """The directory names markers of `seq` give (a marker in the first format: one small read)."""
        names = list(self.named.get(seq, ()))
        if seq in self.legacy:
            legacy = _legacy_marker(location, self.run_id, seq)
            if legacy is not None and legacy not in names:
                names.append(legacy)
        return names

    def named_below(self, seq: int) -> set[str]:
        """The directories markers of seqs below `seq` name in their file names (no read)."""
        return {name for marker_seq, names in self.named.items() if marker_seq < seq for name in names}


def read_run_index(location: Location, run_id: str) -> RunIndex:
    """The run's markers: one LIST of `ROOT/index/<run_id>/` (empty when it has none)."""
    try:
        listed = location.fs.ls(join(location.path, INDEX_DIR, run_id), detail=False)
    except FileNotFoundError:
        return RunIndex(run_id)
    named: dict[int, list[str]] = {}
    legacy: set[int] = set()
    for path in listed:
        parsed = parse_marker_name(str(path).rstrip("/").rsplit("/", 1)[-1])
        if parsed is None:
            continue
        seq, dirname = parsed
        if dirname is None:
            legacy.add(seq)
        else:
            named.setdefault(seq, []).append(dirname)
    return RunIndex(run_id, {seq: tuple(sorted(names)) for seq, names in named.items()}, frozenset(legacy))


def newest_of_run_by_index(location: Location, run_id: str | None) -> CheckpointEntry | None:
    """The newest committed checkpoint of `run_id` (None: of the only run the index knows) from the pointer and the
    index, without listing the root; None when they cannot answer (then list the root)."""
    try:
        return _walk(location, run_id)
    except _ListTheRoot as err:
        log.debug("%s: the commit index cannot vouch for `latest` (%s); listing the root", location.url, err)
        return None
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
    index = read_run_index(location, run)
    if name not in index.names_at(location, pointed_seq):
        return None  # the index does not cover the pointer's checkpoint
    passed: set[str] = set()  # directories markers above the answer name, probed: never committed
    probes = 0
    newer = sorted((seq for seq in index.seqs if seq > pointed_seq), reverse=True)
    for seq in newer:  # newest first, never seq + 1: seqs have gaps (a durable tier holds every n-th)
        candidate = None
        names = index.names_at(location, seq)
        probes += max(1, len(names))
        if probes > MAX_WALK:
            return None  # that many markers of attempts that never committed: the listing decides
        for following in names:
            candidate = _committed(location, following)
            if candidate is not None:
                break
            passed.add(following)
        if candidate is None:
            continue  # attempts that never committed
        if candidate.run_id != run or candidate.seq != seq:
            return None  # the marker names another commit: the index is inconsistent
        entry, pointed_seq = candidate, seq
        break
    _check_nothing_newer(location, entry, pointed_seq, index, passed)
    return entry


def _check_nothing_newer(
    location: Location, entry: CheckpointEntry, entry_seq: int, index: RunIndex, passed: set[str]
) -> None:
    """Raise _ListTheRoot unless the root's directories hold no commit newer than `entry` (of seq `entry_seq`) that
    the walk did not see: one LIST of names, and the commit record of each directory no marker accounts for.

    Accounted for without a read: `entry`; a directory a marker of a lower seq names in its file name (that seq's
    attempt: older, committed or not, whatever its step: a rollback's abandoned branch is one); one a marker above
    names, which the walk probed (never committed). Every other directory (its marker deleted or lost, a writer
    that kept no index, another run's, a second attempt of `entry`'s seq) is read: a commit of the run at
    `entry`'s seq or above, or another run's, whose manifest is there sends the reader to the listing. Markers in the first format are not
    read here: a marker read and a commit record read cost one request each, and the record is the truth where the
    marker is a hint, so the directories they name are read like unmarked ones.
    """
    try:
        listed = location.fs.ls(location.path, detail=False)
    except FileNotFoundError as err:
        raise _ListTheRoot(f"{location.path} cannot be listed") from err
    accounted = index.named_below(entry_seq) | passed | {entry.name}
    names = (str(path).rstrip("/").rsplit("/", 1)[-1] for path in listed)
    unknown = [join(location.path, name) for name in names if parse_dirname(name) is not None and name not in accounted]
    if not unknown:
        return
    records = [join(path, COMMIT_RECORD) for path in unknown]
    documents = location.backend.read_small_files(records, SMALL_MAX_BYTES)
    suspects: dict[str, str] = {}  # directory -> why it would be newer, if it is committed
    for path, record_path in zip(unknown, records):
        document = documents.get(record_path, FileNotFoundError(record_path))
        if isinstance(document, FileNotFoundError):
            # an attempt that died before its record, unless its manifest is there: a v1 checkpoint, or a lost
            # record, which the listing reads from the manifest
            suspects[path] = "has a manifest but no commit record: the listing reads it"
            continue
        if isinstance(document, SmallFileRefused):
            raise _ListTheRoot(f"{record_path}: {document}")  # a FIFO, a symlink, oversized: the listing shows it
        if isinstance(document, BaseException):
            raise document  # transient: the caller lists the root
        record = manifest_format.parse_commit_record(document, path)
        seq = record.get("seq")
        if record.get("run_id") != entry.run_id or not isinstance(seq, int):
            suspects[path] = "is another run's commit: which is newest takes a listing"
        elif seq >= entry_seq:
            suspects[path] = f"is the run's commit {seq}, which the index does not name"
    # a record alone commits nothing (an attempt that died before its manifest): only a manifest makes it a commit
    manifests = location.backend.probe_files([join(path, MANIFEST) for path in suspects], MANIFEST_MAX_BYTES)
    for (path, why), probed in zip(suspects.items(), manifests):
        if not isinstance(probed, FileNotFoundError):
            raise _ListTheRoot(f"{path} {why}")


def vouches_newest(location: Location, name: str) -> bool:
    """Whether the index and the root's directory names alone vouch that nothing newer than checkpoint `name` is
    in the root, without one read inside a checkpoint directory (a resume that assembled `name` from peer copies
    reads no object of the durable tier): the root's only run's highest marker names it and only it, and every
    other checkpoint directory in the root is named by a marker of a lower seq (an older commit or attempt, as the
    walk's check above accounts for it). False whenever they cannot tell: then read the root."""
    runs = _runs(location)
    if parse_dirname(name) is None or len(runs) != 1:
        return False
    index = read_run_index(location, runs[0])
    seqs = index.seqs
    if not seqs or index.names_at(location, seqs[-1]) != [name]:
        return False  # the pointer is never asked: a lost or rewritten one would name an older checkpoint
    try:
        listed = location.fs.ls(location.path, detail=False)
    except FileNotFoundError:
        return False
    others = {
        other
        for other in (str(path).rstrip("/").rsplit("/", 1)[-1] for path in listed)
        if parse_dirname(other) is not None and other != name
    }
    unaccounted = others - index.named_below(seqs[-1])
    # markers in the first format are read here (nothing inside a directory may be), as many as the walk would
    legacy = sorted((seq for seq in index.legacy if seq < seqs[-1]), reverse=True)
    if unaccounted and len(legacy) > MAX_WALK:
        return False
    for seq in legacy:
        if not unaccounted:
            break
        unaccounted -= set(index.names_at(location, seq))
    return not unaccounted


def prune_markers(location: Location, entries: list[CheckpointEntry]) -> int:
    """Remove the markers of checkpoints that are gone (after retention or gc); returns how many went.

    `entries`: a listing of the root taken before the deletions. Per run, a marker goes when its seq is below the
    run's newest commit and the directory it names is no longer in the root (one LIST of names; a marker in the
    first format, unless its seq is a kept commit's, takes a small read). Kept: markers at or above the newest
    commit (a save in flight writes its marker before its manifest), and markers of directories still there (a
    retired checkpoint whose files a kept incremental one still references, a failed attempt gc has not removed
    yet), which the walk's check accounts for without reading them.
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
        index = read_run_index(location, run_id)
        gone = [
            marker_path(location.path, run_id, seq, dirname)
            for seq, names in index.named.items()
            if seq < newest
            for dirname in names
            if dirname not in present
        ]
        for seq in sorted(index.legacy):
            if seq >= newest or seq in kept:
                continue
            name = _legacy_marker(location, run_id, seq)
            if name is None or name not in present:
                gone.append(_legacy_marker_path(location.path, run_id, seq))
        for path in gone:
            try:
                location.fs.rm_file(path)
                removed += 1
            except FileNotFoundError:  # another pruner (a gc beside retention) removed it first
                pass
    if removed:
        log.info("%s: removed %d commit index marker(s) of deleted checkpoints", location.url, removed)
    return removed


def _committed(location: Location, name: str) -> CheckpointEntry | None:
    """The listing entry of directory `name` when it is committed (manifest present, commit record valid); None
    when it is not (no manifest). A manifest without a readable record raises _ListTheRoot: the listing reads it
    (a v1 checkpoint, a lost or planted record), and may call it committed."""
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
    except (FileNotFoundError, SmallFileRefused) as err:
        raise _ListTheRoot(f"{path} has a manifest but no readable commit record") from err
    record = manifest_format.parse_commit_record(data, path)
    return CheckpointEntry(name, path, parsed.step, parsed.checkpoint_id, COMMITTED, record=record, _fs=location.fs)


def _legacy_marker_path(root_path: str, run_id: str, seq: int) -> str:
    return join(root_path, INDEX_DIR, run_id, f"{seq:09d}")


def _legacy_marker(location: Location, run_id: str, seq: int) -> str | None:
    """The directory name a marker in the first format (`<seq:09d>`) holds."""
    path = _legacy_marker_path(location.path, run_id, seq)
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
