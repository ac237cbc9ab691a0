"""Full verification after commit: a flipped byte, a truncated file and a missing file are each found,
by `verify_checkpoint` (naming file and tensor) and by `load_checkpoint` (raising CorruptCheckpoint)."""

from __future__ import annotations

import json
import os
import shutil

import fsspec
import pytest
import torch

from lightning_shardckpt import CorruptCheckpoint, load_checkpoint
from lightning_shardckpt.engine.format import manifest as manifest_format
from lightning_shardckpt.engine.format.checksum import checksum
from lightning_shardckpt.engine.format.names import COMMIT_RECORD, DCP_METADATA
from lightning_shardckpt.ops.verify import (
    CHUNK_CHECKSUM,
    DCP_METADATA_PROBLEM,
    FILE_CHECKSUM,
    FILE_SIZE,
    MISSING_FILE,
    PART_PROBLEM,
    TILING,
    verify_checkpoint,
)
from tests.helpers.checkpoints import PART, SHARD, chunk_of, dirname_of, fresh_state, save_checkpoint


@pytest.fixture
def committed(committed_checkpoint):
    return committed_checkpoint()  # root, directory, manifest


def problems_of(report, kind: str) -> list[dict]:
    return [p for p in report.problems if p["kind"] == kind]


def test_sound_checkpoint_verifies_ok_reading_every_byte(committed):
    root, directory, manifest = committed
    report = verify_checkpoint(root)
    assert report.ok, report.problems
    assert report.checkpoint_id == manifest["id"]
    assert report.files == len(manifest["files"]) == 2  # the shard file and its part (format v4)
    assert report.chunks == len(manifest["tensors"]) + len(manifest["objects"])
    assert report.bytes_read == os.path.getsize(os.path.join(directory, SHARD))
    assert verify_checkpoint(directory).ok  # a checkpoint directory works as well as its root


