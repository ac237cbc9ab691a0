"""What a checkpoint root holds: committed and uncommitted checkpoints, and which one is latest.

The pick of a selector among a root's checkpoints; what a reference's text means (a path, `ROOT/latest`, a
selector) is engine/root.py's to say, the one interpreter every entry point asks.

Readers trust manifests, never the `latest` pointer alone: a stale or missing pointer falls back to
the newest committed directory.

Listing reads each committed directory's small commit record (`commit.json`, format v2), never its
tensor table: the full manifest is read only when a checkpoint is opened (`entry.manifest`). A v1
directory has no record; its manifest is parsed once to list it and not kept.

Order is commit order, not step order. Within a run (one `run_id`) it is the commit sequence number
`seq` (the run's previous commit's + 1; v1 checkpoints, which have none, come before every v2 one and
go by `created_at`). Across runs it is `created_at`. `latest` is the newest commit of the resuming run
when its id is known, else of the run that committed last: after a rollback (resume from step 6 while
step 9 exists) the new branch's commits are newer than step 9, whatever their steps.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

from ..errors import CheckpointDeleted, CheckpointNotFound, CorruptCheckpoint, ShardCkptError
from . import commit_index
from .commit_index import read_latest_pointer as read_latest_pointer
from .format import drill_records
from .format import manifest as manifest_format
from .format.bounded_json import MANIFEST_MAX_BYTES, SMALL_MAX_BYTES

# the entry type and its manifest read live in format/entry.py, below drill records and references, which
# name them too; callers keep reaching them here, where a root is listed
from .format.entry import COMMITTED, CORRUPT, UNCOMMITTED, CheckpointEntry
from .format.entry import read_manifest as read_manifest
from .format.names import COMMIT_RECORD, LATEST, MANIFEST, join, parse_dirname
from .format.signing import SignaturePolicy, SignatureRefused
from .storage.fsio import Location
from .storage.small_files import SmallFileRefused

log = logging.getLogger(__name__)

SIGNED_BY = "signed_by"  # CheckpointEntry.extra: the accepting key's id, once a signature policy checked it
# CheckpointEntry.extra of `latest`/`last-good`'s pick: the newer checkpoints passed over because the signature
# policy refused them (names), for the resume's event and the `signature_skipped` metric and health rule
SIGNATURE_SKIPPED = "signature_skipped"
V1_BATCH = 32  # v1 manifests (no commit record) read and parsed per batch while listing


def list_checkpoints(location: Location, only: Callable[[str], bool] | None = None) -> list[CheckpointEntry]:
    """Every checkpoint directory under the root, oldest step first; commit records read and validated.

    Costs one listing of the root, one small ranged read per directory (does `manifest.json` exist?)
    and one small read per committed directory (its commit record); all batched, so concurrent on
    object stores. Tensor tables are never parsed here. `only`, a test of directory names applied
    before any read, narrows the reads to the directories it accepts (a follower polling a root reads
    only what it has not seen yet).
    """
    fs, root = location.fs, location.path
    try:
        infos = fs.ls(root, detail=True)
    except FileNotFoundError:
        return []
    entries = []
    for info in infos:
        name = str(info.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
        parsed = parse_dirname(name)
        if parsed is None or (only is not None and not only(name)):
            continue
        entry = CheckpointEntry(name, join(root, name), parsed.step, parsed.checkpoint_id, UNCOMMITTED, _fs=fs)
        if info.get("type") != "directory":
            entry.state = CORRUPT
            kind = info.get("type") or "non-directory"
            entry.problem = f"{entry.path} is a {kind} named like a checkpoint directory; move it out of the root"
        entries.append(entry)
    candidates = [entry for entry in entries if entry.state == UNCOMMITTED]
    with_manifest = _with_manifest(location, candidates)
    records = _read_all(location, [join(entry.path, COMMIT_RECORD) for entry in with_manifest], SMALL_MAX_BYTES)
    without_record = []
    for entry, document in zip(with_manifest, records):
        if isinstance(document, FileNotFoundError):
            without_record.append(entry)  # format v1 (or a lost record): list it from the manifest
            continue
        if isinstance(document, SmallFileRefused):  # a FIFO, a link, a huge file: shown, never loaded
            entry.state, entry.problem = CORRUPT, str(document)
            continue
        try:
            entry.record = manifest_format.parse_commit_record(document, entry.path)
            entry.state = COMMITTED
        except ShardCkptError as err:
            entry.state, entry.problem = CORRUPT, str(err)
    for start in range(0, len(without_record), V1_BATCH):  # batches: a listing never holds every manifest at once
        batch = without_record[start : start + V1_BATCH]
        manifests = _read_all(location, [join(entry.path, MANIFEST) for entry in batch], MANIFEST_MAX_BYTES)
        for entry, document in zip(batch, manifests):
            if isinstance(document, FileNotFoundError):  # deleted since the existence check: uncommitted now
                continue
            if isinstance(document, SmallFileRefused):
                entry.state, entry.problem = CORRUPT, str(document)
                continue
            try:
                # parsed to list it, then dropped: only the listing fields are kept
                entry.record = manifest_format.record_of_manifest(manifest_format.parse(document, entry.path))
                entry.state = COMMITTED
            except ShardCkptError as err:
                entry.state, entry.problem = CORRUPT, str(err)
    entries.sort(key=lambda e: (e.step, _timestamp(e), e.name))
    return entries


def describe_contents(location: Location) -> str:
    """What a path that holds no committed checkpoint holds instead, for an error message that names it."""
    fs, path = location.fs, location.path
    if not fs.exists(path):
        return "nothing (the path does not exist)"
    if fs.isfile(path):
        return "a file, not a checkpoint root or checkpoint directory"
    entries = list_checkpoints(location)
    if not entries:
        others = len(fs.ls(path, detail=False))
        return f"a directory with {others} entries, none of them a checkpoint" if others else "an empty directory"
    uncommitted = [entry for entry in entries if entry.state == UNCOMMITTED]
    corrupt = [entry for entry in entries if entry.state == CORRUPT]
    parts = []
    if uncommitted:
        parts.append(f"{len(uncommitted)} uncommitted attempt(s) (saves that never committed)")
    if corrupt:
        parts.append(f"{len(corrupt)} corrupt checkpoint(s) (first: {corrupt[0].problem})")
    return "a checkpoint root with " + " and ".join(parts)


def refuse_file(location: Location, given: str) -> None:
    """CheckpointNotFound naming `given` when it names a file (`ROOT/latest`, a stray file) where a checkpoint root
    or checkpoint directory is expected: the one error every entry point gives for it, instead of the
    NotADirectoryError of listing a file, or a follower waiting for a file to become a root."""
    if not location.fs.isfile(location.path):
        return
    parent = location.url.rstrip("/").rsplit("/", 1)[0] or "/"
    pointer = location.path.rstrip("/").rsplit("/", 1)[-1] == LATEST
    raise CheckpointNotFound(
        f"{given} is a file, not a checkpoint root or checkpoint directory; pass the root that holds it ({parent}"
        + (", whose latest checkpoint is found from the root: the pointer file is only a hint" if pointer else "")
        + f") or one of its checkpoint directories (shardckpt ls {parent})"
    )


def run_order(entry: CheckpointEntry) -> tuple:
    """Commit order within one run: seq (v1: none, so first), then commit time, then name."""
    return (entry.seq or 0, _timestamp(entry), entry.name)


def time_order(entry: CheckpointEntry) -> tuple:
    """Commit order across runs: commit time, then seq, then name."""
    return (_timestamp(entry), entry.seq or 0, entry.name)


def committed_of_run(entries: list[CheckpointEntry], run_id: str | None) -> list[CheckpointEntry]:
    """The run's committed checkpoints, oldest commit first."""
    return sorted((e for e in entries if e.committed and e.run_id == run_id), key=run_order)


