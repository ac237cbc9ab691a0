"""The manifest: build (v2/v3 from DCP's global metadata, v4 from the ranks' parts), serialize, parse and
validate (v1-v4); and the small commit record.

The spec is docs/FORMAT.md. The commit record (`commit.json`) carries what a listing needs (id, step,
run, lineage, time, size) so listing a root never parses a tensor table; from v4 it also carries what a
timeline shows (`summary`), so a timeline never reads a manifest either.
"""

from __future__ import annotations

import functools
import json
import platform
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ...errors import CorruptCheckpoint, IncompatibleCheckpoint
from ..gc_pause import gc_paused
from . import bounded_json, groups, manifest_schema, parts_manifest
from .checksum import checksum, checksum_of_checksums
from .manifest_schema import BLOCKS_FIELD, REFERENCES_FIELD
from .names import (
    CHECKSUM_ALGORITHM,
    DCP_METADATA,
    DCP_METADATA_FIELD,
    FORMAT_VERSION,
    GROUPS_FORMAT_VERSION,
    INCREMENTAL_FORMAT_VERSION,
    NEWEST_FORMAT_VERSION,
    PARTS_FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
    DirName,
    parse_dirname,
)
from .parts import PART_SUFFIX
from .parts_manifest import PARTS_FIELD

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

REQUIRED_FIELDS = ("format_version", "id", "step", "created_at", "files", "tensors", "objects", "topology")
# v4: the parts table takes the place of `files` (parts_manifest.py)
REQUIRED_FIELDS_V4 = ("format_version", "id", "step", "created_at", PARTS_FIELD, "tensors", "objects", "topology")
# v5: the groups table takes the place of the parts table (groups.py)
REQUIRED_FIELDS_V5 = tuple(groups.GROUPS_FIELD if name == PARTS_FIELD else name for name in REQUIRED_FIELDS_V4)
SUMMARY_FIELD = "summary"  # v4 commit record: the manifest's small fields a timeline shows (build_commit_record)
# copied from the manifest into the commit record: what listing, `latest` and retention decide by
RECORD_FIELDS = ("format_version", "id", "step", "run_id", "parent", "seq", "created_at")
IDENTITY_BLOCKS = ("config", "data", "model", "code", "run")


@functools.cache  # importlib.metadata scans every distribution on sys.path (~0.4 ms): once per process, not per save
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


def build_manifest(*, metadata: Metadata, receipts: dict[MetadataIndex, Any], **header_fields: Any) -> dict[str, Any]:
    """Describe a fully written checkpoint: every file, tensor chunk and object with its checksum.
    `header_fields` are `header`'s keyword arguments but the format version."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    tensors, objects = [], []
    for fqn, item in sorted(metadata.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            chunks = []
            for chunk in item.chunks:
                receipt = receipts[MetadataIndex(fqn, chunk.offsets)]
                chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes), **_where(receipt)})
            entry: dict[str, Any] = {
                "fqn": fqn,
                "shape": list(item.size),
                "dtype": str(item.properties.dtype),
                "chunks": chunks,
            }
            flags = [getattr(receipts[MetadataIndex(fqn, chunk.offsets)], "finite", None) for chunk in item.chunks]
            if any(flag is not None for flag in flags):
                entry["finite"] = all(flag is not False for flag in flags)  # for drills: NaN/Inf at save time?
            tensors.append(entry)
        elif isinstance(item, BytesStorageMetadata):
            objects.append({"fqn": fqn, **_where(receipts[MetadataIndex(fqn)])})
    own = [receipt for receipt in receipts.values() if not getattr(receipt, "reference", False)]
    referenced = [receipt for receipt in receipts.values() if getattr(receipt, "reference", False)]
    manifest = header(format_version=INCREMENTAL_FORMAT_VERSION if referenced else FORMAT_VERSION, **header_fields)
    manifest.update({"files": _files(own), "tensors": tensors, "objects": objects})
    if referenced:  # v3 (FORMAT.md §9): chunks held by sibling checkpoints of the same root
        by_path: dict[str, list[Any]] = {}
        for receipt in referenced:
            by_path.setdefault(receipt.relative_path, []).append(receipt)
        manifest[REFERENCES_FIELD] = [
            {"path": path, "bytes": sum(r.length for r in chunks), "chunks": len(chunks)}
            for path, chunks in sorted(by_path.items())
        ]
    return manifest


def build_parts_manifest(
    *,
    tensors: list[dict[str, Any]],
    objects: list[dict[str, Any]],
    parts: dict[str, Any] | None = None,
    group_table: dict[str, Any] | None = None,
    **header_fields: Any,
) -> dict[str, Any]:
    """A format-v4 manifest: per checkpoint, not per chunk. `tensors` are {fqn, shape, dtype, layout[, finite]},
    `objects` {fqn, rank}, `parts` the table of parts_manifest.parts_table; the chunks are in the parts. With
    `group_table` (groups.groups_table) instead of `parts`: format v5.
    `header_fields` are `header`'s keyword arguments but the format version."""
    if (parts is None) == (group_table is None):
        raise ValueError("a parts-format manifest has a parts table (v4) or a groups table (v5), one of them")
    version = PARTS_FORMAT_VERSION if group_table is None else GROUPS_FORMAT_VERSION
    manifest = header(format_version=version, **header_fields)
    manifest.update(
        {
            **({PARTS_FIELD: parts} if group_table is None else {groups.GROUPS_FIELD: group_table}),
            "tensors": sorted(tensors, key=lambda t: t["fqn"]),
            "objects": sorted(objects, key=lambda o: o["fqn"]),
        }
    )
    return manifest


