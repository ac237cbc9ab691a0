"""Copy one committed file from the fast tier to the durable tier, streamed and verified.

No second staging copy: the bytes go from the fast tier's file to the durable tier's upload in
bounded pieces (`PIECE_BYTES`), and each chunk the manifest lists is checksummed as it passes. A
mismatch (the fast copy rotted since its commit) aborts the upload, so a damaged file can never be
committed on the durable tier.
"""

from __future__ import annotations

from typing import Any

from ...errors import CorruptCheckpoint
from ..format import groups, part_references, parts_manifest
from ..format import manifest as manifest_format
from ..format import parts as part_format
from ..format.checksum import ChunkCheck, ChunkHasher
from ..format.chunk_index import read_parts
from ..format.names import DCP_METADATA, join, shard_rank
from ..format.safe_pickle import DCP_METADATA_FIELD
from ..storage import fsio

PIECE_BYTES = 8 * 2**20  # memory bound per upload: one piece in flight


# (offset, length, expected digest[, block size]): a range checked as ChunkCheck says (with a block size: by the
# digest of its block digests, the same for both checksum algorithms); an expected digest of None passes the range
# unchecked (a referenced holder file's bytes no referencing record names: engine/tiers/referenced_files.py)
Range = tuple[int, int, str | None] | tuple[int, int, str | None, int | None]


def chunk_range(chunk: dict[str, Any]) -> Range:
    check = ChunkCheck.of_record(chunk)
    return (chunk["offset"], chunk["length"], check.expected, check.block_size)


def expected_ranges(
    manifest: dict[str, Any], relative: str, parts_at: list[tuple[Any, str]] | tuple = ()
) -> list[Range]:
    """(offset, length, checksum, block size) of every checksummed range of `relative`, in offset order.

    Format v4 lists a shard's chunks in its rank's part, not in the manifest: the part is read from the first of
    `parts_at` ((fs, checkpoint directory) pairs) that holds it, checked against the manifest first. A part itself
    is one range: its whole bytes, whose checksum the manifest holds."""
    if relative == DCP_METADATA:
        meta = manifest.get(DCP_METADATA_FIELD) or {}
        return [(0, meta["bytes"], meta["checksum"], None)] if meta else []
    if manifest_format.is_parts_format(manifest):
        listed = {item["path"]: item for item in manifest_format.files_of(manifest)}
        item = listed.get(relative)
        if item is None:
            return []
        if item["kind"] in (parts_manifest.PART, groups.GROUP_TABLE):  # read whole: the manifest has its checksum
            return [(0, item["bytes"], item["checksum"], None)]
        return _shard_ranges(manifest, relative, parts_at)
    return sorted(
        (chunk_range(chunk) for _, chunk in manifest_format.iter_chunks(manifest) if chunk["file"] == relative),
        key=lambda item: item[0],
    )


def _shard_ranges(manifest: dict[str, Any], relative: str, parts_at: Any) -> list[Range]:
    rank = shard_rank(relative)
    if rank is None:
        raise ValueError(f"{relative} is not a shard file (__<rank>_0.distcp): it has no part to read ranges from")
    problems = []
    for fs, directory in parts_at:
        try:
            part = read_parts(fs, directory, manifest, [rank])[rank]
        except CorruptCheckpoint as err:  # not there (yet), or damaged there: the next place may hold it
            problems.append(str(err))
            continue
        # an incremental part's referenced records lie in a sibling's file (FORMAT.md §10.6), not in this one
        chunks = [
            chunk
            for chunk in part[part_format.TENSOR_CHUNKS] + part[part_format.OBJECTS]
            if not part_references.is_referenced(chunk)
        ]
        return sorted((chunk_range(chunk) for chunk in chunks), key=lambda item: item[0])
    raise CorruptCheckpoint(
        f"{relative}: its part is not readable where it was looked for ({'; '.join(problems) or 'nowhere'}); "
        "refusing to copy an unverifiable file"
    )


def file_size(manifest: dict[str, Any], relative: str) -> int | None:
    if relative == DCP_METADATA:
        return (manifest.get(DCP_METADATA_FIELD) or {}).get("bytes")
    return next((entry["bytes"] for entry in manifest_format.files_of(manifest) if entry["path"] == relative), None)


