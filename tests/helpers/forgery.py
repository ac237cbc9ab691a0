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

from lightning_shardckpt.engine.format import digest_column
from lightning_shardckpt.engine.format import manifest as manifest_format
from lightning_shardckpt.engine.format.checksum import checksum
from lightning_shardckpt.engine.format.names import COMMIT_RECORD, DCP_METADATA, MANIFEST
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


def forge_part(
    directory: str,
    rank: int,
    edit: Callable[[dict[str, Any]], None],
    manifest_edit: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Apply `edit` to rank `rank`'s part (format v4) and rewrite it, with the manifest's record of its size and
    checksum (and so the commit record) to match: a part only its content can condemn."""
    path = os.path.join(directory, part_filename(rank))
    part = digest_column.unpack(json.loads(Path(path).read_text()))  # the records as every reader sees them
    edit(part)
    data = part_to_bytes(part)
    replace_file(path, data)

    def record(manifest: dict[str, Any]) -> None:
        manifest["parts"]["part_bytes"][rank] = len(data)
        digests = manifest["parts"]["part_checksums"]
        manifest["parts"]["part_checksums"] = digests[: 16 * rank] + checksum(data) + digests[16 * (rank + 1) :]
        if manifest_edit is not None:
            manifest_edit(manifest)

    forge_manifest(directory, record)
    return part


def forge_chunk_length(directory: str, fqn: str, length: int) -> None:
    """Claim that the chunk of `fqn` (a tensor's first chunk or an object) is `length` bytes long, in `.metadata`
    and the manifest alike, its file's size in the manifest grown to match: every file vouches for the lie, only
    the shard file itself, unchanged, says otherwise."""
    import dataclasses
    import pickle

    metadata = pickle.loads(Path(directory, DCP_METADATA).read_bytes())  # our own checkpoint: trusted here
    for index, info in list(metadata.storage_data.items()):
        if index.fqn == fqn:
            grown = length - info.length
            metadata.storage_data[index] = dataclasses.replace(info, length=length)
            break
    else:
        raise KeyError(f"{directory}/.metadata holds no chunk of {fqn!r}")
    forge_metadata(directory, pickle.dumps(metadata))
    if manifest_format.is_parts_format(json.loads(Path(directory, MANIFEST).read_text())):
        _forge_chunk_length_in_part(directory, fqn, length, grown)
        return

    def lie(manifest: dict[str, Any]) -> None:
        chunks = [item for item in manifest["objects"] if item["fqn"] == fqn]
        chunks += [tensor["chunks"][0] for tensor in manifest["tensors"] if tensor["fqn"] == fqn]
        chunks[0]["length"] = length
        for entry in manifest["files"]:
            if entry["path"] == chunks[0]["file"]:
                entry["bytes"] += grown

    forge_manifest(directory, lie)


def _forge_chunk_length_in_part(directory: str, fqn: str, length: int, grown: int) -> None:
    """Format v4: the chunk's record is in rank 0's part; the part's and the manifest's size of the shard file
    grow to match, so only the shard file itself says otherwise."""

    def lie(part: dict[str, Any]) -> None:
        chunk = next(item for item in [*part["chunks"], *part.get("objects", [])] if item["fqn"] == fqn)
        chunk["length"] = length
        part["file_bytes"] += grown

    def grow(manifest: dict[str, Any]) -> None:
        manifest["parts"]["file_bytes"][0] += grown

    forge_part(directory, 0, lie, grow)


def forge_tensor_values(location: Any, directory: str, fqn: str, value: float) -> dict[str, Any]:
    """The issue-39 attack, on any storage (fsspec): replace the first stored chunk of `fqn` (format v4 or v5) with a
    record of the same shape holding `value`, then recompute everything FORMAT.md says vouches for it: the chunk's
    xxh3 checksum (and block checksums), the part's file checksum, the cryptographic digests when it records them
    (v4: the file's; v5: the chunk's and its blocks'), the parts table (v5: the group table, and the manifest's
    record of it) and the commit record. Only a signature, which needs the private key, is left as it was. Returns
    the forged chunk's part record."""
    import io

    import torch

    from lightning_shardckpt.engine.format import groups, parts_manifest, signing
    from lightning_shardckpt.engine.format.checksum import HashingWriter, block_size_for, checksum_of_checksums
    from lightning_shardckpt.engine.format.names import join, shard_filename
    from lightning_shardckpt.engine.storage.writer import save_record

    fs = location.fs
    manifest = json.loads(fs.cat_file(join(directory, MANIFEST)))
    algorithm = manifest.get(signing.DIGEST_FIELD)
    expanded = groups.expanded(fs, directory, manifest)  # v5: the per-rank columns, from the group tables
    dtypes = {tensor["fqn"]: tensor["dtype"] for tensor in manifest["tensors"]}
    for rank in parts_manifest.writing_ranks(expanded):
        part_path = join(directory, part_filename(rank))
        part = digest_column.unpack(json.loads(fs.cat_file(part_path)))
        chunk = next((c for c in part["chunks"] if c["fqn"] == fqn), None)
        if chunk is not None:
            break
    else:
        raise AssertionError(f"no part holds a chunk of {fqn}")
    dtype = getattr(torch, dtypes[fqn].removeprefix("torch."))
    forged = torch.full(chunk["sizes"], value, dtype=dtype)
    buffer = io.BytesIO()
    stream = HashingWriter(buffer, chunk_digest=algorithm if "digest" in chunk else None)
    stream.begin_chunk(block_size_for(forged.numel() * forged.element_size()))  # as the writer does
    save_record(forged, stream)
    _, length, digest = stream.end_chunk()
    record = buffer.getvalue()
    assert length == chunk["length"], f"a record of the same shape has {length} bytes, not {chunk['length']}"
    shard_path = join(directory, shard_filename(rank))
    shard = bytearray(fs.cat_file(shard_path))
    shard[chunk["offset"] : chunk["offset"] + length] = record
    chunk["checksum"] = digest
    if stream.chunk_blocks is not None and "blocks" in chunk:
        chunk["blocks"] = {**chunk["blocks"], "size": stream.chunk_blocks[0], "checksums": list(stream.chunk_blocks[1])}
    if stream.chunk_crypto is not None:  # signed v5: the chunk's own digest (and its blocks')
        chunk["digest"] = stream.chunk_crypto[0]
        if stream.chunk_crypto[1] is not None and "blocks" in chunk:
            chunk["blocks"]["digests"] = list(stream.chunk_crypto[1])
    in_order = sorted(part["chunks"] + part["objects"], key=lambda c: c["offset"])
    part["file_checksum"] = checksum_of_checksums([c["checksum"] for c in in_order])
    if signing.FILE_DIGEST in part:
        part[signing.FILE_DIGEST] = signing.digest_of(bytes(shard), algorithm)
    part_data = part_to_bytes(part)
    _replace(fs, shard_path, bytes(shard))
    _replace(fs, part_path, part_data)
    if groups.is_grouped(manifest):
        _forge_group_entry(fs, directory, manifest, rank, part, part_data, algorithm)
    else:
        _forge_columns(manifest["parts"], rank, part, part_data, algorithm)
    data = manifest_format.to_bytes(manifest)
    _replace(fs, join(directory, MANIFEST), data)
    commit_record = manifest_format.build_commit_record(manifest, data)
    _replace(fs, join(directory, COMMIT_RECORD), manifest_format.to_bytes(commit_record))
    return chunk


def _forge_columns(table: dict[str, Any], index: int, part: dict[str, Any], part_data: bytes, algorithm: Any) -> None:
    """A parts table's (v4: the manifest's; v5: a group table's) entry `index` for the forged part."""
    from lightning_shardckpt.engine.format import signing

    table["part_bytes"][index] = len(part_data)
    table["file_checksums"] = _put(table["file_checksums"], index, part["file_checksum"], 16)
    table["part_checksums"] = _put(table["part_checksums"], index, checksum(part_data), 16)
    if signing.PART_DIGESTS in table:
        table[signing.PART_DIGESTS] = _put(
            table[signing.PART_DIGESTS], index, signing.digest_of(part_data, algorithm), 64
        )


def _forge_group_entry(
    fs: Any, directory: str, manifest: dict[str, Any], rank: int, part: dict[str, Any], part_data: bytes, algorithm: Any
) -> None:
    """v5: the forged part's entry in its group table, the table rewritten, and the manifest's record of it."""
    from lightning_shardckpt.engine.format import groups, signing
    from lightning_shardckpt.engine.format.names import join

    size = manifest["groups"]["size"]
    group = rank // size
    path = join(directory, groups.group_filename(group))
    table = json.loads(fs.cat_file(path))
    old_part_bytes = table["part_bytes"][rank - table["first_rank"]]
    _forge_columns(table, rank - table["first_rank"], part, part_data, algorithm)
    data = groups.to_bytes(table)
    _replace(fs, path, data)
    entry = manifest["groups"]
    entry["bytes"][group] += len(part_data) - old_part_bytes
    entry["table_bytes"][group] = len(data)
    entry["table_checksums"] = _put(entry["table_checksums"], group, checksum(data), 16)
    if groups.TABLE_DIGESTS in entry:
        entry[groups.TABLE_DIGESTS] = _put(entry[groups.TABLE_DIGESTS], group, signing.digest_of(data, algorithm), 64)


def _put(column: str, rank: int, digest: str, width: int) -> str:
    return column[: width * rank] + digest + column[width * (rank + 1) :]


def _replace(fs: Any, path: str, data: bytes) -> None:
    if fs.exists(path):
        fs.rm(path)  # committed files are read-only on a local disk: replaced, as someone with write access would
    fs.pipe_file(path, data)
