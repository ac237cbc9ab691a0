"""One checkpoint directory as a root's listing sees it, and reading its manifest.

The record type shared by the catalog (which lists a root), drill records (trust states of listed
entries) and references (reachability over listed entries): it lives below all three so that none of
them imports another to name it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ...errors import CheckpointDeleted, CheckpointNotFound, CorruptCheckpoint, ShardCkptError
from ..storage import fsio
from ..storage.small_files import SmallFileRefused
from . import bounded_json
from . import manifest as manifest_format
from .manifest_schema import parse_time
from .names import MANIFEST, join

COMMITTED, UNCOMMITTED, CORRUPT = "committed", "uncommitted", "corrupt"


@dataclass
class CheckpointEntry:
    """One checkpoint directory in a root.

    `record` holds the listing fields (id, step, run_id, parent, seq, created_at, bytes_total) of a
    committed one; `manifest`, the full manifest, is read and validated on first use.
    """

    name: str
    path: str
    step: int
    checkpoint_id: str
    state: str  # committed | uncommitted | corrupt
    problem: str | None = None  # why a directory is corrupt
    record: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    _manifest: dict[str, Any] | None = field(default=None, repr=False)
    _fs: Any = field(default=None, repr=False, compare=False)  # for reading the manifest on first use
    _created: Any = field(default=None, repr=False, compare=False)

    @property
    def committed(self) -> bool:
        return self.state == COMMITTED

    @property
    def run_id(self) -> str | None:
        return (self.record or {}).get("run_id")

    @property
    def seq(self) -> int | None:
        return (self.record or {}).get("seq")

    @property
    def created_at(self) -> datetime | None:
        # parsed once: ordering a listing asks for it many times
        if self._created is None or self._created[0] is not self.record:
            self._created = (self.record, parse_time((self.record or {}).get("created_at")))
        return self._created[1]

    @property
    def manifest(self) -> dict[str, Any] | None:
        """The full, validated manifest of a committed checkpoint (read on first use); None otherwise.

        Raises CheckpointDeleted when the directory went after it was listed, CorruptCheckpoint (and
        marks the entry corrupt) when the manifest does not validate.
        """
        if self._manifest is None and self.committed and self._fs is not None:
            self._manifest = read_manifest(self._fs, self)
        return self._manifest

    @manifest.setter
    def manifest(self, value: dict[str, Any] | None) -> None:
        self._manifest = value

    @property
    def committed_manifest(self) -> dict[str, Any]:
        """`manifest` where the caller holds a committed checkpoint (a pick, a load): an entry without one
        (uncommitted, corrupt, or listed without its filesystem) is refused by name rather than read as None."""
        manifest = self.manifest
        if manifest is None:
            raise CheckpointNotFound(
                f"{self.path} is {self.state}, not a committed checkpoint with a readable manifest: load or "
                "inspect a committed one (`shardckpt ls ROOT` lists them)"
            )
        return manifest

    def __getstate__(self) -> dict[str, Any]:
        # sent between ranks (loader's pick): the manifest travels, the filesystem handle does not
        return {**self.__dict__, "_fs": None}


def load_manifest(fs: Any, directory: str, record: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of checkpoint `directory`: read (retried), validated, and matched against its commit
    record when given (its checksum, then every field the record copies). A v5 one is not expanded: its group
    tables are read by whoever needs them (groups.expanded, chunk_index). FileNotFoundError when it has none;
    CorruptCheckpoint when it does not validate or does not match."""
    path = join(directory, MANIFEST)
    data = read_manifest_bytes(fs, path)
    if record is not None:
        manifest_format.check_matches_record(data, record, directory)
    manifest = manifest_format.parse(data, directory)
    if record is not None:
        manifest_format.check_record_agrees(record, manifest, directory)
    return manifest


def read_manifest_bytes(fs: Any, path: str) -> bytes:
    """manifest.json's bytes, through the one bounded read of a root's small files (storage/small_files.py):
    CorruptCheckpoint naming it when it is a FIFO, a symlink or over MANIFEST_MAX_BYTES, never a hang or a
    MemoryError; FileNotFoundError when it is gone."""
    try:
        return fsio.read_small(fs, path, bounded_json.MANIFEST_MAX_BYTES)
    except SmallFileRefused as err:
        raise CorruptCheckpoint(
            f"{err}: it is not a manifest this package wrote. Move it out of the root, or load another checkpoint",
            problems=[{"file": MANIFEST, "tensor": None, "expected": "a regular file", "actual": err.why}],
        ) from None


def read_manifest(fs: Any, entry: CheckpointEntry) -> dict[str, Any]:
    """The full manifest of a listed, committed entry: read, matched against its commit record, validated.

    Raises CheckpointDeleted (and marks the entry uncommitted) when the directory went after it was
    listed, CorruptCheckpoint (and marks it corrupt) when the manifest does not validate.
    """
    try:
        return load_manifest(fs, entry.path, entry.record)
    except FileNotFoundError as err:
        entry.state = UNCOMMITTED
        raise CheckpointDeleted(
            f"{entry.path} was deleted after it was listed (retention of a job writing into this root, or a person); "
            "pick another checkpoint: shardckpt ls " + entry.path.rsplit("/", 1)[0]
        ) from err
    except ShardCkptError as err:
        entry.state, entry.problem = CORRUPT, str(err)
        raise
