"""Copies of an incremental checkpoint (issue 46): its own shard file is checked against its own records only, and an
earlier file it references is checked on the bytes it reads (engine/tiers/referenced_files.py). Real files: a
frozen base with a trained adapter, saved full then incrementally by one saver."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_shardckpt.engine.format.names import join
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.engine.tiers import referenced_files
from lightning_shardckpt.engine.tiers.verified_copy import copy_checked, copy_verified
from lightning_shardckpt.errors import CorruptCheckpoint
from tests.unit.test_incremental_parts import incremental_pair


def test_an_incremental_checkpoints_own_shard_is_copied_checked_against_its_own_records_only(tmp_path):
    """Before: its part's referenced records (byte ranges of the base's file) were taken for ranges of its own file,
    so every tier or peer copy of an incremental checkpoint failed as "truncated"."""
    _, incremental = incremental_pair(tmp_path / "root")
    manifest = json.loads(Path(incremental.path, "manifest.json").read_bytes())
    fs = fsio.resolve(str(tmp_path)).fs
    (tmp_path / "copy").mkdir()
    copied = copy_verified(fs, incremental.path, fs, str(tmp_path / "copy"), "__0_0.distcp", manifest)
    assert copied == Path(incremental.path, "__0_0.distcp").stat().st_size > 0


def test_a_referenced_file_is_copied_checked_on_the_bytes_the_checkpoint_reads_and_a_damaged_one_is_refused(tmp_path):
    full, incremental = incremental_pair(tmp_path / "root")
    manifest = json.loads(Path(incremental.path, "manifest.json").read_bytes())
    fs = fsio.resolve(str(tmp_path)).fs
    holder = f"../{Path(full.path).name}/__0_0.distcp"
    assert referenced_files.listed(manifest) == {holder: 0}
    [(reference, (size, ranges))] = referenced_files.of_ranks(fs, incremental.path, manifest, [0]).items()
    assert reference == holder and size == Path(full.path, "__0_0.distcp").stat().st_size
    checked = [r for r in ranges if r[2] is not None]
    unchecked = [r for r in ranges if r[2] is None]  # the changed adapter's old bytes: not this checkpoint's to vouch
    assert checked and unchecked and sum(r[1] for r in ranges) == size  # every byte passes, in order

    source = join(incremental.path, reference)
    assert copy_checked(fs, source, fs, str(tmp_path / "good"), ranges, size) == size
    assert (tmp_path / "good").read_bytes() == Path(source).read_bytes()

    data = bytearray(Path(source).read_bytes())
    offset, length = unchecked[0][:2]
    data[offset + length // 2] ^= 0xFF  # a byte no referencing record reads: still a good copy for this checkpoint
    Path(tmp_path / "unread").write_bytes(data)
    assert copy_checked(fs, str(tmp_path / "unread"), fs, str(tmp_path / "unread-copy"), ranges, size) == size
    offset, length = checked[0][:2]
    data[offset + length // 2] ^= 0xFF  # a byte it reads: refused
    Path(tmp_path / "read").write_bytes(data)
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        copy_checked(fs, str(tmp_path / "read"), fs, str(tmp_path / "read-copy"), ranges, size)
