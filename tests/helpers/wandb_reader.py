"""Read a W&B offline run (`wandb/offline-run-*/run-<id>.wandb`) without a network or a W&B server.

wandb 0.31 ships no Python reader for its run files (`wandb.sdk.internal.datastore` is gone), so this
is one: the file is a LevelDB-log stream of `wandb_internal_pb2.Record` messages.

    run = read_run(find_run_file(save_dir))
    run.history           # [{"_step": 3, "train/loss": 2.1, ...}, ...] in logging order
    run.summary           # {"final": 3.5, ...}: the last value written per key
    run.config            # {"a": 1, "nested": {"b": 2}}
    run.artifacts         # [{"name", "type", "aliases", "metadata", "entries": [{"path", "ref", ...}]}]
    run.alerts            # [{"title", "text", "level", "wait_duration"}] from run.alert(...)

Framing (LevelDB log format, with W&B's own file header):
- file header, 7 bytes: magic b":W&B", uint16 LE 0xBEE1, uint8 version (0);
- then 32 KiB blocks; each block holds records with a 7-byte header: uint32 LE crc32c (masked, not
  checked here), uint16 LE length, uint8 type (1 FULL, 2 FIRST, 3 MIDDLE, 4 LAST); a block tail shorter
  than a header is zero padding. The first block is 32 KiB minus the file header.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # at run time only _parse needs it: collecting a test module that imports this pays no wandb
    from wandb.proto import wandb_internal_pb2 as pb

MAGIC = b":W&B"
FILE_HEADER = struct.Struct("<4sHB")  # magic, 0xBEE1, version
RECORD_HEADER = struct.Struct("<IHB")  # crc32c, length, type
BLOCK_SIZE = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def iter_records(path: str) -> Iterator[pb.Record]:
    """Every Record in a `.wandb` file, in the order written. A torn tail (run still open) is dropped."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < FILE_HEADER.size:
        return
    magic, ident, _version = FILE_HEADER.unpack_from(data)
    if magic != MAGIC or ident != 0xBEE1:
        raise ValueError(f"{path}: not a W&B run file (header {data[:7]!r})")
    pos, pending = FILE_HEADER.size, bytearray()
    while pos + RECORD_HEADER.size <= len(data):
        left_in_block = BLOCK_SIZE - pos % BLOCK_SIZE
        if left_in_block < RECORD_HEADER.size:  # zero padding at a block's end
            pos += left_in_block
            continue
        _crc, length, kind = RECORD_HEADER.unpack_from(data, pos)
        start = pos + RECORD_HEADER.size
        if kind == 0 and length == 0:  # zeroed tail of a preallocated / unfinished block
            pos += left_in_block
            continue
        if start + length > len(data):
            return  # torn write at the end
        payload, pos = data[start : start + length], start + length
        if kind == FULL:
            pending = bytearray()
            yield _parse(payload)
        elif kind == FIRST:
            pending = bytearray(payload)
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            pending += payload
            yield _parse(bytes(pending))
            pending = bytearray()
        else:
            raise ValueError(f"{path}: unknown record type {kind} at byte {pos - length - RECORD_HEADER.size}")


def _parse(payload: bytes) -> pb.Record:
    from wandb.proto import wandb_internal_pb2 as pb

    record = pb.Record()
    record.ParseFromString(payload)
    return record


@dataclass
class OfflineRun:
    path: str
    run_id: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)

    def series(self, key: str) -> list[tuple[int, Any]]:
        """(_step, value) for every history row that holds `key`."""
        return [(row.get("_step"), row[key]) for row in self.history if key in row]


def read_run(path: str) -> OfflineRun:
    """History rows, summary, config and artifact records of one `.wandb` file."""
    run = OfflineRun(path=path)
    for record in iter_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id = record.run.run_id
            _apply_config(run.config, record.run.config)
        elif kind == "history":
            row = {_key(item): _value(item) for item in record.history.item}
            if record.history.HasField("step") and "_step" not in row:
                row["_step"] = record.history.step.num
            run.history.append(row)
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[_key(item)] = json.loads(item.value_json)
            for item in record.summary.remove:
                run.summary.pop(_key(item), None)
        elif kind == "config":
            _apply_config(run.config, record.config)
        elif kind == "artifact":
            run.artifacts.append(_artifact(record.artifact))
        elif kind == "alert":
            alert = record.alert
            run.alerts.append(
                {"title": alert.title, "text": alert.text, "level": alert.level, "wait_duration": alert.wait_duration}
            )
    return run


def find_run_file(save_dir: str) -> str:
    """The one `.wandb` file under `save_dir` (searched recursively); fails if there are none or several."""
    # `wandb/latest-run` is a symlink to the run directory: count each real file once.
    found = sorted(
        {os.path.realpath(p) for p in glob.glob(os.path.join(save_dir, "**", "run-*.wandb"), recursive=True)}
    )
    if len(found) != 1:
        raise FileNotFoundError(f"expected one W&B run file under {save_dir}, found {found}")
    return found[0]


def _key(item: Any) -> str:
    # wandb-core writes `nested_key`: ["train/loss"] for a flat key, ["_wandb", "runtime"] for a nested one.
    return ".".join(item.nested_key) if item.nested_key else item.key


def _value(item: pb.HistoryItem) -> Any:
    # wandb-core writes every value as JSON (NaN/Infinity included, which json.loads accepts).
    return json.loads(item.value_json) if item.value_json else None


def _apply_config(config: dict[str, Any], record: pb.ConfigRecord) -> None:
    for item in record.update:
        target = config
        keys = list(item.nested_key) or [item.key]
        for key in keys[:-1]:
            target = target.setdefault(key, {})
        target[keys[-1]] = json.loads(item.value_json)
    for item in record.remove:
        config.pop(_key(item), None)


def _artifact(record: pb.ArtifactRecord) -> dict[str, Any]:
    entries = [
        {"path": e.path, "ref": e.ref, "digest": e.digest, "size": e.size, "local_path": e.local_path}
        for e in record.manifest.contents
    ]
    return {
        "name": record.name,
        "type": record.type,
        "aliases": list(record.aliases),
        "metadata": json.loads(record.metadata) if record.metadata else {},
        "digest": record.digest,
        "entries": entries,
        "manifest_file_path": record.manifest.manifest_file_path,
    }