def newest_of_run(entries: list[CheckpointEntry], run_id: str | None) -> CheckpointEntry | None:
    mine = committed_of_run(entries, run_id)
    return mine[-1] if mine else None


def newest_commit_of_run(location: Location, run_id: str) -> CheckpointEntry | None:
    """The newest committed checkpoint of `run_id` under the root (None: it has none there): from the run's commit
    index when it can answer (commit_index.py: a few small reads), else from a listing; the same answer either way."""
    indexed = commit_index.newest_of_run_by_index(location, run_id)
    if indexed is not None:
        return indexed
    return newest_of_run(list_checkpoints(location), run_id)


def newest_committed(entries: list[CheckpointEntry], run_id: str | None = None) -> CheckpointEntry | None:
    """The latest checkpoint: the newest commit of `run_id` when that run has one, else the newest
    commit of the run that committed last. Steps do not matter: a rollback's new branch wins."""
    if run_id is not None:
        mine = newest_of_run(entries, run_id)
        if mine is not None:
            return mine
    committed = [e for e in entries if e.committed]
    if not committed:
        return None
    # the run that committed last, by wall clock; within it, by seq (immune to clock steps between hosts)
    return newest_of_run(entries, max(committed, key=time_order).run_id)


def resolve_latest(
    location: Location, entries: list[CheckpointEntry] | None = None, run_id: str | None = None
) -> CheckpointEntry | None:
    """The latest committed checkpoint (see newest_committed); the pointer is only a hint, checked against the listing."""
    entries = list_checkpoints(location) if entries is None else entries
    newest = newest_committed(entries, run_id)
    if newest is not None:
        _pointer_hint(location, newest)
    return newest


