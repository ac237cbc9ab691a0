"""Where a committed checkpoint's chunks are, whatever its format: what operator tools and resumes ask.

Format v1-v3 list every chunk in the manifest. Format v4 lists each tensor's layout and each rank's part
(parts.py); a chunk's record (file, byte range, checksum) is in the part of the rank that wrote it. A
`ChunkIndex` answers "the chunks of tensor X" and "every chunk" for both, reading a v4 part only when a
question needs it, each part once, checked against the manifest's checksum before it is parsed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...errors import CorruptCheckpoint, SignatureRefused
from . import chunk_layout, groups, part_references, parts_manifest
from . import manifest as manifest_format
from . import parts as part_format
from .file_digests import DIGEST_FIELD
from .listed_read import read_listed
from .names import join

PART_READ_THREADS = 8  # parts read at once: small objects, so what matters on an object store is the round trips


def read_parts(
    fs: Any,
    directory: str,
    manifest: dict[str, Any],
    ranks: Iterable[int],
    threads: int = PART_READ_THREADS,
    signed_by: str | None = None,
    part_digests: dict[int, str] | None = None,
) -> dict[int, dict[str, Any]]:
    """The parts of `ranks`, read concurrently, each checked against the manifest (size bound, checksum) and
    validated. CorruptCheckpoint names the first part that is missing, too large, altered or invalid.
    `signed_by` (a reader with a signature policy, signed v5: the id of the key whose signature over the manifest
    it accepted): each part is first checked against `part_digests[rank]` (its group table's, GroupTables.
    part_digests), and must digest every chunk; SignatureRefused names the part otherwise."""
    wanted = sorted(set(ranks))
    if not wanted:
        return {}
    expected = {}
    for rank in wanted:
        try:
            expected[rank] = parts_manifest.part_of(manifest, rank)
        except KeyError:
            raise CorruptCheckpoint(
                f"{directory}: the manifest places chunks on rank {rank}, which wrote no part; the manifest is damaged"
            ) from None
    for name, size, _ in expected.values():
        if size > part_format.PART_MAX_BYTES:
            raise CorruptCheckpoint(
                f"{join(directory, name)}: the manifest says {size} bytes, over the {part_format.PART_MAX_BYTES} a part "
                "may hold; the manifest is damaged"
            )

    listed = part_references.listed(manifest)  # an incremental checkpoint's sibling files (FORMAT.md §10.6)

    def read(rank: int) -> tuple[int, dict[str, Any]]:
        name, size, digest = expected[rank]
        path = join(directory, name)
        crypto = None
        if signed_by is not None:
            crypto = (manifest[DIGEST_FIELD], (part_digests or {}).get(rank, parts_manifest.NO_CRYPTO), signed_by)
        data = read_listed(fs, directory, name, size, digest, "part", crypto)
        try:
            part = part_format.parse(data, path, checkpoint_id=manifest["id"], rank=rank)
        except ValueError as err:
            raise CorruptCheckpoint(f"{err}; the checkpoint is damaged, load an older one") from err
        if signed_by is not None and (bare := part_format.undigested(part)) is not None:
            raise SignatureRefused(
                f"{path}: its chunk of {bare} records no cryptographic digest, which a part of a format v5 manifest "
                f"signed (here by key {signed_by[:16]}) holds for every chunk: the part was not written by a signed "
                "save. Resume a checkpoint this writer signed"
            )
        disagreements = parts_manifest.part_entry_problems(manifest, rank, part)
        if disagreements:
            raise CorruptCheckpoint(
                f"{path}: part is invalid: {'; '.join(disagreements)}; the checkpoint is damaged, load an older one",
                problems=[
                    {"file": name, "tensor": None, "expected": "its rank's shard file", "actual": disagreements[0]}
                ],
            )
        if (stray := part_references.unlisted(listed, part)) is not None:
            raise CorruptCheckpoint(
                f"{path}: part is invalid: it references {stray}, a file the manifest's references do not list; "
                "the checkpoint is damaged, load an older one",
                problems=[{"file": name, "tensor": None, "expected": "listed references", "actual": stray}],
            )
        return rank, part

    if len(wanted) == 1:
        return dict([read(wanted[0])])
    with ThreadPoolExecutor(max_workers=min(threads, len(wanted)), thread_name_prefix="shardckpt-parts") as pool:
        return dict(pool.map(read, wanted))


def own_file(chunk: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """A part's chunk record with the file holding its bytes: the part's own shard file, or for an incremental
    checkpoint's referenced chunk the sibling's file it names (`../<dir>/<file>`, FORMAT.md §10.6)."""
    if part_references.is_referenced(chunk):
        return part_references.resolve(chunk, part)
    return {**chunk, "file": part["file"]}


class ChunkIndex:
    """The chunks of one committed checkpoint, as `{fqn, offsets, sizes, file, offset, length, checksum[,
    blocks]}` records (objects without offsets and sizes), from its manifest or from the parts it needs."""

    def __init__(self, fs: Any, directory: str, manifest: dict[str, Any], signed_by: str | None = None) -> None:
        """`signed_by` (a reader with a signature policy, signed v5: the id of the key whose signature over the
        manifest it accepted): every group table and part read is checked against its cryptographic digest first
        (FORMAT.md §12.2)."""
        self.fs, self.directory, self.manifest = fs, directory, manifest
        self.parts_format = manifest_format.is_parts_format(manifest)
        self.signed_by = signed_by
        # v5 not yet expanded (groups.expanded): the group tables of the ranks asked about, read when asked
        self._groups = (
            groups.GroupTables(fs, directory, manifest, signed_by)
            if groups.is_grouped(manifest) and parts_manifest.PARTS_FIELD not in manifest
            else None
        )
        self._parts: dict[int, dict[str, Any]] = {}
        self._tensor_index: dict[int, dict[tuple[str, tuple[int, ...]], dict[str, Any]]] = {}
        self._layouts: dict[str, chunk_layout.Layout] | None = None
        self.parts_read = 0

    @property
    def layouts(self) -> dict[str, chunk_layout.Layout]:
        if self._layouts is None:
            self._layouts = parts_manifest.layouts(self.manifest) if self.parts_format else {}
        return self._layouts

    def parts(self, ranks: Iterable[int]) -> dict[int, dict[str, Any]]:
        """The parts of `ranks` (read once each, then kept)."""
        missing = [rank for rank in set(ranks) if rank not in self._parts]
        if missing:
            digests = self._groups.part_digests(missing) if self._groups is not None and self.signed_by else None
            self._parts.update(
                read_parts(
                    self.fs,
                    self.directory,
                    self._with_parts(missing),
                    missing,
                    signed_by=self.signed_by,
                    part_digests=digests,
                )
            )
            self.parts_read += len(missing)
        return {rank: self._parts[rank] for rank in ranks}

    def parts_held(self) -> dict[int, dict[str, Any]]:
        """Every part read so far, by rank."""
        return dict(self._parts)

    @property
    def tables_read(self) -> int:
        """v5: the group tables read so far."""
        return 0 if self._groups is None else self._groups.tables_read

    def _with_parts(self, ranks: Iterable[int] | None) -> dict[str, Any]:
        """The manifest with a `parts` table holding at least `ranks` (None: every rank): itself, unless v5."""
        if self._groups is None:
            return self.manifest
        return {**self.manifest, parts_manifest.PARTS_FIELD: self._groups.parts_table(ranks)}

    def tensor_chunks(self, fqn: str) -> list[dict[str, Any]]:
        """Every chunk of tensor `fqn`, each with its file; KeyError when the checkpoint has no such tensor. A v4
        layout's empty cells have no record (FORMAT.md §10.1) and are not asked for: they hold nothing."""
        if not self.parts_format:
            for tensor in self.manifest["tensors"]:
                if tensor["fqn"] == fqn:
                    return [{"fqn": fqn, **chunk} for chunk in tensor["chunks"]]
            raise KeyError(fqn)
        layout = self.layouts[fqn]
        shape = next(t["shape"] for t in self.manifest["tensors"] if t["fqn"] == fqn)
        return self.cells_chunks(fqn, list(chunk_layout.stored_cells(layout, shape)))

    def cells_chunks(self, fqn: str, cells: list[chunk_layout.Cell]) -> list[dict[str, Any]]:
        """The records of `cells` of tensor `fqn` (v4), from the parts of the ranks that wrote them."""
        self.parts({cell.rank for cell in cells})
        out = []
        for cell in cells:
            index = self._tensor_index.get(cell.rank)
            if index is None:
                index = self._tensor_index[cell.rank] = part_format.tensor_index(self._parts[cell.rank])
            chunk = index.get((fqn, cell.offsets))
            if chunk is None or tuple(chunk["sizes"]) != cell.sizes:
                raise CorruptCheckpoint(
                    f"{join(self.directory, part_format.part_filename(cell.rank))}: no chunk of {fqn!r} at "
                    f"{list(cell.offsets)} sized {list(cell.sizes)}, which the manifest's layout places there; "
                    "the checkpoint is damaged"
                )
            out.append(own_file(chunk, self._parts[cell.rank]))
        return out

    def object_chunk(self, fqn: str) -> dict[str, Any]:
        """The record of object `fqn`; KeyError when the checkpoint has no such object."""
        if not self.parts_format:
            for item in self.manifest["objects"]:
                if item["fqn"] == fqn:
                    return item
            raise KeyError(fqn)
        rank = next(item["rank"] for item in self.manifest["objects"] if item["fqn"] == fqn)
        part = self.parts([rank])[rank]
        chunk = part_format.object_index(part).get(fqn)
        if chunk is None:
            raise CorruptCheckpoint(
                f"{join(self.directory, part_format.part_filename(rank))}: no object {fqn!r}, which the manifest places "
                "there; the checkpoint is damaged"
            )
        return own_file(chunk, part)

    def all_chunks(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(fqn, record) of every tensor chunk and object, like manifest.iter_chunks (v4: reads every part)."""
        if not self.parts_format:
            yield from manifest_format.iter_chunks(self.manifest)
            return
        for _, part in sorted(self.parts(parts_manifest.writing_ranks(self._with_parts(None))).items()):
            for chunk in part[part_format.TENSOR_CHUNKS]:
                yield chunk["fqn"], own_file(chunk, part)
            for chunk in part[part_format.OBJECTS]:
                yield chunk["fqn"], own_file(chunk, part)

    def expanded(self) -> dict[str, Any]:
        """The manifest in the v2 shape (tensors with their chunks, objects with their bytes, files): for tools
        written against it. O(chunks): reads every part of a v4 checkpoint."""
        if not self.parts_format:
            return self.manifest
        by_tensor: dict[str, list[dict[str, Any]]] = {}
        by_object: dict[str, dict[str, Any]] = {}
        for fqn, chunk in self.all_chunks():
            if "offsets" in chunk:
                by_tensor.setdefault(fqn, []).append(chunk)
            else:
                by_object[fqn] = chunk
        tensors = [{**tensor, "chunks": by_tensor.get(tensor["fqn"], [])} for tensor in self.manifest["tensors"]]
        objects = [{**item, **by_object.get(item["fqn"], {})} for item in self.manifest["objects"]]
        return {
            **self.manifest,
            "tensors": tensors,
            "objects": objects,
            "files": manifest_format.files_of(self._with_parts(None)),
        }
