"""Full verification of a committed checkpoint: every byte the manifest lists is read and checksummed.

Loading checks only the chunks a rank reads; this pass checks all of them, plus what a load trusts
without reading: file sizes, chunks tiling each file, and DCP's `.metadata` agreeing with the manifest.
It reports every problem it finds instead of stopping at the first, so one run names every bad file
and tensor.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..engine.catalog import CheckpointEntry
from ..engine.format import chunk_layout, groups, parts_manifest, safe_pickle, signing
from ..engine.format import manifest as manifest_format
from ..engine.format import parts as part_format
from ..engine.format.checksum import ChunkCheck, checksum_of_checksums
from ..engine.format.chunk_index import own_file, read_parts
from ..engine.format.names import DCP_METADATA, join, shard_filename
from ..engine.format.references import REFERENCES_FIELD, is_reference
from ..engine.format.safe_pickle import DCP_METADATA_FIELD
from ..engine.root import open_reference
from ..engine.storage import fsio
from ..engine.storage.fsio import Location
from ..errors import CheckpointNotFound, CorruptCheckpoint
from .progress import progress

log = logging.getLogger(__name__)

# Problem kinds: what a problem's `expected` and `actual` describe.
MISSING_FILE = "missing_file"  # a file the manifest lists is absent (bytes: expected size, actual None)
FILE_SIZE = "file_size"  # stored size differs from the manifest (sizes)
TILING = "tiling"  # the manifest's chunks do not cover the file exactly once (byte positions)
CHUNK_CHECKSUM = "chunk_checksum"  # a chunk differs from its checksum (checksums; "<k of n bytes>", "<file missing>")
FILE_CHECKSUM = "file_checksum"  # digest of the file's chunk digests differs (checksums)
OUTSIDE = "outside"  # a listed file's name or symlink leads out of the checkpoint directory (never read)
DCP_METADATA_PROBLEM = "dcp_metadata"  # `.metadata` missing, unreadable or disagreeing with the manifest
PART_PROBLEM = "part"  # v4: a part missing, altered since commit, invalid, or disagreeing with the manifest
LAYOUT_PROBLEM = "layout"  # v4: a chunk the manifest's layout names is in no part, or a part holds one it does not
SIGNATURE_PROBLEM = "signature"  # with public keys: unsigned, signed by no accepted key, or a file unlike its digest


@dataclass
class VerifyReport:
    """The outcome of one full pass; `problems` is empty when every byte matched."""

    path: str
    checkpoint_id: str
    step: int
    files: int = 0
    chunks: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    # Each problem: kind, file, tensor (fqn, None for file-level problems), expected, actual.
    problems: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def verify_checkpoint(
    where: str | os.PathLike[str] | Location,
    which: str | int | CheckpointEntry = "latest",
    storage_options: dict[str, Any] | None = None,
    *,
    progress_bar: bool | None = None,
    public_keys: list[Any] | tuple[Any, ...] = (),
    revoked_keys: list[str] | tuple[str, ...] = (),
) -> VerifyReport:
    """Read and checksum every chunk of a committed checkpoint.

    `where` is a root URL (with `which`: `latest`, a step, an id or a directory name), a checkpoint
    directory URL, or a root Location; `which` may also be a CheckpointEntry already found under it.
    Raises CheckpointNotFound when nothing committed matches; corruption is reported, not raised.
    `progress_bar`: bytes read so far on stderr (None: when stderr is a terminal). `public_keys` (PEM files): also
    require a signature by one of them and every file's SHA-256 to match the signed digests (one more read);
    windows and `revoked_keys` as LoadConfig's.
    """
    policy = signing.policy_of(bool(public_keys), public_keys, revoked_keys)
    location, entry = _open(where, which, storage_options)
    started = time.perf_counter()
    report = VerifyReport(join(location.url, entry.name), entry.checkpoint_id, entry.step)
    if policy is not None:
        _verify_signature(location, entry, policy, report)
    manifest = entry.committed_manifest
    if groups.is_grouped(manifest):  # v5: the parts' sizes and checksums are in the group tables, read first
        try:
            manifest = groups.expanded(location.fs, entry.path, manifest)
        except CorruptCheckpoint as err:
            table = (err.problems or [{}])[0].get("file") or groups.GROUPS_FIELD
            report.problems.append(_problem(PART_PROBLEM, table, None, "the group table the manifest lists", str(err)))
            report.seconds = time.perf_counter() - started
            return report
    chunks_by_file: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    if manifest_format.is_parts_format(manifest):  # v4: the chunks are in the parts, each checked first
        listed = _chunks_from_parts(location.fs, entry.path, manifest, chunks_by_file, report)
    else:
        for fqn, chunk in manifest_format.iter_chunks(manifest):
            chunks_by_file.setdefault(chunk["file"], []).append((fqn, chunk))
        listed = {item["path"]: item for item in manifest["files"]}
    if manifest_format.is_parts_format(manifest):  # v4/v5: the parts' references, each listed (read_parts checked)
        referenced = {relative for relative in chunks_by_file if is_reference(relative)}
    else:
        referenced = {item["path"] for item in manifest.get(REFERENCES_FIELD) or []}
    for relative in sorted(referenced & set(chunks_by_file)):
        # incremental: bytes held by a sibling checkpoint, checked against this manifest's checksums
        chunks = sorted(chunks_by_file[relative], key=lambda pair: pair[1]["offset"])
        report.chunks += len(chunks)
        _verify_referenced(location.fs, entry.path, relative, chunks, report)
    for relative in sorted(set(chunks_by_file) - set(listed) - referenced):
        report.problems.append(_problem(TILING, relative, None, "an entry in the manifest's files", "none"))
    with progress(sum(item["bytes"] for item in listed.values()), "verify", wanted=progress_bar) as bar:
        for relative, item in sorted(listed.items()):
            chunks = sorted(chunks_by_file.get(relative, []), key=lambda pair: pair[1]["offset"])
            report.files += 1
            report.chunks += len(chunks)
            _verify_file(location.fs, entry.path, item, chunks, report)
            bar.update(item["bytes"])
    recorded = manifest.get(DCP_METADATA_FIELD)
    if recorded is not None or not manifest_format.is_parts_format(manifest):  # v4 writes it when small
        _verify_dcp_metadata(location.fs, entry.path, chunks_by_file, report, recorded)
    report.seconds = time.perf_counter() - started
    if report.ok:
        log.info(
            "verified %s: %d files, %d chunks, %d bytes in %.2fs",
            report.path,
            report.files,
            report.chunks,
            report.bytes_read,
            report.seconds,
        )
    else:
        # reported, not raised: the caller decides (the CLI prints every problem, a drill records them)
        log.info("verify %s: %d problem(s), first: %s", report.path, len(report.problems), report.problems[0])
    return report


def _chunks_from_parts(
    fs: Any,
    directory: str,
    manifest: dict[str, Any],
    chunks_by_file: dict[str, list[tuple[str, dict[str, Any]]]],
    report: VerifyReport,
) -> dict[str, dict[str, Any]]:
    """Format v4: read every part (checked against the manifest), fill `chunks_by_file` from them, and check that
    the parts hold exactly the chunks the layouts name; returns the shard files to verify, as `files` entries."""
    listed: dict[str, dict[str, Any]] = {}
    table = manifest[parts_manifest.PARTS_FIELD]
    found: set[tuple[Any, ...]] = set()
    readable: set[int] = set()
    for rank in parts_manifest.writing_ranks(manifest):
        name, size, digest = parts_manifest.part_of(manifest, rank)
        report.files += 1
        try:
            part = read_parts(fs, directory, manifest, [rank])[rank]
        except CorruptCheckpoint as err:
            report.problems.append(_problem(PART_PROBLEM, name, None, f"{size} bytes, checksum {digest}", str(err)))
            continue
        readable.add(rank)
        shard = shard_filename(rank)
        listed[shard] = {
            "path": shard,
            "bytes": table[parts_manifest.FILE_BYTES][rank],
            "checksum": parts_manifest.digest_at(table, parts_manifest.FILE_CHECKSUMS, rank),
        }
        if (part["file"], part["file_bytes"], part["file_checksum"]) != (
            shard,
            listed[shard]["bytes"],
            listed[shard]["checksum"],
        ):
            report.problems.append(
                _problem(
                    PART_PROBLEM,
                    name,
                    None,
                    f"{shard}, {listed[shard]['bytes']} bytes, checksum {listed[shard]['checksum']}",
                    f"{part['file']}, {part['file_bytes']} bytes, checksum {part['file_checksum']}",
                )
            )
        chunks_by_file.setdefault(shard, [])
        for chunk in part[part_format.TENSOR_CHUNKS]:
            record = own_file(chunk, part)  # incremental: a referenced chunk names its sibling's file (§10.6)
            chunks_by_file.setdefault(record["file"], []).append((chunk["fqn"], record))
            found.add((chunk["fqn"], tuple(chunk["offsets"]), tuple(chunk["sizes"]), rank))
        for chunk in part[part_format.OBJECTS]:
            chunks_by_file[shard].append((chunk["fqn"], {**chunk, "file": shard}))
            found.add((chunk["fqn"], rank))
    expected: set[tuple[Any, ...]] = {(item["fqn"], item["rank"]) for item in manifest["objects"]}
    empty: set[tuple[Any, ...]] = set()  # cells holding no element: no record needed, one tolerated (older writers)
    for tensor in manifest["tensors"]:
        layout = chunk_layout.from_json(tensor[parts_manifest.LAYOUT_FIELD])
        for c in chunk_layout.cells(layout, tensor["shape"]):
            held = expected if chunk_layout.holds_elements(c.sizes) else empty
            held.add((tensor["fqn"], c.offsets, c.sizes, c.rank))
    for key in sorted(expected - found, key=repr):
        if key[-1] in readable:  # an unreadable part is reported once, above
            report.problems.append(
                _problem(LAYOUT_PROBLEM, part_format.part_filename(key[-1]), key[0], f"a chunk at {key[1:-1]}", "none")
            )
    for key in sorted(found - expected - empty, key=repr):
        report.problems.append(
            _problem(
                LAYOUT_PROBLEM, part_format.part_filename(key[-1]), key[0], "no such chunk", f"a chunk at {key[1:-1]}"
            )
        )
    return listed


def _verify_signature(
    location: Location, entry: CheckpointEntry, policy: signing.SignaturePolicy, report: VerifyReport
) -> None:
    """The manifest's signature, then every part and shard file against the signed digests: one problem, the
    first refusal, naming the file and the key."""
    try:
        kid = policy.check_manifest(location.fs, entry.path, entry.committed_manifest)
        report.bytes_read += policy.check_every_file(location.fs, entry.path, entry.committed_manifest, kid)
    except signing.SignatureRefused as err:
        where = str(err).split(": ", 1)[0].rsplit("/", 1)[-1]
        accepted = ", ".join(kid[:16] for kid in sorted(policy.keys))
        report.problems.append(_problem(SIGNATURE_PROBLEM, where, None, f"signed by key {accepted}", str(err)))


def _open(where: Any, which: Any, storage_options: dict[str, Any] | None) -> tuple[Location, CheckpointEntry]:
    if isinstance(which, CheckpointEntry):
        if not which.committed:
            raise CheckpointNotFound(f"{which.path} is {which.state}, not committed; only committed checkpoints verify")
        return (where if isinstance(where, Location) else fsio.resolve(where, storage_options)), which
    return open_reference(which, where, storage_options)  # `where` a root, a checkpoint directory or ROOT/latest


def _verify_file(
    fs: Any, directory: str, item: dict[str, Any], chunks: list[tuple[str, dict[str, Any]]], report: VerifyReport
) -> None:
    """Size, tiling, every chunk's checksum and the file checksum of one file the manifest lists."""
    relative, expected_bytes = item["path"], item["bytes"]
    report.problems.extend(_tiling_problems(relative, expected_bytes, [chunk for _, chunk in chunks]))
    path = join(directory, relative)
    try:
        safe_pickle.check_inside(fs, directory, relative)  # a name or symlink leading out is never read
    except CorruptCheckpoint:
        report.problems.append(_problem(OUTSIDE, relative, None, "a file inside the checkpoint directory", path))
        return
    try:
        actual_bytes = fs.size(path)
    except FileNotFoundError:
        report.problems.append(_problem(MISSING_FILE, relative, None, expected_bytes, None))
        # every tensor stored there is lost: name each, so the report says what a load would miss
        for fqn, chunk in chunks:
            report.problems.append(_problem(CHUNK_CHECKSUM, relative, fqn, chunk["checksum"], "<file missing>"))
        return
    if actual_bytes != expected_bytes:
        report.problems.append(_problem(FILE_SIZE, relative, None, expected_bytes, actual_bytes))
    digests = []
    # one handle per file, chunks in offset order: a sequential read, not a request per chunk
    with fs.open(path, "rb") as handle:
        for fqn, chunk in chunks:
            handle.seek(chunk["offset"])
            data = handle.read(chunk["length"])
            report.bytes_read += len(data)
            check = ChunkCheck.of_record(chunk)  # by its block digests when it has them (both algorithms)
            actual = check.actual(data)
            # the file checksum is made of the recorded chunk checksums: a chunk whose bytes passed stands for its
            # record's (an xxh3_64 checkpoint's blocked chunk is checked by blocks, its checksum is of the bytes)
            digests.append(chunk["checksum"] if actual == check.expected else actual)
            if len(data) != chunk["length"]:
                actual = f"<{len(data)} of {chunk['length']} bytes>"
            if actual != check.expected:
                report.problems.append(_problem(CHUNK_CHECKSUM, relative, fqn, check.expected, actual))
    file_digest = checksum_of_checksums(digests)
    if file_digest != item["checksum"]:
        report.problems.append(_problem(FILE_CHECKSUM, relative, None, item["checksum"], file_digest))