def _pointer_hint(location: Location, newest: CheckpointEntry) -> None:
    """Say so when the `latest` pointer names another checkpoint than the newest commit (which wins)."""
    pointer = read_latest_pointer(location)
    if pointer != newest.name:
        log.warning(
            "%s: `latest` points to %r but the newest committed checkpoint is %r; using %r",
            location.url,
            pointer,
            newest.name,
            newest.name,
        )


LAST_GOOD = "last-good"  # the newest drilled checkpoint (engine/format/drill_records.py): proven to restore


def last_good(
    location: Location,
    entries: list[CheckpointEntry],
    run_id: str | None = None,
    keep: int = 1,
    states: dict[str, str] | None = None,
) -> list[CheckpointEntry]:
    """The newest `keep` drilled checkpoints (newest last) of the run `latest` would come from.

    In the run's commit order, like `latest`: after a rollback, a drilled checkpoint of the abandoned
    branch is older than the new branch's commits. Falls back to every run's by commit time when that
    run has none drilled. `states`: the entries' trust states when the caller has them (one listing of
    ROOT/drills/ less); read here otherwise.
    """
    if states is None:
        states = drill_records.trust_states(location, entries)
    return _newest_drilled(entries, run_id, keep, states)


def _newest_drilled(
    entries: list[CheckpointEntry], run_id: str | None, keep: int, states: dict[str, str]
) -> list[CheckpointEntry]:
    """`last_good` once the trust states are read."""
    newest = newest_committed(entries, run_id)
    if newest is None:
        return []
    mine = drill_records.newest_drilled(committed_of_run(entries, newest.run_id), states, keep)
    if mine:
        return mine
    return drill_records.newest_drilled(sorted((e for e in entries if e.committed), key=time_order), states, keep)


