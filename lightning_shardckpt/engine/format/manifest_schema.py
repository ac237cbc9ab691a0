"""Type and value rules for a manifest and a commit record (docs/FORMAT.md §5–6), as lists of problems.

Presence alone is not enough: a step-100 directory copied under the name `step-000000900-…` still
has every field, and would be listed as step 900. Each check returns readable problems; the caller
turns them into one CorruptCheckpoint for that checkpoint only.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, TypeGuard

from .names import LEGACY_CHECKSUM_ALGORITHM, READABLE_CHECKSUM_ALGORITHMS, DirName, parse_dirname
from .outcomes import metrics_problems

HEX_DIGEST = re.compile(r"^[0-9a-f]{16}$")  # xxh3_64, 16 lowercase hex characters (FORMAT.md §3)
MAX_PROBLEMS = 5  # a broken tensor table would otherwise produce thousands of lines
BLOCKS_FIELD = "blocks"  # optional on a tensor chunk: {"size": bytes, "checksums": [one per block]} (FORMAT.md §3)


def is_int(value: Any) -> TypeGuard[int]:
    """An int that is not a bool (JSON's true is no count); narrows `value` to int for the checks after it."""
    return isinstance(value, int) and not isinstance(value, bool)


def parse_time(value: Any) -> datetime | None:
    """An ISO 8601 time with a timezone, or None when `value` is not one."""
    if not isinstance(value, str):
        return None
    try:
        stamp = datetime.fromisoformat(value)
    except ValueError:
        return None
    return stamp if stamp.tzinfo is not None else None


def identity_problems(document: dict[str, Any], dirname: DirName | None) -> list[str]:
    """id, step, created_at, parent, run_id and seq: the fields a listing orders and matches by."""
    problems = []
    checkpoint_id, step = document.get("id"), document.get("step")
    if not isinstance(checkpoint_id, str):
        problems.append(f"id is {checkpoint_id!r}, not a string")
    elif dirname is not None and checkpoint_id != dirname.checkpoint_id:
        problems.append(
            f"id {checkpoint_id!r} does not match the directory name's id {dirname.checkpoint_id!r} "
            "(a checkpoint copied or renamed?)"
        )
    if not is_int(step) or step < 0:
        problems.append(f"step is {step!r}, not an integer >= 0")
    elif dirname is not None and step != dirname.step:
        problems.append(
            f"step {step} does not match the directory name's step {dirname.step} (a checkpoint copied or renamed?)"
        )
    if parse_time(document.get("created_at")) is None:
        problems.append(f"created_at {document.get('created_at')!r} is not an ISO 8601 time with a timezone")
    for name in ("parent", "run_id"):
        if document.get(name) is not None and not isinstance(document.get(name), str):
            problems.append(f"{name} is {document.get(name)!r}, not a string or null")
    seq = document.get("seq")
    if seq is not None and (not is_int(seq) or seq < 1):
        problems.append(f"seq is {seq!r}, not an integer >= 1")
    return problems


def common_problems(manifest: dict[str, Any], dirname: DirName | None) -> list[str]:
    """The rules every format version shares: the fields a listing orders by, and the small typed blocks."""
    problems = identity_problems(manifest, dirname)
    if manifest["format_version"] >= 2 and manifest.get("seq") is None:
        problems.append("seq is missing (required from format v2)")
    if not isinstance(manifest.get("topology"), dict):
        problems.append("topology is not an object")
    algorithm = manifest.get("checksum_algorithm", LEGACY_CHECKSUM_ALGORITHM)
    if (
        algorithm not in READABLE_CHECKSUM_ALGORITHMS
    ):  # its digests cannot be checked: nothing read could be vouched for
        problems.append(
            f"checksum_algorithm {algorithm!r} is not one this reader checks ({', '.join(READABLE_CHECKSUM_ALGORITHMS)})"
        )
    for name in ("identity", "verification", "writer", "extra"):
        if manifest.get(name) is not None and not isinstance(manifest[name], dict):
            problems.append(f"{name} is not an object")
    if isinstance(manifest.get("extra"), dict):
        problems.extend(metrics_problems(manifest["extra"]))
    identity = manifest.get("identity")
    if isinstance(identity, dict):
        problems.extend(
            f"identity.{block} is not an object or null"
            for block, value in identity.items()
            if value is not None and not isinstance(value, dict)
        )
    return problems


def manifest_problems(manifest: dict[str, Any], dirname: DirName | None) -> list[str]:
    """Every rule of FORMAT.md §5 a reader relies on (v1-v3); empty when the manifest is sound. Format v4's
    tables are checked by parts_manifest.table_problems, after these common rules (manifest.problems)."""
    problems = common_problems(manifest, dirname)
    files = manifest.get("files")
    names: set[str] = set()
    if not isinstance(files, list):
        problems.append("files is not a list")
    else:
        for index, item in enumerate(files):
            problems.extend(f"files[{index}]: {p}" for p in _file_problems(item))
            if isinstance(item, dict) and isinstance(item.get("path"), str):
                names.add(item["path"])
    problems.extend(_references_problems(manifest, names))
    for table in ("tensors", "objects"):
        if not isinstance(manifest.get(table), list):
            problems.append(f"{table} is not a list")
    if isinstance(manifest.get("tensors"), list):
        for index, tensor in enumerate(manifest["tensors"]):
            problems.extend(f"tensors[{index}]: {p}" for p in _tensor_problems(tensor, names))
            if len(problems) > MAX_PROBLEMS:
                break
    if isinstance(manifest.get("objects"), list):
        for index, item in enumerate(manifest["objects"]):
            problems.extend(
                f"objects[{index}]: {p}"
                for p in _chunk_problems(item, names - _referenced(manifest), tensor_chunk=False)
            )
            if len(problems) > MAX_PROBLEMS:
                break
    return problems


REFERENCES_FIELD = "references"  # manifest v3: [{"path": "../<dir>/<file>", "bytes": referenced bytes, "chunks": n}]
REFERENCE_PREFIX = "../"  # a reference is `../<sibling checkpoint directory>/<file>` (FORMAT.md §9, references.py)


def is_reference(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(REFERENCE_PREFIX)


def split_reference(path: str) -> tuple[str, str] | None:
    """(sibling directory, file) of a well-formed reference, or None for anything else."""
    if not is_reference(path):
        return None
    parts = path[len(REFERENCE_PREFIX) :].split("/")
    if len(parts) != 2 or parse_dirname(parts[0]) is None or parts[0] != parts[0].strip() or not parts[1]:
        return None
    if parts[1] in (".", "..") or "\\" in path or ":" in parts[1]:
        return None
    return parts[0], parts[1]


def reference_problem(path: Any) -> str | None:
    """Why `path` is not an acceptable reference (None when it is one)."""
    if split_reference(path) is None:
        return (
            f"path {path!r}, outside the checkpoint directory and not '../<sibling checkpoint directory>/<file>' "
            "(a reference may name only a file of a sibling checkpoint of the same root)"
        )
    return None


def _referenced(manifest: dict[str, Any]) -> set[str]:
    items = manifest.get(REFERENCES_FIELD)
    return (
        {item["path"] for item in items if isinstance(item, dict) and isinstance(item.get("path"), str)}
        if isinstance(items, list)
        else set()
    )


def _references_problems(manifest: dict[str, Any], names: set[str]) -> list[str]:
    """v3: each reference names one file of a sibling checkpoint ('../<dir>/<file>'), never a reference
    (a chain) and never anything outside the root; adds the referenced paths to `names`."""
    if REFERENCES_FIELD not in manifest:
        return []
    items = manifest[REFERENCES_FIELD]
    if manifest["format_version"] < 3:
        return [
            f"{REFERENCES_FIELD} is present in a format v{manifest['format_version']} manifest (references need v3)"
        ]
    if not isinstance(items, list):
        return [f"{REFERENCES_FIELD} is not a list"]
    problems = []
    own_dir = manifest.get("id")
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            problems.append(f"{REFERENCES_FIELD}[{index}]: {item!r} is not an object")
            continue
        path_problem = reference_problem(item.get("path"))
        if path_problem:
            problems.append(f"{REFERENCES_FIELD}[{index}]: {path_problem}")
            continue
        if isinstance(own_dir, str) and item["path"].split("/")[1].endswith(f"-{own_dir}"):
            problems.append(f"{REFERENCES_FIELD}[{index}]: {item['path']!r} references the checkpoint itself")
            continue
        if not is_int(item.get("bytes")) or item["bytes"] < 0:
            problems.append(f"{REFERENCES_FIELD}[{index}]: bytes is {item.get('bytes')!r}, not an integer >= 0")
        names.add(item["path"])
    return problems


def record_problems(record: dict[str, Any], dirname: DirName | None) -> list[str]:
    """The commit record (FORMAT.md §5.1): what a listing needs, typed and matching the directory name."""
    problems = identity_problems(record, dirname)
    if not is_int(record.get("seq")):
        problems.append("seq is missing")
    if not is_int(record.get("bytes_total")) or record["bytes_total"] < 0:
        problems.append(f"bytes_total is {record.get('bytes_total')!r}, not an integer >= 0")
    if not isinstance(record.get("manifest_checksum"), str) or not HEX_DIGEST.match(record["manifest_checksum"]):
        problems.append(f"manifest_checksum is {record.get('manifest_checksum')!r}, not 16 lowercase hex characters")
    if "summary" in record:  # v4: what a timeline shows, so that it reads no manifest
        problems.extend(_summary_problems(record["summary"]))
    return problems


def _summary_problems(summary: Any) -> list[str]:
    if not isinstance(summary, dict):
        return [f"summary is {summary!r}, not an object"]
    problems = [
        f"summary.{name} is not an object"
        for name in ("topology", "verification", "extra", "identity_digests")
        if summary.get(name) is not None and not isinstance(summary[name], dict)
    ]
    digests = summary.get("identity_digests")
    if isinstance(digests, dict):
        problems.extend(
            f"summary.identity_digests.{block} is {value!r}, not a digest or null"
            for block, value in digests.items()
            if value is not None and not _is_digest(value)
        )
    if isinstance(summary.get("extra"), dict):
        problems.extend(f"summary.{problem}" for problem in metrics_problems(summary["extra"]))
    return problems


def relative_path_problem(path: Any) -> str | None:
    """A file name inside the checkpoint directory: relative, no `..`, no backslash, not empty."""
    if not isinstance(path, str) or not path:
        return f"path {path!r} is not a non-empty string"
    parts = path.split("/")
    if path.startswith("/") or "\\" in path or ":" in parts[0] or any(part in ("", ".", "..") for part in parts):
        return f"path {path!r} is not a relative path inside the checkpoint directory"
    return None


def _file_problems(item: Any) -> list[str]:
    if not isinstance(item, dict):
        return [f"{item!r} is not an object"]
    problems = []
    path_problem = relative_path_problem(item.get("path"))
    if path_problem:
        problems.append(path_problem)
    if not is_int(item.get("bytes")) or item["bytes"] < 0:
        problems.append(f"bytes is {item.get('bytes')!r}, not an integer >= 0")
    if not _is_digest(item.get("checksum")):
        problems.append(f"checksum {item.get('checksum')!r} is not 16 lowercase hex characters")
    return problems


def _tensor_problems(tensor: Any, files: set[str]) -> list[str]:
    if not isinstance(tensor, dict):
        return [f"{tensor!r} is not an object"]
    problems = []
    if not isinstance(tensor.get("fqn"), str):
        problems.append(f"fqn is {tensor.get('fqn')!r}, not a string")
    if not _int_list(tensor.get("shape")):
        problems.append(f"shape {tensor.get('shape')!r} is not a list of integers >= 0")
    if not isinstance(tensor.get("dtype"), str):
        problems.append(f"dtype is {tensor.get('dtype')!r}, not a string")
    if "finite" in tensor and not isinstance(tensor["finite"], bool):
        problems.append(f"finite is {tensor['finite']!r}, not true or false")
    chunks = tensor.get("chunks")
    if not isinstance(chunks, list):
        return [*problems, "chunks is not a list"]
    for index, chunk in enumerate(chunks):
        problems.extend(f"chunks[{index}]: {p}" for p in _chunk_problems(chunk, files, tensor_chunk=True))
    if not problems:  # shape, offsets and sizes are lists of ints: whether they tile can be asked
        problems.extend(
            f"{tensor['fqn']}: {p} (its chunks must cover every element exactly once)"
            for p in tiling_problems(tensor["shape"], chunks)
        )
    return problems


MAX_TILING_CELLS = 100_000  # past this many grid cells, a broken tiling is reported by element counts alone


def tiling_problems(shape: list[int], chunks: list[dict[str, Any]]) -> list[str]:
    """Chunks must tile the tensor: every element in exactly one chunk. A reader allocates the tensor and
    fills it chunk by chunk, so a gap would hand out uninitialised memory and an overlap two values for one
    element. Empty when they tile; else each overlap and gap, as `[start:stop, ...]` boxes."""
    boxes = []
    for index, chunk in enumerate(chunks):
        offsets, sizes = chunk["offsets"], chunk["sizes"]
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return [f"chunks[{index}] has {len(offsets)} offsets and {len(sizes)} sizes for a {len(shape)}-d shape"]
        box = tuple(zip(offsets, (o + s for o, s in zip(offsets, sizes))))
        if any(stop > dim for (_, stop), dim in zip(box, shape)):
            return [f"chunks[{index}] {_box_text(box)} lies outside the shape {shape}"]
        boxes.append((index, box))
    problems = [
        f"chunks[{a}] and chunks[{b}] overlap at {_box_text(common)}" for a, b, common in _overlaps(boxes, len(shape))
    ]
    covered = sum(_volume(box) for _, box in boxes)
    if problems or covered != _volume(tuple((0, dim) for dim in shape)):
        gaps = _gaps(shape, [box for _, box in boxes])
        problems.extend(f"{_box_text(gap)} is in no chunk" for gap in gaps)
        if not problems:  # too many chunks to walk the grid: the counts still tell
            problems.append(
                f"the chunks hold {covered} elements, the shape {shape} has {_volume(tuple((0, d) for d in shape))}"
            )
    return problems[:MAX_PROBLEMS]


Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension


def _volume(box: Box) -> int:
    count = 1
    for start, stop in box:
        count *= max(stop - start, 0)
    return count


def _intersection(a: Box, b: Box) -> Box:
    return tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))


