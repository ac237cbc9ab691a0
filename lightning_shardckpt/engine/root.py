"""One checkpoint root, and the one place a reference to a checkpoint is interpreted.

Every entry point that takes a checkpoint reference asks `locate` what it means: the public API
(ops/roots.py: `resolve_checkpoint`, `list_checkpoints`, `follow_checkpoints`, `read_manifest_summary`,
`verify_checkpoint`, `export_checkpoint`), the loader behind every door's resume (`load_checkpoint`,
`Checkpointer.load`, `fabric.load`, `trainer.fit(ckpt_path=...)`), the drills and the command line. So one
spelling is one checkpoint, or one error, at every door.

The spellings (`parse_reference` reads the text; `locate` adds what only storage can tell):
- within a root the caller knows (`within`): `latest`, `last-good`, a step (`500`, `step-500`, an int), a
  checkpoint id (12 hex digits) or a checkpoint directory name;
- a path, which names its own root: a root (its latest), a checkpoint directory (that checkpoint), `ROOT/latest`
  (the pointer file: the root's latest, found from the manifests, the pointer being only a hint) and
  `ROOT/last-good` (the root's last known-good);
- any other file (a stray file, a torch file): CheckpointNotFound naming it and the root to pass instead;
- `latest` within a path is that path's own pick (a checkpoint directory is itself); any other selector within a
  checkpoint directory or a file is refused, naming the root to give instead.

`Root` is a root on any storage: `list()` its checkpoints, `pick(reference)` one, `open(reference)` one that may be
elsewhere (a path names its own root), `follow()` the commits it has not seen. What it picks is
engine/catalog.py's pick: the index walk and listing check of `latest`, `last-good`, the signature policy's skips.
Its rules of which checkpoint a selector names (catalog.candidates) are the ones a tiered resume applies over the
tiers' checkpoints taken together (engine/tiers/restore.py): the tiers choose a copy, never another checkpoint.
"""

from __future__ import annotations

import builtins
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

from ..errors import CheckpointDeleted, CheckpointNotFound, ConfigError, ShardCkptError
from . import catalog
from .format.entry import UNCOMMITTED, CheckpointEntry
from .format.names import LATEST, parse_dirname
from .format.signing import SignaturePolicy
from .storage import fsio
from .storage.fsio import Location

log = logging.getLogger(__name__)

LAST_GOOD = catalog.LAST_GOOD  # the newest drilled checkpoint: proven to restore
# a path ending in one of these (and not a directory) is the selector within its parent: ROOT/latest is the pointer
# file writers leave, ROOT/last-good is spelt the same way
SELECTOR_FILES = (LATEST, LAST_GOOD)
_STEP_WORD = re.compile(r"^step-(\d+)$")  # `step-500`, as people say it: the step, not a directory name
_CHECKPOINT_ID = re.compile(r"^[0-9a-f]{12}$")  # layout.new_checkpoint_id's spelling

Within = Union[str, os.PathLike, Location, "Root"]


@dataclass(frozen=True)
class Reference:
    """A checkpoint as a user names it (`ckpt_path`, `fabric.load`, `Checkpointer.load`, the CLI): a selector
    within a root the caller knows, or a path that names its own root (or one checkpoint directory)."""

    text: str  # as given
    selector: str | int | None  # "latest", "last-good", a step (int), an id or a directory name; None: a path

    @property
    def is_path(self) -> bool:
        return self.selector is None

    @property
    def newest(self) -> bool:
        """`latest` (or a path, which means its root's latest): the one spelling an empty root may answer
        with nothing (start fresh) instead of an error."""
        return self.selector == "latest"


