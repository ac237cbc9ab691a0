"""The public operator API: what a checkpoint root holds, which checkpoint a reference names, what one
checkpoint's manifest says, and each new commit as it lands.

For scripts and jobs beside training (an evaluation job that follows it, a cron that reports the last
known-good), and for the `shardckpt` command, its first client: `ls`, `inspect` and `last-good` print what
these functions return. Everything here reads, nothing writes; local disk and object stores alike
(`storage_options` go to fsspec, as everywhere in the package). Nothing here imports torch.

Costs, so a script can run them often: `list_checkpoints` lists the root once, reads one small commit record
per committed checkpoint and lists ROOT/drills/ once; it reads the manifests of the two checkpoints it names,
`latest` and `last_good`, and validates them, because that is what a resume opens: its `latest` is the pick
`ckpt_path="latest"`, `load_checkpoint` and `verify_checkpoint` make, never a guess from the records.
`follow_checkpoints` lists the root once per poll and reads only the directories it has not seen.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..engine import catalog
from ..engine.format import drill_records, groups, signing
from ..engine.format import manifest as manifest_format
from ..engine.format import references as refs
from ..engine.format.entry import CheckpointEntry
from ..engine.format.manifest_schema import parse_time
from ..engine.format.names import join
from ..engine.root import Root, open_reference, open_root
from ..engine.storage.fsio import Location
from ..engine.validate import require_number
from ..errors import CheckpointDeleted, CheckpointNotFound, ShardCkptError

log = logging.getLogger(__name__)

COMMITTED, UNCOMMITTED, CORRUPT = catalog.COMMITTED, catalog.UNCOMMITTED, catalog.CORRUPT
DEFAULT_POLL_S = 5.0  # follow_checkpoints: seconds between two looks at the root (one listing each)

PathLike = str | os.PathLike[str]


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """One checkpoint directory of a root. `path` (or `name` within the root) is what `load_checkpoint`,
    `ckpt_path`, `verify_checkpoint` and `export_checkpoint` take."""

    name: str  # step-<step, 9 digits>-<id>: a reference every front door accepts within the root
    path: str  # the root's URL joined with the name
    root: str
    step: int
    checkpoint_id: str
    state: str  # committed | uncommitted (never loaded: in flight or abandoned) | corrupt (see problem)
    trust: str | None  # committed (not drilled) | drilled | drill-failed | not-drilled; None unless committed
    bytes: int | None  # its own files: from the commit record, or what storage holds of an uncommitted one
    bytes_referenced: int  # incremental saves: unchanged chunks it reads from earlier checkpoints
    committed_at: datetime | None  # the commit record's time (UTC); None unless committed
    age_s: float | None  # seconds since the commit (uncommitted: since its newest file), when it was listed
    run_id: str | None  # the run that wrote it; commit order within a run is seq
    seq: int | None
    parent: str | None  # the id of the checkpoint committed before it in its run
    problem: str | None  # why it is corrupt
    # with `public_keys` (list_checkpoints): signed (by `signed_by`, a key id) | unsigned | refused (why: in
    # `signature_problem`), from the manifest and its signature; None without public keys or unless committed
    signature: str | None = None
    signed_by: str | None = None
    signature_problem: str | None = None
    # with `public_keys` (resolve_checkpoint), `latest`/`last-good`: the newer checkpoints passed over because
    # their signature was refused, by name (empty when none was), as a signed resume counts them; else None
    signature_skipped: tuple[str, ...] | None = None

    @property
    def committed(self) -> bool:
        return self.state == COMMITTED


@dataclass(frozen=True, kw_only=True)
class CheckpointListing:
    """Every checkpoint directory of a root (oldest step first, as `shardckpt ls` shows them) and the two that
    references name: `latest` (what `ckpt_path="latest"` resumes) and `last_good` (the newest drilled one,
    what `"last-good"` resumes); Lightning's `last_model_path` is `listing.latest.path`."""

    root: str
    checkpoints: tuple[CheckpointInfo, ...]
    latest: CheckpointInfo | None  # None: nothing committed that validates
    last_good: CheckpointInfo | None  # None: no drill has passed
    latest_pointer: str | None  # what ROOT/latest holds: a hint writers leave, `latest` above is the answer
    malformed_drill_records: tuple[str, ...]  # files of ROOT/drills/ not trusted, each with why

    @property
    def committed(self) -> tuple[CheckpointInfo, ...]:
        return tuple(info for info in self.checkpoints if info.committed)

    def all_steps(self) -> list[int]:
        """The committed checkpoints' steps, ascending (Orbax's `CheckpointManager.all_steps()`)."""
        return sorted({info.step for info in self.committed})

    def latest_step(self) -> int | None:
        """The step `latest` resumes (after a rollback not always the largest step), None when none."""
        return None if self.latest is None else self.latest.step


