"""Checkpoints as the command line names them: a root, a checkpoint directory, `ROOT/latest`, or a selector
(`latest`, `last-good`, a step, an id, a directory name: engine/catalog.parse_reference) within a root."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..engine import catalog
from ..engine.format.layout import LATEST, join, parse_dirname
from ..engine.format.signing import SignaturePolicy
from ..engine.storage import fsio
from ..engine.storage.fsio import Location
from ..errors import CheckpointNotFound, ConfigError


@dataclass
class Resolved:
    """A checkpoint reference resolved to a committed checkpoint."""

    ref: str
    root: Location
    entry: catalog.CheckpointEntry

    @property
    def path(self) -> str:
        return join(self.root.url, self.entry.name)


def open_path(
    path: str | os.PathLike,
    storage_options: dict[str, Any] | None,
    run_id: str | None = None,
    policy: SignaturePolicy | None = None,
) -> tuple[Location, catalog.CheckpointEntry]:
    """A checkpoint directory, a root (then its latest), or `ROOT/latest`."""
    path = os.fspath(path)
    head, sep, tail = path.rstrip("/").rpartition("/")
    if sep and head and tail == LATEST:
        location = fsio.resolve(path, storage_options)
        # `ROOT/latest` names the pointer file; it means the root's latest, checked against the manifests
        if not location.fs.isdir(location.path):
            return catalog.open_checkpoint(head, LATEST, storage_options, run_id, policy)
    return catalog.open_checkpoint(path, LATEST, storage_options, run_id, policy)


def open_reference(
    where: str | os.PathLike,
    which: str | int,
    storage_options: dict[str, Any] | None,
    run_id: str | None = None,
    policy: SignaturePolicy | None = None,
) -> tuple[Location, catalog.CheckpointEntry]:
    """The root and the picked, validated entry that `where` (a root, a checkpoint directory or `ROOT/latest`)
    and `which` (any spelling of catalog.parse_reference) name; a path in `which` names its own root. `policy`:
    the pick a resume with `require_signature` makes (catalog.pick: `latest`/`last-good` pass over what it
    refuses, a named checkpoint it refuses raises SignatureRefused)."""
    reference = catalog.parse_reference(which)
    if reference.is_path:  # as ckpt_path does
        return open_path(reference.text, storage_options, run_id, policy)
    if reference.newest:
        return open_path(where, storage_options, run_id, policy)
    root_location(where, storage_options)  # a selector picks within a root, never within a checkpoint
    return catalog.open_checkpoint(os.fspath(where), reference.selector, storage_options, run_id, policy)


def is_selector(ref: str) -> bool:
    """A selector within a root (a step, an id, a directory name, `latest`, `last-good`), not a path."""
    return not catalog.parse_reference(ref).is_path


def root_location(url: str | os.PathLike, storage_options: dict[str, Any] | None) -> Location:
    """Where a root is (it need not exist yet); a checkpoint directory given instead is refused, naming its root,
    and a file (`ROOT/latest`, a stray file) with CheckpointNotFound naming what to pass instead."""
    location = fsio.resolve(url, storage_options)
    if parse_dirname(location.path) is not None:
        parent = location.url.rstrip("/").rsplit("/", 1)[0]
        raise ConfigError(
            f"{os.fspath(url)} is a checkpoint directory, not a root; give the root that holds it: {parent}"
        )
    catalog.refuse_file(location, os.fspath(url))
    return location


def open_root(url: str | os.PathLike, storage_options: dict[str, Any] | None) -> Location:
    """A checkpoint root that exists; a checkpoint directory given instead is refused, naming its root."""
    location = root_location(url, storage_options)
    if not location.fs.exists(location.path):
        raise CheckpointNotFound(
            f"{os.fspath(url)} does not exist; check the path (and the storage options, --storage-option on the "
            "command line, for remote storage)"
        )
    return location


def resolve_pair(
    ref_a: str, ref_b: str, root: str | None, storage_options: dict[str, Any]
) -> tuple[Resolved, Resolved]:
    """Resolve A and B. Selectors go to `root`, else to the root of the other reference, which is a path."""
    root_location = open_root(root, storage_options) if root is not None else None
    resolved: dict[str, Resolved] = {}
    for ref in (ref_a, ref_b):
        if root_location is None and is_selector(ref):
            continue
        if is_selector(ref):
            resolved[ref] = Resolved(ref, root_location, _find(root_location, ref))
        else:
            location, entry = open_path(ref, storage_options)
            resolved[ref] = Resolved(ref, location, entry)
            root_location = root_location or location  # bare selectors resolve next to the first path
    for ref in (ref_a, ref_b):
        if ref not in resolved:
            if root_location is None:
                raise ConfigError(
                    f"{ref_a!r} and {ref_b!r} are both selectors; say which root they are in: "
                    f"shardckpt diff --root ROOT {ref_a} {ref_b} (or write ./{ref_a} for a directory here)"
                )
            resolved[ref] = Resolved(ref, root_location, _find(root_location, ref))
    return resolved[ref_a], resolved[ref_b]


def _find(root: Location, selector: str) -> catalog.CheckpointEntry:
    return catalog.find(root, catalog.parse_reference(selector).selector)