def test_flipped_byte_after_commit_is_named_by_verify_and_refused_by_load(committed):
    root, directory, manifest = committed
    chunk = chunk_of(manifest, "model.0.weight")
    path = os.path.join(directory, SHARD)
    data = bytearray(open(path, "rb").read())
    data[chunk["offset"] + chunk["length"] // 2] ^= 0x01
    open(path, "wb").write(bytes(data))

    report = verify_checkpoint(root)
    assert not report.ok
    bad = problems_of(report, CHUNK_CHECKSUM)
    assert [(p["file"], p["tensor"], p["expected"]) for p in bad] == [(SHARD, "model.0.weight", chunk["checksum"])]
    assert bad[0]["actual"] != chunk["checksum"]
    assert [p["file"] for p in problems_of(report, FILE_CHECKSUM)] == [SHARD]
    assert not problems_of(report, FILE_SIZE)  # same size, other bytes

    with pytest.raises(CorruptCheckpoint) as caught:
        load_checkpoint(fresh_state(seed=99), root)
    assert caught.value.problems[0]["file"] == SHARD
    assert caught.value.problems[0]["tensor"] == "model.0.weight"


def test_truncated_file_after_commit_is_named_by_verify_and_refused_by_load(committed):
    root, directory, manifest = committed
    last_fqn, last = max(
        ((t["fqn"], c) for t in manifest["tensors"] for c in t["chunks"]), key=lambda pair: pair[1]["offset"]
    )
    path = os.path.join(directory, SHARD)
    cut = last["offset"] + last["length"] // 2
    os.truncate(path, cut)

    report = verify_checkpoint(root)
    assert not report.ok
    size = problems_of(report, FILE_SIZE)
    assert [(p["file"], p["expected"], p["actual"]) for p in size] == [(SHARD, manifest["files"][0]["bytes"], cut)]
    bad = problems_of(report, CHUNK_CHECKSUM)
    assert [(p["file"], p["tensor"]) for p in bad] == [(SHARD, last_fqn)]
    assert bad[0]["actual"] == f"<{last['length'] // 2} of {last['length']} bytes>"

    with pytest.raises(CorruptCheckpoint) as caught:
        load_checkpoint(fresh_state(seed=99), root)
    assert (caught.value.problems[0]["file"], caught.value.problems[0]["tensor"]) == (SHARD, last_fqn)


def test_missing_file_after_commit_is_named_by_verify_and_refused_by_load(committed):
    root, directory, manifest = committed
    os.remove(os.path.join(directory, SHARD))

    report = verify_checkpoint(root)
    assert not report.ok
    missing = problems_of(report, MISSING_FILE)
    assert [(p["file"], p["expected"], p["actual"]) for p in missing] == [(SHARD, manifest["files"][0]["bytes"], None)]
    # every tensor and object stored in the lost file is named
    lost = {p["tensor"] for p in problems_of(report, CHUNK_CHECKSUM)}
    assert lost == {t["fqn"] for t in manifest["tensors"]} | {o["fqn"] for o in manifest["objects"]}

    with pytest.raises(CorruptCheckpoint, match=SHARD):
        load_checkpoint(fresh_state(seed=99), root)


def test_missing_or_garbled_dcp_metadata_is_reported(committed):
    root, directory, _ = committed
    metadata = os.path.join(directory, DCP_METADATA)
    shutil.copy(metadata, metadata + ".bak")
    os.remove(metadata)
    report = verify_checkpoint(root)
    assert [(p["file"], p["actual"]) for p in problems_of(report, DCP_METADATA_PROBLEM)] == [(DCP_METADATA, "missing")]

    open(metadata, "wb").write(b"not a pickle")
    report = verify_checkpoint(root)
    assert [p["file"] for p in report.problems] == [DCP_METADATA]
    assert report.problems[0]["kind"] == DCP_METADATA_PROBLEM


def test_dcp_metadata_from_another_checkpoint_is_reported(tmp_path, committed_checkpoint):
    # DCP's .metadata is what a load follows: pointing at chunks the manifest does not list must be caught
    root, directory, _ = committed_checkpoint(tmp_path / "ckpt")
    other = committed_checkpoint(tmp_path / "other", state={**fresh_state(), "extra": torch.zeros(64)})
    shutil.copy(os.path.join(other.directory, DCP_METADATA), os.path.join(directory, DCP_METADATA))

    report = verify_checkpoint(root)
    assert not report.ok
    assert {p["kind"] for p in report.problems} == {DCP_METADATA_PROBLEM}
    assert "extra" in {p["tensor"] for p in report.problems}


def test_manifest_whose_chunks_leave_a_gap_is_reported(committed_checkpoint):
    # the manifest is write-once, but a hand-edited or mis-written one must not pass for sound (format v2: the
    # manifest lists the chunks; v4's parts: test_a_part_whose_chunks_leave_a_gap_is_reported)
    root, directory, manifest = committed_checkpoint(format_version=2)
    path = os.path.join(directory, "manifest.json")
    edited = json.load(open(path))
    edited["objects"] = []  # the object at offset 0 is no longer listed: bytes 0..n are nobody's
    os.chmod(path, 0o644)
    open(path, "w").write(json.dumps(edited))
    # as a writer that built it wrong would have: a commit record that matches the wrong manifest
    record = os.path.join(directory, COMMIT_RECORD)
    os.chmod(record, 0o644)
    open(record, "wb").write(
        manifest_format.to_bytes(manifest_format.build_commit_record(edited, json.dumps(edited).encode()))
    )

    report = verify_checkpoint(root)
    tiling = problems_of(report, TILING)
    assert [(p["file"], p["actual"]) for p in tiling] == [
        (SHARD, f"the next at byte {manifest['objects'][0]['length']}")
    ]
    assert problems_of(report, FILE_CHECKSUM)  # made over every chunk written, not only the listed ones


def test_a_part_whose_chunks_leave_a_gap_is_reported(committed):
    # format v4: the part lists the chunks. One that leaves bytes unlisted, even with checksums rewritten to match
    # (as a writer that built it wrong would have), is reported, naming the part, and a load refuses it
    root, directory, manifest = committed
    part_path = os.path.join(directory, PART)
    part = json.load(open(part_path))
    part["objects"] = []  # the object at offset 0 is no longer listed: bytes 0..n are nobody's
    data = (json.dumps(part) + "\n").encode()
    os.chmod(part_path, 0o644)
    open(part_path, "wb").write(data)
    path = os.path.join(directory, "manifest.json")
    edited = json.load(open(path))
    edited["parts"]["part_bytes"][0], edited["parts"]["part_checksums"] = len(data), checksum(data)  # one rank
    os.chmod(path, 0o644)
    manifest_bytes = manifest_format.to_bytes(edited)
    open(path, "wb").write(manifest_bytes)
    record = os.path.join(directory, COMMIT_RECORD)
    os.chmod(record, 0o644)
    open(record, "wb").write(manifest_format.to_bytes(manifest_format.build_commit_record(edited, manifest_bytes)))

    report = verify_checkpoint(root)
    assert [(p["file"], "are in no chunk" in p["actual"]) for p in problems_of(report, PART_PROBLEM)] == [(PART, True)]
    with pytest.raises(CorruptCheckpoint, match="are in no chunk"):
        load_checkpoint(fresh_state(seed=99), root)


def test_memory_filesystem_checkpoint_verifies_and_flip_is_found():
    fs = fsspec.filesystem("memory")
    root = "memory://verify-test-root"
    try:
        manifest = save_checkpoint(root)
        assert verify_checkpoint(root).ok
        (obj,) = manifest["objects"]
        path = f"/verify-test-root/{dirname_of(manifest)}/{SHARD}"
        data = bytearray(fs.cat_file(path))
        data[obj["offset"] + 5] ^= 0xFF
        fs.pipe_file(path, bytes(data))
        report = verify_checkpoint(root)
        assert [(p["file"], p["tensor"]) for p in problems_of(report, CHUNK_CHECKSUM)] == [(SHARD, obj["fqn"])]
    finally:
        fs.rm("/verify-test-root", recursive=True)