@dataclass(frozen=True, kw_only=True)
class ManifestSummary:
    """One committed checkpoint's manifest without its tensor tables: position, writer, topology, counts,
    verification at commit, extras and its identity (docs/FORMAT.md)."""

    path: str
    checkpoint_id: str
    parent: str | None
    run_id: str | None
    step: int
    epoch: int | None
    samples_consumed: int | None
    created_at: datetime  # the commit time (UTC)
    format_version: int
    writer: dict[str, str]  # lightning_shardckpt, torch and python versions of the writer
    topology: dict[str, Any]  # world size, device type, parallelism, mesh shape at save
    file_count: int  # its own shard files
    bytes: int  # ... and their bytes
    referenced_file_count: int  # files of earlier checkpoints it reads unchanged chunks from (incremental)
    bytes_referenced: int
    tensor_count: int
    object_count: int
    verification: dict[str, Any] | None  # what was read back before the commit
    identity: dict[str, Any]  # the blocks as recorded (config, data, model, code, run); None: left empty at save
    extra: dict[str, Any]  # what plug-ins added at save (a drill probe's value, ...)


def list_checkpoints(
    root: PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    run_id: str | None = None,
    public_keys: PathLike | Sequence[PathLike] = (),
    revoked_keys: str | PathLike | Sequence[str | PathLike] = (),
) -> CheckpointListing:
    """Every checkpoint directory under `root`: committed, uncommitted and corrupt, with trust, size and times.

    `latest` and `last_good` are picked as a resume picks them and their manifests validated (a newest
    checkpoint whose manifest fails is listed corrupt, and `latest` is the one before it). `run_id`: the
    newest commit of that run instead of the run that committed last (what a resuming run with that id
    gets). `public_keys` (PEM files or text, several for a rotation): each committed checkpoint's `signature` is
    checked against them, and `latest`/`last_good` are what a resume with `require_signature` and these keys
    loads (the newest validly signed); costs one manifest and one signature read per committed checkpoint.
    An entry `{path, not_after_step, not_after}` bounds that key's acceptance; `revoked_keys` (key ids or PEM
    files) are refused at every step (LoadConfig's fields of the same names).
    Raises CheckpointNotFound when `root` does not exist, ConfigError when it is a checkpoint directory.
    """
    location = open_root(root, storage_options)
    policy = signing.policy_of(bool(public_keys), public_keys, revoked_keys)
    for attempt in (1, 2):
        entries = catalog.list_checkpoints(location)
        report = drill_records.trust_report(location, entries)  # one listing of ROOT/drills/
        signatures = _signatures(location, entries, policy) if policy is not None else {}
        try:
            latest = _pick_or_none(location, entries, "latest", run_id, report.states, policy)
            good = _pick_or_none(location, entries, catalog.LAST_GOOD, run_id, report.states, policy)
            break
        except CheckpointDeleted as err:  # another job's retention removed the pick meanwhile: list again once
            if attempt == 2:
                raise
            log.warning("%s; listing %s again", err, location.url)
    for entry in entries:  # the pick marks what it passed over corrupt; here a refusal is a signature state
        state, _, why = signatures.get(entry.name, (None, None, None))
        if state not in (None, signing.SIGNED) and entry.state == CORRUPT and entry.problem == why:
            entry.state, entry.problem = COMMITTED, None
    infos = {entry.name: _info(location, entry, report.states, signatures.get(entry.name)) for entry in entries}
    return CheckpointListing(
        root=location.url,
        checkpoints=tuple(infos.values()),
        latest=infos[latest.name] if latest else None,
        last_good=infos[good.name] if good else None,
        latest_pointer=catalog.read_latest_pointer(location),
        malformed_drill_records=tuple(report.malformed),
    )