def listed_size(manifest: dict[str, Any], relative: str) -> int:
    """`file_size` of a file the manifest lists (files_of_rank's): CorruptCheckpoint where it records none."""
    size = file_size(manifest, relative)
    if size is None:
        raise CorruptCheckpoint(f"the manifest lists {relative} without its size: it is not one this package wrote")
    return size


def copy_verified(
    src_fs: Any,
    src_dir: str,
    dst_fs: Any,
    dst_dir: str,
    relative: str,
    manifest: dict[str, Any],
    piece_bytes: int = PIECE_BYTES,
    on_piece: Any = None,
) -> int:
    """Copy `src_dir/relative` to `dst_dir/relative`, checking every listed range; returns the bytes copied.

    Raises CorruptCheckpoint naming the range when the source's bytes do not match the manifest (the
    upload is aborted, nothing is left under the name), OSError when either side fails.
    """
    ranges = expected_ranges(manifest, relative, [(src_fs, src_dir)])
    size = file_size(manifest, relative)
    if size is None or (size and not ranges):  # an incremental rank's shard may hold no byte (all referenced)
        raise CorruptCheckpoint(
            f"{relative}: not listed in the manifest of {src_dir}; refusing to copy an unverifiable file"
        )
    return copy_checked(
        src_fs, join(src_dir, relative), dst_fs, join(dst_dir, relative), ranges, size, piece_bytes, on_piece
    )


def copy_checked(
    src_fs: Any,
    src_path: str,
    dst_fs: Any,
    dst_path: str,
    ranges: list[Range],
    size: int,
    piece_bytes: int = PIECE_BYTES,
    on_piece: Any = None,
) -> int:
    """copy_verified's copy, against `ranges` and `size` the caller found (an incremental checkpoint's referenced
    holder file: the referencing records, engine/tiers/referenced_files.py); returns the bytes copied."""
    check = RangeCheck(src_path, ranges, size)
    with src_fs.open(src_path, "rb") as source:
        sink = dst_fs.open(dst_path, "wb")
        try:
            while True:
                piece = source.read(piece_bytes)
                if not piece:
                    break
                check.feed(piece)
                sink.write(piece)
                if on_piece is not None:
                    on_piece()  # tests: a rank dying mid-upload
            check.finish()
            fsio.sync_local_file(sink)
            sink.close()
        except BaseException:
            fsio.abort_write(sink)  # never commit a partial or damaged object
            raise
    return check.position


class RangeCheck:
    """The manifest's checksums of one file, checked as its bytes stream past in pieces of any size."""

    def __init__(self, label: str, ranges: list[Range], size: int) -> None:
        self.label, self.ranges, self.size = label, ranges, size
        self.position, self._index = 0, 0
        self._hasher = ChunkHasher(self._block_size(0))

    def _block_size(self, index: int) -> int | None:
        item = self.ranges[index] if index < len(self.ranges) else None
        return item[3] if item is not None and len(item) > 3 else None

    def feed(self, piece: bytes | memoryview) -> None:
        """Raises CorruptCheckpoint naming the range as soon as a range's bytes do not match."""
        view = memoryview(piece)
        start = 0
        while start < len(view):
            if self._index >= len(self.ranges):
                raise CorruptCheckpoint(f"{self.label}: longer than the {self.size} bytes its manifest lists")
            offset, length, expected = self.ranges[self._index][:3]
            end = offset + length
            take = min(len(view) - start, end - (self.position + start))
            if expected is not None:
                self._hasher.update(view[start : start + take])
            start += take
            if self.position + start == end:
                actual = self._hasher.hexdigest() if expected is not None else None
                if actual != expected:
                    raise CorruptCheckpoint(
                        f"{self.label}: bytes {offset}..{end} have checksum {actual}, the manifest says {expected}; "
                        "the fast-tier copy is damaged and will not be replicated",
                        problems=[{"file": self.label, "offset": offset, "expected": expected, "actual": actual}],
                    )
                self._index += 1
                self._hasher.reset(self._block_size(self._index))
        self.position += len(view)

    def finish(self) -> None:
        if self.position != self.size or self._index != len(self.ranges):
            raise CorruptCheckpoint(
                f"{self.label}: {self.position} bytes, its manifest lists {self.size}; the fast-tier copy is truncated"
            )