def _verify_referenced(
    fs: Any, directory: str, relative: str, chunks: list[tuple[str, dict[str, Any]]], report: VerifyReport
) -> None:
    """Every chunk an incremental checkpoint references: its bytes in the sibling's file, against this
    manifest's checksums (the holder may be deleted or damaged independently of this checkpoint)."""
    path = join(directory, relative)
    try:
        safe_pickle.check_inside(fs, directory, relative)  # only a sibling checkpoint of the same root
    except CorruptCheckpoint:
        report.problems.append(_problem(OUTSIDE, relative, None, "a file of a sibling checkpoint", path))
        return
    try:
        handle = fs.open(path, "rb")
    except FileNotFoundError:
        report.problems.append(_problem(MISSING_FILE, relative, None, "present (referenced)", None))
        for fqn, chunk in chunks:
            report.problems.append(_problem(CHUNK_CHECKSUM, relative, fqn, chunk["checksum"], "<file missing>"))
        return
    with handle:
        for fqn, chunk in chunks:
            handle.seek(chunk["offset"])
            data = handle.read(chunk["length"])
            report.bytes_read += len(data)
            check = ChunkCheck.of_record(chunk)
            actual = check.actual(data) if len(data) == chunk["length"] else f"<{len(data)} of {chunk['length']} bytes>"
            if actual != check.expected:
                report.problems.append(_problem(CHUNK_CHECKSUM, relative, fqn, check.expected, actual))


