"""Manifest format v1: build, serialize, parse and validate. The spec is docs/FORMAT.md."""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from ..errors import CorruptCheckpoint, IncompatibleCheckpoint
from .checksum import checksum_of_checksums
from .layout import CHECKSUM_ALGORITHM, FORMAT_VERSION

REQUIRED_FIELDS = ("format_version", "id", "step", "created_at", "files", "tensors", "objects", "topology")
IDENTITY_BLOCKS = ("config", "data", "model", "code", "run")


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning_shardckpt")
    except PackageNotFoundError:
        return "0+unknown"


def writer_versions() -> dict[str, str]:
    return {"lightning_shardckpt": package_version(), "torch": torch.__version__, "python": platform.python_version()}


def empty_identity() -> dict[str, Any]:
    """The identity block with every sub-block present; callers fill what they know."""
    return {block: None for block in IDENTITY_BLOCKS}


def build_manifest(
    *,
    checkpoint_id: str,
    parent: str | None,
    step: int,
    metadata: Metadata,
    receipts: dict[MetadataIndex, Any],
    topology: dict[str, Any],
    verification: dict[str, Any],
    epoch: int | None = None,
    samples_consumed: int | None = None,
    identity: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Describe a fully written checkpoint: every file, tensor chunk and object with its checksum."""
    tensors, objects = [], []
    for fqn, item in sorted(metadata.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            chunks = []
            for chunk in item.chunks:
                receipt = receipts[MetadataIndex(fqn, chunk.offsets)]
                chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes), **_where(receipt)})
            tensors.append({"fqn": fqn, "shape": list(item.size), "dtype": str(item.properties.dtype), "chunks": chunks})
        elif isinstance(item, BytesStorageMetadata):
            objects.append({"fqn": fqn, **_where(receipts[MetadataIndex(fqn)])})
    identity_block = empty_identity()
    identity_block.update(identity or {})
    return {
        "format_version": FORMAT_VERSION,
        "id": checkpoint_id,
        "parent": parent,
        "step": step,
        "epoch": epoch,
        "samples_consumed": samples_consumed,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        "writer": writer_versions(),
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "topology": topology,
        "files": _files(receipts.values()),
        "tensors": tensors,
        "objects": objects,
        "identity": identity_block,
        "verification": verification,
        "extra": extra or {},
        "run_id": run_id,
    }


def to_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True, default=str) + "\n").encode()


def parse(data: bytes, where: str) -> dict[str, Any]:
    """Parse and validate a manifest; the error names `where` and what to do."""
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpoint(f"{where}: manifest is not valid JSON ({err}); the checkpoint is damaged, load an older one") from err
    if not isinstance(manifest, dict):
        raise CorruptCheckpoint(f"{where}: manifest is not a JSON object; the checkpoint is damaged, load an older one")
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise CorruptCheckpoint(f"{where}: manifest has no integer format_version; it was not written by lightning_shardckpt")
    if version > FORMAT_VERSION:
        raise IncompatibleCheckpoint(
            f"{where}: manifest format v{version} is newer than this lightning_shardckpt reads (v{FORMAT_VERSION}); "
            "upgrade: pip install -U lightning_shardckpt"
        )
    missing = [name for name in REQUIRED_FIELDS if name not in manifest]
    if missing:
        raise CorruptCheckpoint(f"{where}: manifest lacks required fields {missing}; the checkpoint is damaged")
    return manifest


def expected_checksums(manifest: dict[str, Any]) -> dict[tuple[str, int], tuple[str, str]]:
    """(file, byte offset) -> (checksum, fqn) for every chunk and object the manifest lists."""
    table: dict[tuple[str, int], tuple[str, str]] = {}
    for fqn, chunk in iter_chunks(manifest):
        table[(chunk["file"], chunk["offset"])] = (chunk["checksum"], fqn)
    return table


def iter_chunks(manifest: dict[str, Any]):
    """Yield (fqn, chunk) for every tensor chunk and object, each with file, offset, length, checksum."""
    for tensor in manifest["tensors"]:
        for chunk in tensor["chunks"]:
            yield tensor["fqn"], chunk
    for obj in manifest["objects"]:
        yield obj["fqn"], obj


def total_bytes(manifest: dict[str, Any]) -> int:
    return sum(entry["bytes"] for entry in manifest["files"])


def _where(receipt: Any) -> dict[str, Any]:
    return {"file": receipt.relative_path, "offset": receipt.offset, "length": receipt.length, "checksum": receipt.checksum}


def _files(receipts: Any) -> list[dict[str, Any]]:
    by_file: dict[str, list[Any]] = {}
    for receipt in receipts:
        by_file.setdefault(receipt.relative_path, []).append(receipt)
    files = []
    for path, chunks in sorted(by_file.items()):
        chunks.sort(key=lambda r: r.offset)
        files.append({"path": path, "bytes": chunks[0].file_bytes, "checksum": checksum_of_checksums([c.checksum for c in chunks])})
    return files