def find(
    location: Location, which: str | int = "latest", run_id: str | None = None, policy: SignaturePolicy | None = None
) -> CheckpointEntry:
    """Pick a committed checkpoint by `latest`, `last-good`, a step number, an id or a directory name.

    `latest` skips a checkpoint whose manifest turns out corrupt, and lists again once when the one it
    picked is deleted meanwhile (another job's retention on this root). It asks the run's commit index first
    (commit_index.py: a few small reads, no reads per directory) and lists the root when the index cannot answer;
    the index answers only what the listing's `newest_committed` would (checked against the root's directory
    names), so every reader's `latest` is that one choice, whatever state the pointer and the markers are in.
    """
    if which == "latest":
        indexed = commit_index.newest_of_run_by_index(location, run_id)
        if indexed is not None:
            try:
                return _with_manifest_read(indexed, location, policy)
            except (CorruptCheckpoint, CheckpointDeleted) as err:  # the listing skips it, or lists what is left
                log.warning("%s: %s; listing the root for `latest`", location.url, err)
    for attempt in (1, 2):
        entries = list_checkpoints(location)
        try:
            return pick(location, entries, which, run_id, policy=policy)
        except CheckpointDeleted as err:
            if which not in ("latest", LAST_GOOD) or attempt == 2:
                raise
            log.warning("%s; resolving `latest` again", err)
    raise AssertionError("unreachable")


def candidates(
    entries: list[CheckpointEntry],
    which: str | int,
    run_id: str | None = None,
    states: dict[str, str] | None = None,
) -> Iterator[CheckpointEntry]:
    """The committed checkpoints among `entries` that `which` names, in the order a pick tries them: the one place
    the rules of which checkpoint a selector names live. `pick` takes the first whose manifest validates (and the
    signature policy accepts); a tiered resume (engine/tiers/restore.py) the first a copy of which every rank can
    read, over the tiers' checkpoints together.

    - `latest`: the newest commit of `run_id` when that run has one, else of the run that committed last
      (`newest_committed`), then the newest of what is left by the same rule, and so on: each one passed over is
      as if it were not there;
    - `last-good`: the drilled ones of the run `latest` comes from (of every run, when it has none), newest first;
      `states` (drill_records.trust_states) are required for it;
    - a step, an id or a directory name: the one committed checkpoint it names (the newest commit, where several
      runs committed a step). Only that one: a named checkpoint that is not sound is an error, never another.
    Lazy: a pick reads no further than the candidate it takes.
    """
    if which == "latest":
        yield from _newest_first(entries, run_id)
    elif which == LAST_GOOD:
        if states is None:
            raise ValueError("the candidates for `last-good` need the trust states (drill_records.trust_states)")
        yield from reversed(_newest_drilled(entries, run_id, len(entries), states))
    else:
        # `entries` in listing order (step, commit time, name): the last match is the newest commit of that step
        named = [entry for entry in entries if entry.committed and names(entry, which)]
        if named:
            yield max(named, key=lambda e: (e.step, _timestamp(e), e.name))


def _newest_first(entries: list[CheckpointEntry], run_id: str | None) -> Iterator[CheckpointEntry]:
    """`newest_committed` of `entries`, then of what is left without it, and so on (each run's commits popped from
    its newest; the run that committed last found from each run's newest commit time among what it has left)."""
    runs: dict[str | None, list[CheckpointEntry]] = {}
    for entry in sorted((e for e in entries if e.committed), key=run_order):
        runs.setdefault(entry.run_id, []).append(entry)
    # newest[run][i]: the newest commit time among the run's first i + 1 commits (what is left after popping)
    newest = {run: list(itertools.accumulate(map(time_order, mine), max)) for run, mine in runs.items()}
    while runs:
        run = run_id if run_id in runs else max(runs, key=lambda r: newest[r][len(runs[r]) - 1])
        yield runs[run].pop()
        if not runs[run]:
            del runs[run]


def names(entry: CheckpointEntry, selector: str | int) -> bool:
    """`selector` (a step, an id or a directory name, as engine/root.parse_reference gives them) names this checkpoint."""
    text = str(selector)
    return entry.name == text or entry.checkpoint_id == text or (text.isdigit() and entry.step == int(text))


