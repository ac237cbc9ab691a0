"""Where `shardckpt export` may write: never inside a checkpoint root, never over something by surprise.

A checkpoint root is any directory that is a committed checkpoint's directory, holds one, or lies inside
one. An export written there adds a file to a committed checkpoint (which `verify` then flags), replaces
one of its shards, or leaves files that retention and `gc` do not expect: so the directory an export
writes into, and every directory above it, must be none of these.

An existing OUT is replaced only when the caller says so (`--replace`, `ExportOptions(replace=True)`).
"""

from __future__ import annotations

import json
from typing import Any

from ..engine.format.names import MANIFEST, join, parse_dirname
from ..engine.storage import fsio
from ..errors import ConfigError
from .export_formats import SAFETENSORS_INDEX

FILE, DIRECTORY = "file", "directory"


def check_outside_checkpoint_roots(target: fsio.Location, written_into: str) -> None:
    """Raise ConfigError when `written_into` (where the artifact's files go) or a directory above it is a
    checkpoint root. One listing per directory up to the top of the filesystem or bucket."""
    directory = written_into.rstrip("/") or "/"
    while directory:
        if parse_dirname(directory) is not None and _is_file(target.fs, join(directory, MANIFEST)):
            raise ConfigError(
                f"export OUT {target.url} lies inside the committed checkpoint {directory}: writing there would "
                "change a committed checkpoint. Write the export outside the checkpoint root, e.g. ./model.safetensors"
            )
        inside = _committed_child(target.fs, directory)
        if inside is not None:
            raise ConfigError(
                f"export OUT {target.url} lies inside the checkpoint root {directory} (it holds {inside}): the "
                "export would mix with the checkpoints. Write it outside the checkpoint root, e.g. ./model.safetensors"
            )
        directory = _parent(directory)


def existing_kind(target: fsio.Location) -> str | None:
    """FILE or DIRECTORY when OUT exists, else None."""
    try:
        info = target.fs.info(target.path)
    except FileNotFoundError:
        return None
    return DIRECTORY if info.get("type") == DIRECTORY else FILE


def refuse_existing(target: fsio.Location, *, sharded: bool, replace: bool) -> None:
    """Raise ConfigError when OUT exists and may not be written: a directory where one file goes (or the
    reverse), or anything at all without `replace` (an empty directory for shards is fine)."""
    kind = existing_kind(target)
    if kind is None:
        return
    if not sharded and kind == DIRECTORY:
        raise ConfigError(
            f"export OUT {target.url} is a directory; this export is one file: name the file, e.g. "
            f"{join(target.url, 'model.safetensors')} (or pass --max-shard-size for a directory of shards)"
        )
    if sharded and kind == FILE:
        raise ConfigError(
            f"export OUT {target.url} is a file; a sharded export (--max-shard-size) is a directory: name a new one"
        )
    if replace or (kind == DIRECTORY and not target.fs.ls(target.path)):
        return
    raise ConfigError(
        f"export OUT {target.url} exists; pass --replace (ExportOptions(replace=True)) to replace it, "
        "or name another OUT"
    )


def previous_shards(target: fsio.Location) -> set[str]:
    """The shard names a sharded export already in OUT lists in its index; empty when there is none."""
    try:
        index = json.loads(target.fs.cat_file(join(target.path, SAFETENSORS_INDEX)))
        return {str(name) for name in index["weight_map"].values()}
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
        return set()


def present_names(target: fsio.Location) -> set[str]:
    try:
        return {str(info).rstrip("/").rsplit("/", 1)[-1] for info in target.fs.ls(target.path, detail=False)}
    except FileNotFoundError:
        return set()


def _committed_child(fs: Any, directory: str) -> str | None:
    try:
        names = [str(info).rstrip("/").rsplit("/", 1)[-1] for info in fs.ls(directory, detail=False)]
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    for name in names:
        if parse_dirname(name) is not None and _is_file(fs, join(directory, name, MANIFEST)):
            return name
    return None


def _is_file(fs: Any, path: str) -> bool:
    try:
        return fs.isfile(path)
    except (OSError, ValueError):
        return False


def _parent(path: str) -> str:
    if path == "/" or "/" not in path:
        return ""
    parent = path.rsplit("/", 1)[0]
    return parent or "/"