def resolve_checkpoint(
    where: PathLike,
    which: str | int = "latest",
    *,
    storage_options: dict[str, Any] | None = None,
    run_id: str | None = None,
    public_keys: PathLike | Sequence[PathLike] = (),
    revoked_keys: str | PathLike | Sequence[str | PathLike] = (),
) -> CheckpointInfo:
    """The committed checkpoint a reference names, its manifest validated: what a resume would open.

    `where` is a root, a checkpoint directory, or `ROOT/latest`. `which`, within a root: `latest`,
    `last-good`, a step (`500` or `step-500`), a checkpoint id or a directory name; or a path, which names
    its own root as `ckpt_path` does. Raises CheckpointNotFound naming the root and what it holds instead.
    `public_keys` (PEM files or text, several for a rotation): the pick of a resume with `require_signature`
    and these keys: `latest`/`last-good` pass over a checkpoint whose signature they refuse (unsigned, another
    key's, changed after signing) and name what they passed over in `signature_skipped`; a refused checkpoint
    named by step, id or path raises SignatureRefused naming the file and key (windows and `revoked_keys`: as
    LoadConfig's). The manifest and its signature are judged, as the pick does; the resume then checks the files against the signed digests.
    """
    policy = signing.policy_of(bool(public_keys), public_keys, revoked_keys)
    location, entry = open_reference(which, where, storage_options, run_id, policy)
    states = drill_records.trust_states(location, [entry])
    if policy is None:
        return _info(location, entry, states)
    signed = (signing.SIGNED, entry.extra[catalog.SIGNED_BY], None)  # the pick checked it: it was accepted
    skipped = tuple(entry.extra.get(catalog.SIGNATURE_SKIPPED) or ())  # a named pick passes over nothing
    return dataclasses.replace(_info(location, entry, states, signed), signature_skipped=skipped)


def read_manifest_summary(
    where: PathLike, which: str | int = "latest", *, storage_options: dict[str, Any] | None = None
) -> ManifestSummary:
    """The manifest of the checkpoint `where` and `which` name (as resolve_checkpoint), without its tables."""
    location, entry = open_reference(which, where, storage_options)
    manifest = entry.committed_manifest  # read and validated by the pick
    created_at = parse_time(manifest["created_at"])
    assert created_at is not None  # the validation refuses a manifest whose created_at is not a time with a timezone
    return ManifestSummary(
        path=join(location.url, entry.name),
        checkpoint_id=manifest["id"],
        parent=manifest.get("parent"),
        run_id=manifest.get("run_id"),
        step=manifest["step"],
        epoch=manifest.get("epoch"),
        samples_consumed=manifest.get("samples_consumed"),
        created_at=created_at,
        format_version=manifest["format_version"],
        writer=dict(manifest.get("writer") or {}),
        topology=manifest["topology"],
        file_count=groups.file_count(manifest)
        if groups.is_grouped(manifest)
        else len(manifest_format.files_of(manifest)),
        bytes=manifest_format.total_bytes(manifest),
        # v3 lists each file; v4/v5 each sibling directory with its holder ranks (FORMAT.md §10.6)
        referenced_file_count=sum(len(files) for files in refs.referenced_files(manifest).values()),
        bytes_referenced=manifest_format.referenced_bytes(manifest),
        tensor_count=len(manifest["tensors"]),
        object_count=len(manifest["objects"]),
        verification=manifest.get("verification"),
        identity=dict(manifest.get("identity") or {}),
        extra=dict(manifest.get("extra") or {}),
    )