def pick(
    location: Location,
    entries: list[CheckpointEntry],
    which: str | int,
    run_id: str | None = None,
    states: dict[str, str] | None = None,
    policy: SignaturePolicy | None = None,
) -> CheckpointEntry:
    """The committed checkpoint `which` names among `entries`, its manifest read and validated: the one pick
    behind a resume, `verify ROOT`, the star of `shardckpt ls` and the public API (ops/roots.py).

    `latest` and `last-good` skip a checkpoint whose manifest does not validate (marking its entry corrupt,
    so a listing shows why); a step, an id or a name that is not sound raises, naming it. Raises
    CheckpointNotFound when nothing committed matches, CheckpointDeleted when the pick went meanwhile (`find`
    lists again). `states`: trust states the caller already read, for `last-good`. `policy`: a checkpoint whose
    signature it refuses is skipped by `latest` and `last-good` (logged; the pick's
    `extra[SIGNATURE_SKIPPED]` names what was passed over), and raises when named.
    """
    unsigned: list[str] = []  # passed over because the signature policy refused them
    if which == "latest":
        for tried, chosen in enumerate(candidates(entries, which, run_id)):
            if tried == 0:
                _pointer_hint(location, chosen)
            try:
                # validated now: a corrupt one is never handed out
                return _skipped_noted(_with_manifest_read(chosen, location, policy), unsigned)
            except CorruptCheckpoint as err:  # the entry is marked corrupt: a listing shows why
                _skipping(location, chosen, "latest", err, unsigned)
    elif which == LAST_GOOD:
        if states is None:
            states = drill_records.trust_states(location, entries)
        for chosen in candidates(entries, which, run_id, states):
            try:
                return _skipped_noted(_with_manifest_read(chosen, location, policy), unsigned)
            except CorruptCheckpoint as err:
                _skipping(location, chosen, LAST_GOOD, err, unsigned)
        raise CheckpointNotFound(
            f"no drilled checkpoint in {location.url}: none has passed a restore drill yet. "
            f"Drill one with `shardckpt drill {location.url}`, or resume from `latest`"
        )
    else:
        uncommitted = [e for e in entries if not e.committed and names(e, which)]
        for chosen in candidates(entries, which):
            return _with_manifest_read(chosen, location, policy)  # a corrupt or vanished one raises, naming itself
        if uncommitted:
            raise CheckpointNotFound(
                f"{uncommitted[-1].path} is {uncommitted[-1].state}, not committed"
                + (f" ({uncommitted[-1].problem})" if uncommitted[-1].problem else "")
                + "; it will never be loaded. Pick a committed one: shardckpt ls "
                + location.url
            )
    committed = [e.name for e in entries if e.committed]
    hint = f"committed here: {committed[-5:]}" if committed else "there is no committed checkpoint here"
    corrupt = [e for e in entries if e.state == CORRUPT]
    if corrupt:
        hint += f"; corrupt: {corrupt[-1].name} ({corrupt[-1].problem})" + (
            f" and {len(corrupt) - 1} more" if len(corrupt) > 1 else ""
        )
    raise CheckpointNotFound(f"no committed checkpoint {which!r} in {location.url}; {hint}")


def _skipping(location: Location, chosen: CheckpointEntry, which: str, err: Exception, unsigned: list[str]) -> None:
    log.warning("%s: skipping %s for `%s`: %s", location.url, chosen.name, which, err)
    if isinstance(err, SignatureRefused):
        unsigned.append(chosen.name)


def _skipped_noted(entry: CheckpointEntry, unsigned: list[str]) -> CheckpointEntry:
    """The pick, carrying the names the signature policy made it pass over (every pick says, none included: an
    entry object outlives one pick)."""
    entry.extra[SIGNATURE_SKIPPED] = list(unsigned)
    return entry


