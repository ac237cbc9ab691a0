"""A large chunk's checksum is the digest of its block digests (`xxh3_64_blocks`, FORMAT.md §3): the writer hashes
each byte once. Checkpoints written before it (`xxh3_64`: the chunk checksum is the xxh3 of its bytes) still load
and verify, and one flipped byte in a block is caught by load and verify under both."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import xxhash

from lightning_shardckpt import CorruptCheckpoint, load_checkpoint, verify_checkpoint
from lightning_shardckpt.engine.format import parts
from lightning_shardckpt.engine.format.checksum import (
    BLOCK_MIN_BYTES,
    ChunkCheck,
    block_size_for,
)
from lightning_shardckpt.ops.verify import CHUNK_CHECKSUM
from tests.helpers.checkpoints import PART, SHARD, save_checkpoint

REPO = Path(__file__).parents[2]
# the last commit whose writer recorded `xxh3_64` (a blocked chunk's checksum: the xxh3 of its bytes)
BEFORE_BLOCK_DIGESTS = "80ced56be7df1b1849299b9c08389de21105cd1e"
BIG_ROWS = 6 * 2**20 // (4 * 64)  # a [BIG_ROWS, 64] float32 tensor: 6 MiB, one chunk of 6 blocks of 1 MiB


# the state, as source: the old writer's process builds it from this text, without importing this module
BIG_STATE = f"""
def big_state():
    import torch
    torch.manual_seed(0)
    return {{
        "model": {{"big": torch.randn({BIG_ROWS}, 64), "small": torch.randn(7, 5)}},
        "progress": {{"global_step": 3}},
    }}