def follow_checkpoints(
    root: PathLike,
    *,
    timeout_s: float | None = None,
    poll_s: float = DEFAULT_POLL_S,
    include_existing: bool = False,
    storage_options: dict[str, Any] | None = None,
    public_keys: PathLike | Sequence[PathLike] = (),
) -> Iterator[CheckpointInfo]:
    """Yield each checkpoint committed under `root` from now on, in commit order, as it lands; like Orbax's
    and TensorFlow's `checkpoints_iterator`, for an evaluation job that follows training.

    Never yields an uncommitted or a corrupt checkpoint: its manifest is read, matched against its commit record
    and validated, as `list_checkpoints` checks the `latest` it stars (one manifest read per new commit). Looks
    every `poll_s` seconds: one listing of the root, and reads only of directories not seen yet (object stores
    have no change notifications). Ends once `timeout_s` pass without a new commit, counted from when the caller
    asks for the next one (None: never ends).
    `include_existing`: first yield what is committed already. A root that does not exist yet is waited for.
    `public_keys` (PEM files or text, several for a rotation): yield only checkpoints whose manifest one of these
    keys signed, as a resume with `require_signature` picks (an unsigned, another key's or re-signed one is passed
    over with a warning naming the file and key); the follower's reader then checks the files against the digests.
    """
    # checked now, not at the first next(): a generator function would defer these errors to the loop
    require_number("poll_s", poll_s, above=0, hint="seconds between looks at the root, e.g. 5")
    require_number("timeout_s", timeout_s, at_least=0, allow_none=True, none_means="wait forever", hint="seconds")
    policy = signing.policy_of(bool(public_keys), public_keys)  # checked now: a bad key fails here, not at next()
    followed = Root.at(root, storage_options)
    settled: set[str] = set()  # yielded, found corrupt, or there before (not include_existing): never read again
    if not include_existing:
        settled = {entry.name for entry in followed.list() if entry.state != UNCOMMITTED}
    return _follow(followed, settled, timeout_s, poll_s, policy)


def _follow(
    root: Root,
    settled: set[str],
    timeout_s: float | None,
    poll_s: float,
    policy: signing.SignaturePolicy | None,
) -> Iterator[CheckpointInfo]:
    while True:
        asked = time.monotonic()
        while not (fresh := _newly_committed(root, settled, policy)):
            left = None if timeout_s is None else timeout_s - (time.monotonic() - asked)
            if left is not None and left <= 0:
                return
            time.sleep(poll_s if left is None else min(poll_s, left))
        yield from fresh


# --- helpers ---


def _pick_or_none(
    location: Location,
    entries: list[CheckpointEntry],
    which: str,
    run_id: str | None,
    states: dict[str, str],
    policy: signing.SignaturePolicy | None = None,
) -> CheckpointEntry | None:
    try:
        return catalog.pick(location, entries, which, run_id, states, policy=policy)
    except CheckpointDeleted:
        raise
    except CheckpointNotFound:
        return None


def _newly_committed(root: Root, settled: set[str], policy: signing.SignaturePolicy | None) -> list[CheckpointInfo]:
    """The committed, sound checkpoints not in `settled`, in commit order (Root.follow), as CheckpointInfo."""
    fresh = root.follow(settled, policy)
    if not fresh:
        return []
    states = drill_records.trust_states(root.location, fresh)
    return [_info(root.location, entry, states) for entry in fresh]


def _signatures(
    location: Location, entries: list[CheckpointEntry], policy: signing.SignaturePolicy
) -> dict[str, tuple[str, str | None, str | None]]:
    """Each committed checkpoint's (signature state, key id, why not accepted); one whose manifest cannot be read
    has none (its entry says why: corrupt, or gone)."""
    out = {}
    for entry in entries:
        if not entry.committed:
            continue
        try:
            out[entry.name] = signing.signature_state(policy, location.fs, entry.path, entry.committed_manifest)
        except ShardCkptError as err:  # corrupt (marked) or deleted meanwhile: no signature to speak of
            log.debug("%s: no signature state: %s", entry.path, err)
    return out


def _info(
    location: Location,
    entry: CheckpointEntry,
    states: dict[str, str],
    signature: tuple[str, str | None, str | None] | None = None,
) -> CheckpointInfo:
    age = catalog.age_seconds(entry, location)
    record = entry.record or {}
    state, signed_by, why = signature or (None, None, None)
    return CheckpointInfo(
        name=entry.name,
        path=join(location.url, entry.name),
        root=location.url,
        step=entry.step,
        checkpoint_id=entry.checkpoint_id,
        state=entry.state,
        trust=states.get(entry.name) if entry.committed else None,
        bytes=catalog.size_bytes(entry, location),
        bytes_referenced=record.get("bytes_referenced", 0),
        committed_at=entry.created_at if entry.committed else None,
        age_s=age,
        run_id=entry.run_id,
        seq=entry.seq,
        parent=record.get("parent"),
        problem=entry.problem,
        signature=state,
        signed_by=signed_by,
        signature_problem=why,
    )
