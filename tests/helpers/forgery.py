"""Rewrite a committed checkpoint the way a buggy writer or an attacker with write access would.

The commit record holds a checksum of the manifest's bytes, and a v2 manifest one of `.metadata`'s (a v4 one
also those of the parts), so a file edited alone is caught by those checksums; a forgery that the current reader must judge on its
content rewrites every file that vouches for it, consistently, with the library's own builders.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_shardckpt.engine.format import manifest as manifest_format
from lightning_shardckpt.engine.format.checksum import checksum
from lightning_shardckpt.engine.format.layout import COMMIT_RECORD, DCP_METADATA, MANIFEST
from lightning_shardckpt.engine.format.parts import part_filename
from lightning_shardckpt.engine.format.parts import to_bytes as part_to_bytes
from lightning_shardckpt.engine.format.safe_pickle import DCP_METADATA_FIELD


def replace_file(path: str, data: bytes) -> None:
    """Committed files are write-once (read-only): replaced, as someone with write access to the root would."""
    if os.path.exists(path):
        os.remove(path)
    Path(path).write_bytes(data)


def forge_manifest(directory: str, edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Apply `edit` to the checkpoint's manifest and rewrite it with a commit record that vouches for it."""
    manifest = json.loads(Path(directory, MANIFEST).read_text())
    edit(manifest)
    data = manifest_format.to_bytes(manifest)
    replace_file(os.path.join(directory, MANIFEST), data)
    record = manifest_format.build_commit_record(manifest, data)
    replace_file(os.path.join(directory, COMMIT_RECORD), manifest_format.to_bytes(record))
    return manifest


def forge_metadata(directory: str, data: bytes) -> None:
    """Replace `.metadata` with `data`, and the manifest's record of it (and so the commit record) to match."""
    replace_file(os.path.join(directory, DCP_METADATA), data)
    forge_manifest(
        directory,
        lambda manifest: manifest.update({DCP_METADATA_FIELD: {"checksum": checksum(data), "bytes": len(data)}}),
    )


def forge_part(directory: str, rank: int, edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Apply `edit` to rank `rank`'s part (format v4) and rewrite it, with the manifest's record of its size and
    checksum (and so the commit record) to match: a part only its content can condemn."""
    path = os.path.join(directory, part_filename(rank))
    part = json.loads(Path(path).read_text())
    edit(part)
    data = part_to_bytes(part)
    replace_file(path, data)

    def record(manifest: dict[str, Any]) -> None:
        manifest["parts"]["part_bytes"][rank] = len(data)
        digests = manifest["parts"]["part_checksums"]
        manifest["parts"]["part_checksums"] = digests[: 16 * rank] + checksum(data) + digests[16 * (rank + 1) :]

    forge_manifest(directory, record)
    return part