def _with_manifest_read(
    entry: CheckpointEntry, location: Location | None = None, policy: SignaturePolicy | None = None
) -> CheckpointEntry:
    if entry.manifest is None:  # not reachable for a committed entry listed here; kept as a guard
        raise CheckpointNotFound(f"{entry.path} has no manifest to open")
    if policy is not None and location is not None:
        try:
            entry.extra[SIGNED_BY] = policy.check_manifest(location.fs, entry.path, entry.manifest)
        except SignatureRefused as err:  # marked, so `latest` passes over it and a listing shows why
            entry.state, entry.problem = CORRUPT, str(err)
            raise
    return entry


def age_seconds(entry: CheckpointEntry, location: Location) -> float | None:
    """Seconds since the checkpoint was committed (record time) or last written to (uncommitted)."""
    now = datetime.now(timezone.utc)
    if entry.created_at is not None:
        return (now - entry.created_at).total_seconds()
    try:
        infos = location.fs.ls(entry.path, detail=True) or []
    except (FileNotFoundError, NotADirectoryError):  # gone meanwhile, or a stray file named like a checkpoint
        return None
    newest = None
    for info in infos:
        stamp = _modified(info)
        if stamp is not None and (newest is None or stamp > newest):
            newest = stamp
    return None if newest is None else (now - newest).total_seconds()


def size_bytes(entry: CheckpointEntry, location: Location) -> int | None:
    if entry.record is not None:
        return entry.record["bytes_total"]
    try:
        return sum(
            info.get("size") or 0 for info in location.fs.ls(entry.path, detail=True) if info.get("type") == "file"
        )
    except (FileNotFoundError, NotADirectoryError):  # gone meanwhile, or a stray file named like a checkpoint
        return None


def _timestamp(entry: CheckpointEntry) -> float:
    stamp = entry.created_at
    return stamp.timestamp() if stamp is not None else 0.0


def _with_manifest(location: Location, entries: list[CheckpointEntry]) -> list[CheckpointEntry]:
    """The entries whose manifest.json exists: one ranged read of its first byte each, batched."""
    if not entries:
        return []
    paths = [join(entry.path, MANIFEST) for entry in entries]
    results = location.backend.probe_files(paths, MANIFEST_MAX_BYTES)
    present = []
    for entry, result in zip(entries, results):
        if isinstance(result, FileNotFoundError):
            continue
        if isinstance(result, (IsADirectoryError, NotADirectoryError)):
            entry.state, entry.problem = (
                CORRUPT,
                f"{join(entry.path, MANIFEST)} is not a file ({type(result).__name__})",
            )
        elif isinstance(result, SmallFileRefused):  # a FIFO or a symlink named manifest.json: never opened
            entry.state, entry.problem = CORRUPT, str(result)
        elif isinstance(result, BaseException):
            raise result  # a transient read error must not make a committed checkpoint look uncommitted
        else:
            present.append(entry)
    return present


def _read_all(location: Location, paths: list[str], max_bytes: int) -> list[Any]:
    """Small files' bytes in `paths` order (concurrent on object stores), each at most `max_bytes`;
    FileNotFoundError where absent, SmallFileRefused where not a regular file within the bound."""
    if not paths:
        return []
    documents = location.backend.read_small_files(paths, max_bytes)
    out = []
    for path in paths:
        document = documents.get(path, FileNotFoundError(path))
        if isinstance(document, (IsADirectoryError, NotADirectoryError)):
            document = b"<not a file>"  # fails to parse: the entry is reported corrupt, with the reason
        elif isinstance(document, BaseException) and not isinstance(document, (FileNotFoundError, SmallFileRefused)):
            raise document  # transient: never turn a committed checkpoint into an uncommitted one
        out.append(document)
    return out


def _modified(info: dict[str, Any]) -> datetime | None:
    stamp = info.get("mtime") or info.get("LastModified") or info.get("created")
    if stamp is None:
        return None
    if isinstance(stamp, datetime):
        return stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc)
    return datetime.fromtimestamp(float(stamp), tz=timezone.utc)