def header(
    *,
    format_version: int,
    checkpoint_id: str,
    parent: str | None,
    step: int,
    topology: dict[str, Any],
    verification: dict[str, Any],
    epoch: int | None = None,
    samples_consumed: int | None = None,
    identity: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    run_id: str | None = None,
    seq: int = 1,
) -> dict[str, Any]:
    """Every manifest field but the tables (files or parts, tensors, objects), which each format version
    builds its own way: one builder, so v2/v3 and v4 manifests cannot drift apart on what a header holds."""
    identity_block = empty_identity()
    identity_block.update(identity or {})
    return {
        "format_version": format_version,
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
        "identity": identity_block,
        "verification": verification,
        "extra": extra or {},
        "run_id": run_id,
    }


def to_bytes(manifest: dict[str, Any]) -> bytes:
    """The manifest's bytes: sorted keys, every top-level key on its own line (ops/manifest_summary.py finds
    them without parsing the tables). v1-v3 indent every level; v4 writes each value compactly, since its
    tables are long lists of numbers that an indent would put one per line (and json's C encoder refuses
    indents: 5x slower)."""
    if (manifest.get("format_version") or 0) < PARTS_FORMAT_VERSION:
        return (json.dumps(manifest, indent=1, sort_keys=True, default=str) + "\n").encode()
    fields = (
        f" {json.dumps(key)}: {json.dumps(manifest[key], sort_keys=True, separators=(',', ':'), default=str)}"
        for key in sorted(manifest)
    )
    return ("{\n" + ",\n".join(fields) + "\n}\n").encode()


def parse(data: bytes, where: str) -> dict[str, Any]:
    """Parse and validate a manifest; the error names `where` and what to do.

    When `where` ends in a checkpoint directory name, the manifest's id and step must match it.
    """
    manifest = _json_object(data, where, "manifest", bounded_json.MANIFEST_MAX_BYTES)
    version = _version(manifest, where, "manifest")
    missing = [name for name in required_fields(version) if name not in manifest]
    if missing:
        raise CorruptCheckpoint(f"{where}: manifest lacks required fields {missing}; the checkpoint is damaged")
    problems = manifest_problems(manifest, parse_dirname(where))
    if problems:
        raise CorruptCheckpoint(_invalid(where, "manifest", version, problems))
    return manifest