def _overlaps(boxes: list[tuple[int, Box]], ndim: int) -> list[tuple[int, int, Box]]:
    """Pairs of boxes sharing an element: a sweep along the dimension where the boxes start at the most
    places, so the usual shardings (rows, or columns) compare each chunk with its neighbours only."""
    found: list[tuple[int, int, Box]] = []
    solid = [(index, box) for index, box in boxes if _volume(box) > 0]
    if ndim == 0:
        empty: Box = ()  # a 0-d tensor's box: its one element
        return [(a, b, empty) for (a, _), (b, _) in zip(solid, solid[1:])][:1] if len(solid) > 1 else []
    axis = max(range(ndim), key=lambda d: len({box[d][0] for _, box in solid}))
    active: list[tuple[int, Box]] = []
    for index, box in sorted(solid, key=lambda item: item[1][axis]):
        active = [item for item in active if item[1][axis][1] > box[axis][0]]
        for other, other_box in active:
            common = _intersection(other_box, box)
            if _volume(common) > 0:
                found.append((min(other, index), max(other, index), common))
                if len(found) >= MAX_PROBLEMS:
                    return sorted(found)
        active.append((index, box))
    return sorted(found)


def _gaps(shape: list[int], boxes: list[Box]) -> list[Box]:
    """Boxes of the grid the chunks' edges cut the tensor into that no chunk covers, merged along the last
    dimension; empty when the grid would be too large to walk (the caller reports counts then)."""
    edges = [sorted({0, dim, *(b[d][0] for b in boxes), *(b[d][1] for b in boxes)}) for d, dim in enumerate(shape)]
    cells = 1
    for cut in edges:
        cells *= max(len(cut) - 1, 1)
    if cells > MAX_TILING_CELLS:
        return []
    gaps: list[Box] = []

    def walk(prefix: Box, dim: int) -> None:
        if len(gaps) >= MAX_PROBLEMS:
            return
        if dim == len(shape):
            if _volume(prefix) > 0 and not any(_volume(_intersection(prefix, box)) > 0 for box in boxes):
                last = gaps[-1] if gaps else None
                if last is not None and last[:-1] == prefix[:-1] and last[-1][1] == prefix[-1][0]:
                    gaps[-1] = (*prefix[:-1], (last[-1][0], prefix[-1][1]))  # the next cell of the same row
                else:
                    gaps.append(prefix)
            return
        for start, stop in zip(edges[dim], edges[dim][1:]):
            walk((*prefix, (start, stop)), dim + 1)

    walk((), 0)
    return gaps