def _tiling_problems(relative: str, file_bytes: int, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    position = 0
    for chunk in chunks:
        if chunk["offset"] != position:
            return [
                _problem(TILING, relative, None, f"a chunk at byte {position}", f"the next at byte {chunk['offset']}")
            ]
        position += chunk["length"]
    if position != file_bytes:
        return [_problem(TILING, relative, None, f"chunks covering {file_bytes} bytes", f"{position} bytes covered")]
    return []


def _verify_dcp_metadata(
    fs: Any,
    directory: str,
    chunks_by_file: dict[str, list[tuple[str, dict[str, Any]]]],
    report: VerifyReport,
    recorded: dict[str, Any] | None,
) -> None:
    """DCP's `.metadata` must exist, match its recorded checksum (v2), unpickle through the allow-list
    (never running code from the checkpoint), and point at exactly the chunks the manifest lists."""
    try:
        with fs.open(join(directory, DCP_METADATA), "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        report.problems.append(_problem(DCP_METADATA_PROBLEM, DCP_METADATA, None, "present", "missing"))
        return
    altered = False
    try:
        if recorded is not None:  # v2: other bytes than committed; v1 recorded nothing to compare
            safe_pickle.check_metadata_bytes(data, directory, recorded)
    except CorruptCheckpoint as err:  # a load refuses it; still read on below (safely) to name what differs
        _metadata_problem(err, report)
        altered = True
    try:
        metadata = safe_pickle.load_dcp_metadata(data, directory)  # the allow-list: unpickling runs nothing
    except CorruptCheckpoint as err:  # a blocked class, not Metadata, a path outside: a load cannot start
        if not altered or err.problems:  # altered bytes that do not even unpickle: one problem, already reported
            _metadata_problem(err, report)
        return
    listed = {(c["file"], c["offset"]): (fqn, c["length"]) for chunks in chunks_by_file.values() for fqn, c in chunks}
    pointed = set()
    for index, info in metadata.storage_data.items():
        where = (info.relative_path, info.offset)
        pointed.add(where)
        if listed.get(where) != (index.fqn, info.length):
            found = listed.get(where)
            report.problems.append(
                _problem(
                    DCP_METADATA_PROBLEM,
                    DCP_METADATA,
                    index.fqn,
                    f"{index.fqn} at {where[0]}@{where[1]}+{info.length}",
                    f"{found[0]} at {where[0]}@{where[1]}+{found[1]}" if found else "no manifest chunk there",
                )
            )
    for where in sorted(set(listed) - pointed):
        expected = f"an entry for {where[0]}@{where[1]}"
        report.problems.append(_problem(DCP_METADATA_PROBLEM, DCP_METADATA, listed[where][0], expected, "none"))


def _metadata_problem(err: CorruptCheckpoint, report: VerifyReport) -> None:
    found = err.problems[0] if err.problems else {}
    expected = found.get("expected", "a pickled DCP Metadata")
    actual = found.get("actual") or " ".join(str(err).split())
    report.problems.append(_problem(DCP_METADATA_PROBLEM, DCP_METADATA, found.get("tensor"), expected, actual))


def _problem(kind: str, file: str, tensor: str | None, expected: Any, actual: Any) -> dict[str, Any]:
    return {"kind": kind, "file": file, "tensor": tensor, "expected": expected, "actual": actual}