def required_fields(version: int) -> tuple[str, ...]:
    if version >= GROUPS_FORMAT_VERSION:
        return REQUIRED_FIELDS_V5
    return REQUIRED_FIELDS_V4 if version >= PARTS_FORMAT_VERSION else REQUIRED_FIELDS


def manifest_problems(manifest: dict[str, Any], dirname: DirName | None) -> list[str]:
    """Every value rule of the manifest's version (FORMAT.md §5, §10.1); empty when it is sound."""
    if manifest["format_version"] >= GROUPS_FORMAT_VERSION:
        return manifest_schema.common_problems(manifest, dirname) + groups.manifest_problems(manifest)
    if manifest["format_version"] >= PARTS_FORMAT_VERSION:
        return manifest_schema.common_problems(manifest, dirname) + parts_manifest.table_problems(manifest)
    return manifest_schema.manifest_problems(manifest, dirname)


def build_commit_record(manifest: dict[str, Any], manifest_bytes: bytes) -> dict[str, Any]:
    """The commit record of `manifest`: its listing fields, its size, and a checksum of its exact bytes; from
    v4 also its `summary` (summary_of)."""
    record = {name: manifest.get(name) for name in RECORD_FIELDS}
    record["bytes_total"] = total_bytes(manifest)
    if manifest.get(REFERENCES_FIELD):
        record["bytes_referenced"] = referenced_bytes(manifest)
    if (manifest.get("format_version") or 0) >= PARTS_FORMAT_VERSION:
        record[SUMMARY_FIELD] = summary_of(manifest)
    record["manifest_checksum"] = checksum(manifest_bytes)
    return record


# what a timeline row shows of a checkpoint besides the listing fields (ops/investigate.py)
SUMMARY_KEYS = ("epoch", "samples_consumed", "topology", "verification")


def summary_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's small fields a timeline shows, with each identity block as a digest: a timeline compares
    digests, and reads the two manifests only where a block changed. Bounded: no table, no identity block."""
    summary: dict[str, Any] = {key: manifest.get(key) for key in SUMMARY_KEYS}
    metrics = (manifest.get("extra") or {}).get("metrics")
    summary["extra"] = {"metrics": metrics} if metrics is not None else {}
    identity = manifest.get("identity") or {}
    summary["identity_digests"] = {
        block: None if identity.get(block) is None else canonical_digest(identity[block]) for block in IDENTITY_BLOCKS
    }
    summary[RECORD_DIGEST_FIELD] = record_fields_digest(manifest)
    return summary


RECORD_DIGEST_FIELD = "record_digest"


def record_fields_digest(document: dict[str, Any]) -> str:
    """A digest of the listing fields (RECORD_FIELDS) as `document` states them. A v4 summary carries the
    manifest's: a reader that trusts the summary alone (a timeline) still notices a record whose fields were
    edited after commit, without reading the manifest."""
    return canonical_digest({name: document.get(name) for name in RECORD_FIELDS})


def canonical_digest(value: Any) -> str:
    """xxh3_64 of the value's canonical JSON (sorted keys, `,` and `:`): FORMAT.md §5's identity digest."""
    return checksum(json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode())


def parse_commit_record(data: bytes, where: str) -> dict[str, Any]:
    """Parse and validate a commit record (the id and step must match the directory in `where`)."""
    record = _json_object(data, where, "commit record", bounded_json.SMALL_MAX_BYTES)
    version = _version(record, where, "commit record")
    problems = manifest_schema.record_problems(record, parse_dirname(where))
    if problems:
        raise CorruptCheckpoint(_invalid(where, "commit record", version, problems))
    return record


def check_record_agrees(record: dict[str, Any], manifest: dict[str, Any], where: str) -> None:
    """The commit record says what its manifest says, field by field (the checksum proves only the manifest's
    bytes): a record edited after commit would otherwise reorder the root, e.g. an old checkpoint whose record
    claims `seq: 1000` becoming `latest`. `manifest` may be a summary without its tables (ops/manifest_summary.py):
    the sizes are then not compared, the checksum vouched for the tables they come from."""
    problems = [
        f"commit record says {name}={record.get(name)!r}, its manifest says {name}={manifest.get(name)!r}"
        for name in RECORD_FIELDS
        if record.get(name) != manifest.get(name)
    ]
    if "files" in manifest or PARTS_FIELD in manifest or groups.GROUPS_FIELD in manifest:  # the tables are there
        for name, actual in (("bytes_total", total_bytes(manifest)), ("bytes_referenced", referenced_bytes(manifest))):
            expected = record.get(name, 0 if name == "bytes_referenced" else None)
            if expected != actual:
                problems.append(f"commit record says {name}={expected!r}, its manifest adds up to {actual!r}")
    if problems:
        raise CorruptCheckpoint(
            f"{where}: {'; '.join(problems)}: the commit record was edited after commit. Listing orders and sizes "
            "checkpoints by the record, so this one is not trusted; load another checkpoint, or restore the directory "
            "from a replica"
        )


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
SCHEMA_CHECKED_TABLES = ("tensors", "objects", "files", PARTS_FIELD, groups.GROUPS_FIELD)


def _json_object(data: bytes, where: str, what: str, max_bytes: int) -> dict[str, Any]:
    try:
        with gc_paused():  # a large manifest is many small objects (engine/gc_pause.py)
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
            f"{where}: manifest format v{version} is newer than this lightning_shardckpt reads (v{NEWEST_FORMAT_VERSION}); "
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
    """Yield (fqn, chunk) for every tensor chunk and object, each with file, offset, length, checksum.
    Format v1-v3 only: a v4 manifest lists no chunk (its parts do: engine/format/chunk_index.py)."""
    for tensor in manifest["tensors"]:
        for chunk in tensor["chunks"]:
            yield tensor["fqn"], chunk
    for obj in manifest["objects"]:
        yield obj["fqn"], obj


def total_bytes(manifest: dict[str, Any]) -> int:
    """The bytes this checkpoint's own files hold (an incremental one's references are not counted; a v4
    one's parts are: they are files of the checkpoint)."""
    if groups.is_grouped(manifest):
        return groups.bytes_total(manifest)
    if is_parts_format(manifest):
        return parts_manifest.bytes_total(manifest)
    return sum(entry["bytes"] for entry in files_of(manifest))