"""
_namespace: dict = {}
exec(BIG_STATE, _namespace)
big_state = _namespace["big_state"]


def empty_like(state: dict) -> dict:
    return {
        "model": {name: torch.zeros_like(t) for name, t in state["model"].items()},
        "progress": {"global_step": 0},
    }


def big_chunk_record(directory: str) -> dict:
    part = json.loads((Path(directory) / PART).read_bytes())
    return next(chunk for chunk in part[parts.TENSOR_CHUNKS] if chunk["fqn"] == "model.big")


def flip_byte_in_block(directory: str, record: dict, block: int) -> None:
    path = Path(directory) / SHARD
    data = bytearray(path.read_bytes())
    data[record["offset"] + block * record["blocks"]["size"] + 12345] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_large_chunks_checksum_is_the_digest_of_its_block_digests(tmp_path):
    manifest = save_checkpoint(str(tmp_path), state=big_state())
    [directory] = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("step-")]
    assert json.loads((directory / "manifest.json").read_bytes())["checksum_algorithm"] == "xxh3_64_blocks"
    record = big_chunk_record(str(directory))
    with open(directory / SHARD, "rb") as shard:
        shard.seek(record["offset"])
        data = shard.read(record["length"])
    size = record["blocks"]["size"]
    blocks = [xxhash.xxh3_64(data[start : start + size]).hexdigest() for start in range(0, len(data), size)]
    assert size == BLOCK_MIN_BYTES and len(blocks) == 7  # 6 MiB of elements plus the record's headers
    assert record["blocks"]["checksums"] == blocks
    assert record["checksum"] == xxhash.xxh3_64("".join(blocks).encode()).hexdigest()
    assert record["checksum"] != xxhash.xxh3_64(data).hexdigest()  # not the old definition
    assert manifest["tensors"]  # loads back exactly
    state = big_state()
    target = empty_like(state)
    load_checkpoint(target, str(tmp_path))
    assert torch.equal(target["model"]["big"], state["model"]["big"])
    assert verify_checkpoint(str(tmp_path)).ok


def test_a_chunk_check_of_an_old_record_checks_its_blocks_and_of_a_small_chunk_its_bytes():
    data = os.urandom(5 * 2**20 + 3)
    size = block_size_for(len(data))
    blocks = [xxhash.xxh3_64(data[s : s + size]).hexdigest() for s in range(0, len(data), size)]
    old = {"checksum": xxhash.xxh3_64(data).hexdigest(), "blocks": {"size": size, "checksums": blocks}}
    check = ChunkCheck.of_record(old)
    assert check.actual(data) == check.expected
    damaged = bytearray(data)
    damaged[size * 3 + 5] ^= 1
    assert check.actual(bytes(damaged)) != check.expected
    small = b"x" * 1000
    assert ChunkCheck.of_record({"checksum": xxhash.xxh3_64(small).hexdigest()}).actual(small) == (
        xxhash.xxh3_64(small).hexdigest()
    )


@pytest.mark.parametrize("format_version", [4, 2])
def test_one_flipped_byte_in_a_block_is_caught_by_load_and_verify(tmp_path, format_version):
    save_checkpoint(str(tmp_path), state=big_state(), format_version=format_version)
    [directory] = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("step-")]
    if format_version == 4:
        record = big_chunk_record(str(directory))
    else:
        manifest = json.loads((directory / "manifest.json").read_bytes())
        record = next(t for t in manifest["tensors"] if t["fqn"] == "model.big")["chunks"][0]
    flip_byte_in_block(str(directory), record, block=3)
    report = verify_checkpoint(str(tmp_path))
    assert [p["tensor"] for p in report.problems if p["kind"] == CHUNK_CHECKSUM] == ["model.big"]
    with pytest.raises(CorruptCheckpoint, match="model.big"):
        load_checkpoint(empty_like(big_state()), str(tmp_path))


@pytest.fixture(scope="module")
def old_code(tmp_path_factory) -> Path:
    """The package as of BEFORE_BLOCK_DIGESTS, extracted from git (skipped where the history is not at hand)."""
    where = tmp_path_factory.mktemp("before_block_digests")
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the writer before xxh3_64_blocks cannot be extracted")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", BEFORE_BLOCK_DIGESTS, "lightning_shardckpt"], capture_output=True
    )
    if archive.returncode != 0:
        pytest.skip(f"commit {BEFORE_BLOCK_DIGESTS} is not in this checkout's history: {archive.stderr.decode()}")
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    return where


def write_with_old_code(old_code: Path, root: Path, format_version: int) -> None:
    script = BIG_STATE + textwrap.dedent(
        f"""
        import lightning_shardckpt
        assert lightning_shardckpt.__file__.startswith({str(old_code)!r}), lightning_shardckpt.__file__
        from lightning_shardckpt import CheckpointSaver, SaveConfig
        saver = CheckpointSaver({str(root)!r}, SaveConfig(async_save=False, write_events=False,
                                format_version={format_version}))
        result = saver.save(big_state(), step=3).result(timeout=120)
        saver.close()
        assert result.committed, result.error
        """
    )
    env = {**os.environ, "PYTHONPATH": str(old_code)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("format_version", [4, 2])
def test_a_checkpoint_written_before_block_digests_still_loads_verifies_and_catches_a_flipped_byte(
    tmp_path, old_code, format_version
):
    write_with_old_code(old_code, tmp_path, format_version)
    [directory] = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("step-")]
    manifest = json.loads((directory / "manifest.json").read_bytes())
    assert manifest["checksum_algorithm"] == "xxh3_64"
    if format_version == 4:
        record = big_chunk_record(str(directory))
    else:
        record = next(t for t in manifest["tensors"] if t["fqn"] == "model.big")["chunks"][0]
    with open(directory / SHARD, "rb") as shard:
        shard.seek(record["offset"])
        assert record["checksum"] == xxhash.xxh3_64(shard.read(record["length"])).hexdigest()  # the old definition

    state = big_state()
    target = empty_like(state)
    load_checkpoint(target, str(tmp_path))
    assert torch.equal(target["model"]["big"], state["model"]["big"])
    assert torch.equal(target["model"]["small"], state["model"]["small"])
    assert verify_checkpoint(str(tmp_path)).ok, verify_checkpoint(str(tmp_path)).problems

    flip_byte_in_block(str(directory), record, block=2)
    report = verify_checkpoint(str(tmp_path))
    assert [p["tensor"] for p in report.problems if p["kind"] == CHUNK_CHECKSUM] == ["model.big"]
    with pytest.raises(CorruptCheckpoint, match="model.big"):
        load_checkpoint(empty_like(state), str(tmp_path))


def test_a_new_part_whose_blocked_chunk_checksum_is_not_the_digest_of_its_blocks_is_refused(tmp_path):
    from lightning_shardckpt.engine.format.checksum import checksum_of_checksums
    from tests.helpers.forgery import forge_part

    save_checkpoint(str(tmp_path), state=big_state())
    [directory] = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("step-")]
    record = big_chunk_record(str(directory))
    with open(directory / SHARD, "rb") as shard:
        shard.seek(record["offset"])
        old_definition = xxhash.xxh3_64(shard.read(record["length"])).hexdigest()

    def edit(part: dict) -> None:  # the checksum as xxh3_64 defined it, everything vouching for it recomputed
        chunks = part[parts.TENSOR_CHUNKS] + part[parts.OBJECTS]
        next(c for c in chunks if c["fqn"] == "model.big")["checksum"] = old_definition
        part["file_checksum"] = checksum_of_checksums(
            [c["checksum"] for c in sorted(chunks, key=lambda c: c["offset"])]
        )

    def manifest_edit(manifest: dict) -> None:
        part = json.loads((directory / PART).read_bytes())
        manifest["parts"]["file_checksums"] = part["file_checksum"] + manifest["parts"]["file_checksums"][16:]

    forge_part(str(directory), 0, edit, manifest_edit)
    with pytest.raises(CorruptCheckpoint, match="not the digest of its block checksums"):
        load_checkpoint(empty_like(big_state()), str(tmp_path))
    assert not verify_checkpoint(str(tmp_path)).ok
