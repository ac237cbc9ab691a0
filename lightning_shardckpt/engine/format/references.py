"""References: a chunk of an incremental checkpoint stored in a sibling checkpoint's file (FORMAT.md §9).

A reference is the path `../<sibling checkpoint directory>/<file>`, relative to the referencing
checkpoint's directory: one level up into the same root, one sibling, one file; never further. The
entry copies the holder's chunk record (offset, length, checksum, block checksums), and always names
the file that physically holds the bytes: a reference never points at a reference.

Reachability: the files a committed checkpoint references must stay while it is kept. Retention and
`shardckpt gc` both ask `pinned_files` which files of which directory are still referenced.
"""

from __future__ import annotations

import logging
from typing import Any

from . import part_references
from .chunk_index import ChunkIndex
from .entry import load_manifest, read_manifest

# The schema rules of a reference (its field, its form, why a path is not one) live with the rest of the
# manifest's schema, which validates them; these names stay here for the code that makes and follows them.
from .manifest_schema import REFERENCE_PREFIX as PREFIX
from .manifest_schema import REFERENCES_FIELD as REFERENCES_FIELD
from .manifest_schema import is_reference as is_reference
from .manifest_schema import split_reference as split
from .names import INCREMENTAL_FORMAT_VERSION, PARTS_FORMAT_VERSION, join

log = logging.getLogger(__name__)

RETIRED = "RETIRED"  # written into a checkpoint directory before its manifest is removed by retention


def make(sibling: str, file: str) -> str:
    """The reference to `file` of sibling checkpoint `sibling`; a reference stays as it is (never chains)."""
    return file if is_reference(file) else f"{PREFIX}{sibling}/{file}"


def referenced_files(manifest: dict[str, Any]) -> dict[str, set[str]]:
    """Sibling directory -> files of it that `manifest` references (v3: by path; v4/v5: holder ranks per
    directory, part_references.py)."""
    if (manifest.get("format_version") or 0) >= PARTS_FORMAT_VERSION:
        return part_references.files(manifest)
    out: dict[str, set[str]] = {}
    for item in manifest.get(REFERENCES_FIELD) or []:
        path = item.get("path") if isinstance(item, dict) else None
        parts = split(path) if isinstance(path, str) else None  # anything else is no reference (split's None)
        if parts:
            out.setdefault(parts[0], set()).add(parts[1])
    return out


def referenced_bytes(manifest: dict[str, Any]) -> int:
    return sum(item.get("bytes", 0) for item in manifest.get(REFERENCES_FIELD) or [] if isinstance(item, dict))


def pinned_files(location: Any, entries: list[Any], keep: set[str] | None = None) -> dict[str, set[str]]:
    """Directory -> files that a committed checkpoint (of `keep`, if given: names) still references.

    One reachability computation for retention and gc. Only incremental checkpoints hold references (format v3,
    or v4/v5 whose commit record counts referenced bytes), so only their manifests are read; a v4/v5 manifest
    lists its sibling files itself (FORMAT.md §10.6), no part is read.
    """
    pinned: dict[str, set[str]] = {}
    for entry in entries:
        if not entry.committed or (keep is not None and entry.name not in keep):
            continue
        record = entry.record or {}
        if record.get("format_version") != INCREMENTAL_FORMAT_VERSION and not record.get("bytes_referenced"):
            continue  # a full save references nothing (an incremental one on parts records its referenced bytes)
        try:
            manifest = read_manifest(location.fs, entry)
        except Exception:  # a damaged manifest: be conservative, its references cannot be known
            log.warning(
                "reachability: cannot read %s; nothing it might reference is deleted now", entry.path, exc_info=True
            )
            return {"*": set()}
        for sibling, files in referenced_files(manifest).items():
            pinned.setdefault(sibling, set()).update(files)
    return pinned


def everything_pinned(pinned: dict[str, set[str]]) -> bool:
    """True when reachability could not be computed (a damaged manifest): delete nothing referenced-looking."""
    return "*" in pinned


def chunk_map(
    manifest: dict[str, Any], dirname: str, keys: frozenset[str]
) -> dict[tuple[str, tuple[int, ...]], dict[str, Any]]:
    """(fqn, chunk offsets) -> chunk record to reference, for the tensors `keys` of checkpoint `dirname`.

    The record is the holder's own (offset, length, checksum, block checksums), its file rewritten as a
    reference; a chunk that is itself a reference keeps its path: it already names the physical holder.
    """
    out: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = {}
    for tensor in manifest["tensors"]:
        if tensor["fqn"] not in keys:
            continue
        for chunk in tensor["chunks"]:
            entry = dict(chunk, file=make(dirname, chunk["file"]))
            if "finite" in tensor:
                entry["finite"] = tensor["finite"]
            out[(tensor["fqn"], tuple(chunk["offsets"]))] = entry
    return out


def read_base(root: Any, dirname: str) -> dict[str, Any]:
    """The committed manifest of the incremental base `dirname` (validated), with its chunks: a format-v4 base
    lists them in its parts, which are read (and checked) here, so chunk_map sees every chunk either way."""
    directory = join(root.path, dirname)
    manifest = load_manifest(root.fs, directory)
    return ChunkIndex(root.fs, directory, manifest).expanded()
