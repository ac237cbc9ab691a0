"""What a save spends CPU on, kept cheap without losing a guarantee (issue 30).

The sampled read-back of a large chunk reads blocks of it (each checked against its block checksum), not
the whole chunk, and still catches a flipped byte in a block it reads; "full" still reads every byte.
The writer's finite flags take a sum in the tensor's own dtype, and are still exact: an overflowing sum of
finite values is finite, a NaN or Inf anywhere is not.
"""

from __future__ import annotations

import random

import fsspec
import pytest
import torch

from lightning_shardckpt.engine.config import VerifyConfig
from lightning_shardckpt.engine.format.checksum import checksum
from lightning_shardckpt.engine.storage.writer import ChunkFileWriter, choose_reads_to_verify, is_finite, verify_reads
from lightning_shardckpt.errors import CorruptCheckpoint

MIB = 2**20


@pytest.fixture
def shard(tmp_path):
    """A shard file of a small byte chunk and a 16 MiB tensor (checksummed by block), as the writer makes it."""
    fs = fsspec.filesystem("file")
    path = str(tmp_path / "__0_0.distcp")
    writer = ChunkFileWriter(fs, path)
    writer.add_bytes(b"small pickled state")
    writer.add_tensor(torch.arange(4 * MIB, dtype=torch.float32))
    writer.close()
    return fs, path, writer


def test_sampled_read_back_of_a_large_chunk_reads_blocks_not_the_whole_chunk(shard):
    fs, path, writer = shard
    large = writer.chunks[1][1]
    policy = VerifyConfig(fraction=0.01, min_chunks=1)
    for seed in range(20):
        reads = choose_reads_to_verify(writer.chunks, writer.blocks, policy, random.Random(seed))
        read_bytes = sum(read.length for read in reads)
        assert reads and read_bytes >= 0.01 * sum(length for _, length, _ in writer.chunks)
        assert read_bytes < large / 4  # one block or the small chunk, never the 16 MiB chunk whole
        for read in reads:
            assert read.length == writer.chunks[read.chunk][1] if read.block is None else read.length <= 2 * MIB
        verify_reads(fs, path, reads, ["state", "weight"])  # sound bytes pass
    block_size, digests = writer.blocks[1]
    assert (block_size, len(digests)) == (MIB, -(-large // MIB))  # the record's 16 MiB and its headers


def test_full_read_back_reads_every_chunk_whole(shard):
    _, _, writer = shard
    reads = choose_reads_to_verify(writer.chunks, writer.blocks, VerifyConfig(mode="full"), random.Random(0))
    assert [(read.offset, read.length, read.expected, read.block) for read in reads] == [
        (*chunk, None) for chunk in writer.chunks
    ]


def test_flipped_byte_in_a_sampled_block_fails_the_read_back_naming_tensor_and_block(shard):
    fs, path, writer = shard
    offset, _, _ = writer.chunks[1]
    block_size, _ = writer.blocks[1]
    with open(path, "r+b") as handle:  # storage returns other bytes in block 5 of the tensor
        handle.seek(offset + 5 * block_size + 100)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))
    full = choose_reads_to_verify(writer.chunks, writer.blocks, VerifyConfig(mode="full"), random.Random(0))
    with pytest.raises(CorruptCheckpoint, match="weight"):
        verify_reads(fs, path, full, ["state", "weight"])
    every_block = choose_reads_to_verify(writer.chunks, writer.blocks, VerifyConfig(fraction=1.0), random.Random(0))
    with pytest.raises(CorruptCheckpoint) as raised:
        verify_reads(fs, path, every_block, ["state", "weight"])
    assert raised.value.problems == [
        {
            "file": path,
            "tensor": "weight",
            "expected": writer.blocks[1][1][5],
            "actual": raised.value.problems[0]["actual"],
            "block": 5,
        }
    ]
    assert raised.value.problems[0]["actual"] != checksum(b"")
    others = [read for read in every_block if read.block != 5]
    verify_reads(fs, path, others, ["state", "weight"])  # the other blocks are intact


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64])
def test_finite_flag_is_exact_when_the_sum_overflows_or_a_value_is_nan_or_inf(dtype):
    largest = {torch.float16: 6e4, torch.float64: 1.7e308}.get(dtype, 3e38)
    assert is_finite(torch.full((1000,), largest, dtype=dtype)) is True  # the sum overflows; every value is finite
    values = torch.ones(5_000_000, dtype=dtype)
    assert is_finite(values) is True
    for bad in (float("nan"), float("inf"), float("-inf")):
        damaged = values.clone()
        damaged[4_321_987] = bad
        assert is_finite(damaged) is False
    assert is_finite(torch.arange(5)) is None