def _box_text(box: Box) -> str:
    return "[" + ", ".join(f"{start}:{stop}" for start, stop in box) + "]"


def _chunk_problems(chunk: Any, files: set[str], *, tensor_chunk: bool) -> list[str]:
    if not isinstance(chunk, dict):
        return [f"{chunk!r} is not an object"]
    problems = []
    if not tensor_chunk and not isinstance(chunk.get("fqn"), str):
        problems.append(f"fqn is {chunk.get('fqn')!r}, not a string")
    if chunk.get("file") not in files:
        problems.append(f"file {chunk.get('file')!r} is not listed in files")
    for name in ("offset", "length"):
        if not is_int(chunk.get(name)) or chunk[name] < 0:
            problems.append(f"{name} is {chunk.get(name)!r}, not an integer >= 0")
    if not _is_digest(chunk.get("checksum")):
        problems.append(f"checksum {chunk.get('checksum')!r} is not 16 lowercase hex characters")
    if tensor_chunk and not (_int_list(chunk.get("offsets")) and _int_list(chunk.get("sizes"))):
        problems.append("offsets and sizes must be lists of integers >= 0")
    if BLOCKS_FIELD in chunk:
        problems.extend(blocks_problems(chunk[BLOCKS_FIELD], chunk.get("length")))
    return problems


def blocks_problems(blocks: Any, length: Any) -> list[str]:
    """Block checksums must tile the chunk exactly: a reader trusts them to cover every byte it reads."""
    if not isinstance(blocks, dict) or not is_int(blocks.get("size")) or blocks["size"] < 1:
        return [f"{BLOCKS_FIELD} is {blocks!r}, not {{'size': integer >= 1, 'checksums': [...]}}"]
    digests = blocks.get("checksums")
    if not isinstance(digests, list) or not all(_is_digest(digest) for digest in digests):
        return [f"{BLOCKS_FIELD}.checksums is not a list of 16-hex-character digests"]
    if is_int(length) and len(digests) != -(-length // blocks["size"]):
        return [
            f"{BLOCKS_FIELD} has {len(digests)} checksum(s); "
            f"a chunk of {length} bytes in blocks of {blocks['size']} has {-(-length // blocks['size'])}"
        ]
    return []


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and HEX_DIGEST.match(value) is not None


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(item) and item >= 0 for item in value)
