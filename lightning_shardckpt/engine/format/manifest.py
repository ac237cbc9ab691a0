"""Manifest format v2 (reads v1): build, serialize, parse and validate; and the small commit record.

The spec is docs/FORMAT.md. The commit record (`commit.json`) carries what a listing needs (id, step,
run, lineage, time, size) so listing a root never parses a tensor table.
"""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ...errors import CorruptCheckpoint, IncompatibleCheckpoint
from . import bounded_json, manifest_schema
from .checksum import checksum, checksum_of_checksums
from .layout import (
    CHECKSUM_ALGORITHM,
    FORMAT_VERSION,
    INCREMENTAL_FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
    parse_dirname,
)
from .manifest_schema import BLOCKS_FIELD, REFERENCES_FIELD

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

REQUIRED_FIELDS = ("format_version", "id", "step", "created_at", "files", "tensors", "objects", "topology")
# copied from the manifest into the commit record: what listing, `latest` and retention decide by
RECORD_FIELDS = ("format_version", "id", "step", "run_id", "parent", "seq", "created_at")
IDENTITY_BLOCKS = ("config", "data", "model", "code", "run")


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning_shardckpt")
    except PackageNotFoundError:
        return "0+unknown"


def writer_versions() -> dict[str, str]:
    import torch  # here, not at the top: reading manifests (`shardckpt ls`) must not pay for importing torch

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
    seq: int = 1,
) -> dict[str, Any]:
    """Describe a fully written checkpoint: every file, tensor chunk and object with its checksum."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    tensors, objects = [], []
    for fqn, item in sorted(metadata.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            chunks = []
            for chunk in item.chunks:
                receipt = receipts[MetadataIndex(fqn, chunk.offsets)]
                chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes), **_where(receipt)})
            entry = {"fqn": fqn, "shape": list(item.size), "dtype": str(item.properties.dtype), "chunks": chunks}
            flags = [getattr(receipts[MetadataIndex(fqn, chunk.offsets)], "finite", None) for chunk in item.chunks]
            if any(flag is not None for flag in flags):
                entry["finite"] = all(flag is not False for flag in flags)  # for drills: NaN/Inf at save time?
            tensors.append(entry)
        elif isinstance(item, BytesStorageMetadata):
            objects.append({"fqn": fqn, **_where(receipts[MetadataIndex(fqn)])})
    identity_block = empty_identity()
    identity_block.update(identity or {})
    own = [receipt for receipt in receipts.values() if not getattr(receipt, "reference", False)]
    referenced = [receipt for receipt in receipts.values() if getattr(receipt, "reference", False)]
    manifest = {
        "format_version": INCREMENTAL_FORMAT_VERSION if referenced else FORMAT_VERSION,
        "id": checkpoint_id,
        "parent": parent,
        "seq": seq,
        "step": step,
        "epoch": epoch,
        "samples_consumed": samples_consumed,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        "writer": writer_versions(),
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "topology": topology,
        "files": _files(own),
        "tensors": tensors,
        "objects": objects,
        "identity": identity_block,
        "verification": verification,
        "extra": extra or {},
        "run_id": run_id,
    }
    if referenced:  # v3 (FORMAT.md §9): chunks held by sibling checkpoints of the same root
        by_path: dict[str, list[Any]] = {}
        for receipt in referenced:
            by_path.setdefault(receipt.relative_path, []).append(receipt)
        manifest[REFERENCES_FIELD] = [
            {"path": path, "bytes": sum(r.length for r in chunks), "chunks": len(chunks)}
            for path, chunks in sorted(by_path.items())
        ]
    return manifest


def to_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True, default=str) + "\n").encode()


def parse(data: bytes, where: str) -> dict[str, Any]:
    """Parse and validate a manifest; the error names `where` and what to do.

    When `where` ends in a checkpoint directory name, the manifest's id and step must match it.
    """
    manifest = _json_object(data, where, "manifest", bounded_json.MANIFEST_MAX_BYTES)
    version = _version(manifest, where, "manifest")
    missing = [name for name in REQUIRED_FIELDS if name not in manifest]
    if missing:
        raise CorruptCheckpoint(f"{where}: manifest lacks required fields {missing}; the checkpoint is damaged")
    problems = manifest_schema.manifest_problems(manifest, parse_dirname(where))
    if problems:
        raise CorruptCheckpoint(_invalid(where, "manifest", version, problems))
    return manifest


def build_commit_record(manifest: dict[str, Any], manifest_bytes: bytes) -> dict[str, Any]:
    """The commit record of `manifest`: its listing fields, its size, and a checksum of its exact bytes."""
    record = {name: manifest.get(name) for name in RECORD_FIELDS}
    record["bytes_total"] = total_bytes(manifest)
    if manifest.get(REFERENCES_FIELD):
        record["bytes_referenced"] = referenced_bytes(manifest)
    record["manifest_checksum"] = checksum(manifest_bytes)
    return record


def parse_commit_record(data: bytes, where: str) -> dict[str, Any]:
    """Parse and validate a commit record (the id and step must match the directory in `where`)."""
    record = _json_object(data, where, "commit record", bounded_json.SMALL_MAX_BYTES)
    version = _version(record, where, "commit record")
    problems = manifest_schema.record_problems(record, parse_dirname(where))
    if problems:
        raise CorruptCheckpoint(_invalid(where, "commit record", version, problems))
    return record


def record_of_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """A v1 manifest's listing fields, as a commit record holds them (no seq, no manifest checksum)."""
    record = {name: manifest.get(name) for name in RECORD_FIELDS}
    record["bytes_total"] = total_bytes(manifest)
    return record