def parse_reference(text: str | int | os.PathLike) -> Reference:
    """The text of a reference. Without a `/`: `latest`, `last-good`, a step (`500` or `step-500`), a checkpoint
    id (12 hex digits) or a directory name (`step-000000500-<id>`) is a selector; anything else is a path (write
    `./name` for a directory here whose name looks like a selector)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return Reference(str(text), text)
    text = os.fspath(text) if isinstance(text, os.PathLike) else str(text)
    if "/" not in text:
        if text in ("latest", LAST_GOOD) or parse_dirname(text) is not None or _CHECKPOINT_ID.match(text):
            return Reference(text, text)
        if text.isdigit():
            return Reference(text, int(text))
        if (word := _STEP_WORD.match(text)) is not None:
            return Reference(text, int(word[1]))
    return Reference(text, None)


@dataclass(frozen=True)
class Located:
    """What a reference means: the root to pick in and what to pick there."""

    root: Location
    selector: str | int


def locate(
    reference: str | int | os.PathLike | Reference,
    within: Within | None = None,
    storage_options: dict | None = None,
) -> Located:
    """The one interpreter of references (see the module doc): `reference` within the root `within` (a selector
    needs one; a path names its own). Raises CheckpointNotFound for a path that does not exist or a file that is
    no spelling of a checkpoint, ConfigError for a selector without a root or within a checkpoint directory."""
    ref = reference if isinstance(reference, Reference) else parse_reference(reference)
    if ref.is_path:
        return _locate_path(ref.text, storage_options)
    if within is None:
        raise ConfigError(
            f"{ref.text!r} names a checkpoint within a checkpoint root, but no root was given; pass the root "
            f"(or write ./{ref.text} for a directory here)"
        )
    assert ref.selector is not None  # not a path (above)
    if isinstance(within, Root):
        return Located(within.location, ref.selector)
    if ref.newest:  # `latest` of a path is the path's own pick: a checkpoint directory is itself
        return _locate_path(within, storage_options)
    location = root_location(within, storage_options)
    _must_exist(location, location.url if isinstance(within, Location) else os.fspath(within))
    return Located(location, ref.selector)


def open_reference(
    reference: str | int | os.PathLike | Reference = "latest",
    within: Within | None = None,
    storage_options: dict | None = None,
    run_id: str | None = None,
    policy: SignaturePolicy | None = None,
) -> tuple[Location, CheckpointEntry]:
    """The root and the picked, validated entry that `reference` (within `within`) names: `locate`, then the
    catalog's pick. `run_id`: `latest` of that run (a resume's); `policy`: the pick a resume with
    `require_signature` makes (`latest`/`last-good` pass over what it refuses, a named checkpoint it refuses
    raises SignatureRefused)."""
    located = locate(reference, within, storage_options)
    return located.root, catalog.find(located.root, located.selector, run_id, policy)


def root_of(location: Location) -> Location:
    """The root a path names: a checkpoint directory's and `ROOT/latest`'s is ROOT; any other path is its own."""
    inside = _inside(location)
    return location if inside is None else inside.root


def is_selector_file(path: str | os.PathLike) -> bool:
    """`ROOT/latest` or `ROOT/last-good`: a path that names a checkpoint within its parent, even where a file of
    that name exists (the pointer), so a door that hands plain files elsewhere (Fabric's torch files) keeps it."""
    return os.fspath(path).rstrip("/").rsplit("/", 1)[-1] in SELECTOR_FILES


def root_location(url: Within, storage_options: dict | None = None) -> Location:
    """Where a root is (it need not exist yet); a checkpoint directory given instead is refused, naming its root,
    and a file (`ROOT/latest`, a stray file) with CheckpointNotFound naming what to pass instead."""
    if isinstance(url, Root):
        return url.location
    location = url if isinstance(url, Location) else fsio.resolve(url, storage_options)
    given = location.url if isinstance(url, Location) else os.fspath(url)
    if parse_dirname(location.path) is not None:
        parent = location.url.rstrip("/").rsplit("/", 1)[0]
        raise ConfigError(f"{given} is a checkpoint directory, not a root; give the root that holds it: {parent}")
    catalog.refuse_file(location, given)
    return location


def open_root(url: Within, storage_options: dict | None = None) -> Location:
    """A checkpoint root that exists; a checkpoint directory given instead is refused, naming its root."""
    location = root_location(url, storage_options)
    if not location.fs.exists(location.path):
        given = location.url if isinstance(url, (Location, Root)) else os.fspath(url)
        raise CheckpointNotFound(
            f"{given} does not exist; check the path (and the storage options, --storage-option on the "
            "command line, for remote storage)"
        )
    return location


class Root:
    """A checkpoint root on any storage (local disk, fsspec): its checkpoints listed, picked, opened, followed."""

    def __init__(self, location: Location) -> None:
        self.location = location

    @classmethod
    def at(cls, url: str | os.PathLike | Location, storage_options: dict | None = None, *, must_exist: bool = False):
        """The root at `url` (a checkpoint directory or a file is refused, naming what to pass instead)."""
        return cls(open_root(url, storage_options) if must_exist else root_location(url, storage_options))

    @property
    def url(self) -> str:
        return self.location.url

    def list(self, only: Callable[[str], bool] | None = None) -> list[CheckpointEntry]:
        """Every checkpoint directory, oldest step first (catalog.list_checkpoints; `only` narrows the reads)."""
        return catalog.list_checkpoints(self.location, only)

    def pick(
        self, reference: str | int = "latest", *, run_id: str | None = None, policy: SignaturePolicy | None = None
    ) -> CheckpointEntry:
        """The committed checkpoint `reference` names, its manifest validated: a selector here (a path names its
        own root, as everywhere: `open` also returns that root)."""
        located = locate(reference, self)
        return catalog.find(located.root, located.selector, run_id, policy)

    def open(
        self,
        reference: str | int | os.PathLike = "latest",
        *,
        storage_options: dict | None = None,
        run_id: str | None = None,
        policy: SignaturePolicy | None = None,
    ) -> tuple[Location, CheckpointEntry]:
        """`pick`, where a path names its own root (returned with the entry)."""
        return open_reference(reference, self, storage_options, run_id, policy)

    def follow(self, settled: set[str], policy: SignaturePolicy | None = None) -> builtins.list[CheckpointEntry]:
        """The committed, sound checkpoints not in `settled` (under `policy`: also accepted by it), in commit order;
        settles them, the corrupt and the refused ones. One listing, reads only of directories not settled."""
        fresh = []
        for entry in self.list(only=lambda name: name not in settled):
            if entry.state == UNCOMMITTED:
                continue  # in flight (or abandoned): looked at again next time, one small read
            settled.add(entry.name)
            if entry.committed:
                try:
                    # the rule the pick applies to what `latest` names (catalog.pick): the whole manifest read,
                    # matched against its commit record and validated. The record's own summary is not enough: a
                    # manifest edited after commit leaves the record as it was
                    manifest = entry.committed_manifest
                    if policy is not None:  # and, as the pick does under a policy, its signature over those bytes
                        policy.check_manifest(self.location.fs, entry.path, manifest)
                except CheckpointDeleted:
                    continue  # retention was quicker than this poll: nothing to evaluate
                except ShardCkptError as err:
                    log.warning("%s: not following %s: %s", self.url, entry.name, err)
                    continue
                fresh.append(entry)
            else:
                log.warning("%s: not following %s: %s", self.url, entry.name, entry.problem)
        return sorted(fresh, key=catalog.time_order)


def _inside(location: Location) -> Located | None:
    """A path that names a checkpoint inside its parent: a checkpoint directory, or `ROOT/latest` /
    `ROOT/last-good` that is not itself a directory (a root may be called `latest`); None for anything else."""
    name = location.path.rstrip("/").rsplit("/", 1)[-1]
    if parse_dirname(name) is None and (name not in SELECTOR_FILES or location.fs.isdir(location.path)):
        return None
    parent = location.path.rstrip("/").rsplit("/", 1)[0]
    # the URL keeps its protocol: callers compare it with their own root (a resume adopting its run id)
    root = Location(fs=location.fs, path=parent, url=location.url.rstrip("/").rsplit("/", 1)[0])
    return Located(root, name)


def _locate_path(path: str | os.PathLike | Location, storage_options: dict | None) -> Located:
    location = path if isinstance(path, Location) else fsio.resolve(path, storage_options)
    given = location.url if isinstance(path, Location) else os.fspath(path)
    inside = _inside(location)
    if inside is not None:
        if inside.selector in SELECTOR_FILES:  # the parent is the root: ROOT/latest of a ROOT that is not there
            _must_exist(inside.root, given.rstrip("/").rsplit("/", 1)[0])
        return inside
    _must_exist(location, given)
    catalog.refuse_file(location, given)
    return Located(location, "latest")


def _must_exist(location: Location, given: str) -> None:
    if not location.fs.exists(location.path):
        raise CheckpointNotFound(f"{given} does not exist; check the path (and storage_options for remote storage)")