def files_of(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every file of the checkpoint: `{path, bytes, checksum}` (v4 adds `kind`: shard or part), sorted by path.
    v1-v3: the manifest's `files`; v4: built from its parts table; v5: from its groups' tables and the groups
    table (kind `group`), once groups.expanded read them."""
    if groups.is_grouped(manifest):
        if PARTS_FIELD not in manifest:
            raise ValueError("a v5 manifest lists its files in its group tables: pass it through groups.expanded")
        return sorted(parts_manifest.files_of(manifest) + groups.table_files(manifest), key=lambda f: f["path"])
    if (manifest.get("format_version") or 0) >= PARTS_FORMAT_VERSION:
        return parts_manifest.files_of(manifest)
    return manifest["files"]


def is_parts_format(manifest: dict[str, Any]) -> bool:
    """Format v4: the chunks are in per-rank parts, not in the manifest."""
    return (manifest.get("format_version") or 0) >= PARTS_FORMAT_VERSION


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


def files_with_metadata(manifest: dict[str, Any]) -> dict[str, int]:
    """Every file of the checkpoint and its committed size, `.metadata` included when the checkpoint has one."""
    sizes = {entry["path"]: entry["bytes"] for entry in files_of(manifest)}
    if manifest.get(DCP_METADATA_FIELD) is not None:  # v4 writes it for small checkpoints only; v1 recorded none
        sizes[DCP_METADATA] = manifest[DCP_METADATA_FIELD]["bytes"]
    return sizes


def transfer_order(relative: str) -> tuple[int, str]:
    """Group tables and parts before shard files: a v4 shard is checked by the chunk ranges its part lists, so the
    part lands first (and v5's group tables, which list the parts, before them)."""
    return (0 if relative.endswith(groups.GROUP_SUFFIX) else 1 if relative.endswith(PART_SUFFIX) else 2, relative)
