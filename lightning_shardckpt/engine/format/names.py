"""Names on storage: every file name and naming rule of the on-disk format lives here."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

MANIFEST = "manifest.json"
# the small commit record listing reads instead of the manifest (v2): written just before the manifest,
# so it exists whenever the manifest does; on its own it commits nothing
COMMIT_RECORD = "commit.json"
DCP_METADATA = ".metadata"  # DCP's own file name: plain `dcp.load` looks for exactly this
LATEST = "latest"
DCP_METADATA_FIELD = "dcp_metadata"  # manifest v2+: {"checksum", "bytes"} of `.metadata` as committed
OWNER = ".owner.json"  # ROOT/.owner.json: which run writes into this root (see ownership.py)
SHARD_SUFFIX = ".distcp"
FORMAT_VERSION = 2  # what the collective save path emits (docs/FORMAT.md)
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4, 5)  # v1: no commit record, no `seq`; listing parses the manifest itself
INCREMENTAL_FORMAT_VERSION = 3  # what an incremental checkpoint (one with references) emits; full ones stay v2
# a full save whose ranks agree on the layout: per-rank parts beside the shards, a small manifest (FORMAT.md §10)
PARTS_FORMAT_VERSION = 4
# v4 with the parts table's per-rank columns in group tables beside the parts (FORMAT.md §10.5, format/groups.py)
GROUPS_FORMAT_VERSION = 5
NEWEST_FORMAT_VERSION = max(READABLE_FORMAT_VERSIONS)
# what a chunk's `checksum` is (FORMAT.md §3, format/checksum.py): "xxh3_64" the xxh3 of its bytes (before issue
# 36, and what an absent field means); "xxh3_64_blocks" the same except for a chunk with block digests: the digest
# of those, so the writer hashes each byte once. Readers check both the same way (checksum.ChunkCheck).
CHECKSUM_ALGORITHM = "xxh3_64_blocks"  # what the writer records
LEGACY_CHECKSUM_ALGORITHM = "xxh3_64"
READABLE_CHECKSUM_ALGORITHMS = (LEGACY_CHECKSUM_ALGORITHM, CHECKSUM_ALGORITHM)

_SHARD_RE = re.compile(r"^__(?P<rank>\d+)_\d+(?:\.distcp|\.part\.json)$")  # a shard file or its part (v4)
_DIR_RE = re.compile(r"^step-(?P<step>\d{9,})-(?P<id>[0-9a-f]{8,32})$")


def new_checkpoint_id() -> str:
    return uuid.uuid4().hex[:12]


def checkpoint_dirname(step: int, checkpoint_id: str) -> str:
    if step < 0:
        raise ValueError(f"step={step} is negative; checkpoints are named by a global step >= 0")
    return f"step-{step:09d}-{checkpoint_id}"


def shard_filename(rank: int, index: int = 0) -> str:
    # DCP's naming (`__<rank>_<n>.distcp`): plain DCP readers and tools recognise it.
    return f"__{rank}_{index}{SHARD_SUFFIX}"


def shard_rank(relative_path: str) -> int | None:
    """The rank that wrote a shard file named by shard_filename (or its part, parts.part_filename): for reports
    and for picking the files a rank copies (readers find bytes through the manifest, never by parsing names);
    None for any other name."""
    match = _SHARD_RE.match(relative_path.rsplit("/", 1)[-1])
    return int(match["rank"]) if match else None


@dataclass(frozen=True)
class DirName:
    step: int
    checkpoint_id: str


def parse_dirname(name: str) -> DirName | None:
    """Return step and id of a checkpoint directory name, or None for anything else."""
    match = _DIR_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    if match is None:
        return None
    return DirName(step=int(match["step"]), checkpoint_id=match["id"])


def checkpoint_dirname_parts(name: str) -> DirName:
    """`parse_dirname` of a name already known to be a checkpoint directory's (listed as one, or written by us);
    ValueError naming it otherwise, never a None read as one."""
    parsed = parse_dirname(name)
    if parsed is None:
        raise ValueError(f"{name!r} is not a checkpoint directory name (step-<step>-<id>)")
    return parsed


def join(root: str, *parts: str) -> str:
    """Join storage paths with '/', whatever the backend (fsspec paths always use '/').

    A part starting with `../` (a reference into a sibling checkpoint, references.py) goes up one level,
    lexically: object stores have no `..`. Callers check such a part first (safe_pickle.check_inside).
    """
    out = root.rstrip("/")
    for part in parts:
        part = part.strip("/")
        while part.startswith("../") and "/" in out:
            out, part = out.rsplit("/", 1)[0], part[3:]
        out = f"{out}/{part}"
    return out


EVENTS_DIR = "events"  # one JSON file per checkpoint attempt, written once (see metrics.py)
DRILLS_DIR = (
    "drills"  # ROOT/drills/<checkpoint>--<drill id>--<verdict>.json: write-once drill records (ops/drill_records.py)
)