def check_matches_record(manifest_bytes: bytes, record: dict[str, Any], where: str) -> None:
    """The manifest is the one the commit record was written for (not replaced or edited since)."""
    expected = record.get("manifest_checksum")
    if expected is not None and checksum(manifest_bytes) != expected:
        raise CorruptCheckpoint(
            f"{where}: manifest does not match its commit record (checksum {checksum(manifest_bytes)}, recorded "
            f"{expected}); it was edited or replaced after commit. Restore the directory from a replica or load another checkpoint"
        )


def check_parse_cost(data: bytes, where: str) -> None:
    """CorruptCheckpoint when parsing the manifest `data` could cost more than a small multiple of its size
    (bounded_json.check_parse_cost): for readers that parse only part of it."""
    try:
        bounded_json.check_parse_cost(data)
    except bounded_json.UnreadableJson as err:
        raise CorruptCheckpoint(f"{where}: manifest is {err}; the checkpoint is damaged, load an older one") from err


# the manifest's tables: checked entry by entry by manifest_schema, so the depth walk skips them
SCHEMA_CHECKED_TABLES = ("tensors", "objects", "files")


def _json_object(data: bytes, where: str, what: str, max_bytes: int) -> dict[str, Any]:
    try:
        document = bounded_json.loads(data, max_bytes, schema_checked=SCHEMA_CHECKED_TABLES)
    except bounded_json.UnreadableJson as err:
        raise CorruptCheckpoint(f"{where}: {what} is {err}; the checkpoint is damaged, load an older one") from err
    if not isinstance(document, dict):
        raise CorruptCheckpoint(f"{where}: {what} is not a JSON object; the checkpoint is damaged, load an older one")
    return document


def _version(document: dict[str, Any], where: str, what: str) -> int:
    version = document.get("format_version")
    if not manifest_schema.is_int(version) or version < 1:
        raise CorruptCheckpoint(
            f"{where}: {what} has no integer format_version; it was not written by lightning_shardckpt"
        )
    if version not in READABLE_FORMAT_VERSIONS:
        raise IncompatibleCheckpoint(
            f"{where}: manifest format v{version} is newer than this lightning_shardckpt reads (v{FORMAT_VERSION}); "
            "upgrade: pip install -U lightning_shardckpt"
        )
    return version


def _invalid(where: str, what: str, version: int, problems: list[str]) -> str:
    shown = "; ".join(problems[: manifest_schema.MAX_PROBLEMS]) + (
        " …" if len(problems) > manifest_schema.MAX_PROBLEMS else ""
    )
    return f"{where}: {what} (format v{version}) is invalid: {shown}. The checkpoint is damaged or was altered; load another one"


def expected_checksums(manifest: dict[str, Any]) -> dict[tuple[str, int], tuple[str, str]]:
    """(file, byte offset) -> (checksum, fqn) for every chunk and object the manifest lists."""
    table: dict[tuple[str, int], tuple[str, str]] = {}
    for fqn, chunk in iter_chunks(manifest):
        table[(chunk["file"], chunk["offset"])] = (chunk["checksum"], fqn)
    return table


def expected_blocks(manifest: dict[str, Any]) -> dict[tuple[str, int], tuple[int, list[str]]]:
    """(file, byte offset) -> (block size, block checksums) for every chunk checksummed by block too."""
    return {
        (chunk["file"], chunk["offset"]): (chunk[BLOCKS_FIELD]["size"], chunk[BLOCKS_FIELD]["checksums"])
        for _, chunk in iter_chunks(manifest)
        if BLOCKS_FIELD in chunk
    }


def iter_chunks(manifest: dict[str, Any]):
    """Yield (fqn, chunk) for every tensor chunk and object, each with file, offset, length, checksum."""
    for tensor in manifest["tensors"]:
        for chunk in tensor["chunks"]:
            yield tensor["fqn"], chunk
    for obj in manifest["objects"]:
        yield obj["fqn"], obj


def total_bytes(manifest: dict[str, Any]) -> int:
    """The bytes this checkpoint's own files hold (an incremental one's references are not counted)."""
    return sum(entry["bytes"] for entry in manifest["files"])


def referenced_bytes(manifest: dict[str, Any]) -> int:
    """The bytes of chunks this checkpoint references in earlier checkpoints (0 for a full one)."""
    return sum(entry["bytes"] for entry in manifest.get(REFERENCES_FIELD) or [])


def _where(receipt: Any) -> dict[str, Any]:
    where = {
        "file": receipt.relative_path,
        "offset": receipt.offset,
        "length": receipt.length,
        "checksum": receipt.checksum,
    }
    blocks = getattr(receipt, "blocks", None)  # receipts pickled by an older writer have no such field
    if blocks is not None:
        where[BLOCKS_FIELD] = {"size": blocks[0], "checksums": list(blocks[1])}
    return where


def _files(receipts: Any) -> list[dict[str, Any]]:
    by_file: dict[str, list[Any]] = {}
    for receipt in receipts:
        by_file.setdefault(receipt.relative_path, []).append(receipt)
    files = []
    for path, chunks in sorted(by_file.items()):
        chunks.sort(key=lambda r: r.offset)
        files.append(
            {
                "path": path,
                "bytes": chunks[0].file_bytes,
                "checksum": checksum_of_checksums([c.checksum for c in chunks]),
            }
        )
    return files
