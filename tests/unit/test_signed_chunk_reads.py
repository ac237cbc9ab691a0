"""A signed v5 chunk read in part (FORMAT.md §12.2): a rank that needs some rows of a large chunk reads only the
blocks holding them (and the record's headers), and hashes each block it reads with the signing digest in the same
pass as its xxh3, so it checks what it reads against the part's `blocks.digests` without fetching the rest."""

from __future__ import annotations

import io

import fsspec
import torch

from lightning_shardckpt.engine.format.checksum import HashingWriter, block_size_for
from lightning_shardckpt.engine.storage.chunk_reads import (
    Destination,
    DirectReader,
    ShardFile,
    byte_view,
    needed_blocks,
)
from lightning_shardckpt.engine.storage.writer import save_record


def _record(tensor: torch.Tensor) -> tuple[bytes, int, tuple[str, tuple[str, ...] | None]]:
    """The tensor's record as a signed v5 save writes it: (bytes, block size, (digest, block digests))."""
    buffer = io.BytesIO()
    stream = HashingWriter(buffer, chunk_digest="sha256")
    block_size = block_size_for(tensor.numel() * tensor.element_size())
    assert block_size is not None
    stream.begin_chunk(block_size)
    save_record(tensor, stream)
    stream.end_chunk()
    assert stream.chunk_crypto is not None
    return buffer.getvalue(), block_size, stream.chunk_crypto


def _fetch(path, record_bytes: int, tensor: torch.Tensor, wanted: list[Destination], block_size: int):
    """What a rank under a signature policy reads of the record at `path`: the wanted bytes, block digests hashed."""
    reader = DirectReader(hashing=True, crypto="sha256")
    shard = ShardFile(fsspec.filesystem("file"), str(path))
    try:
        return reader.fetch(shard, 0, record_bytes, tensor.numel() * 4, wanted, block_size)
    finally:
        shard.close()
        reader.close()


def test_a_partial_read_of_a_blocked_chunk_checks_each_block_it_reads_by_its_signed_digest(tmp_path):
    tensor = torch.arange(2048 * 1024, dtype=torch.float32).reshape(2048, 1024)  # 8 MiB: 1 MiB blocks
    record, block_size, (_, block_digests) = _record(tensor)
    assert block_digests is not None and len(block_digests) == -(-len(record) // block_size)
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(record)
    rows = torch.empty(256, 1024, dtype=torch.float32)  # rows 512..767: 1 MiB of the chunk's 8
    start = 512 * 1024 * 4
    wanted = [Destination(start, start + rows.numel() * 4, byte_view(rows))]

    fetched = _fetch(path, len(record), tensor, wanted, block_size)
    assert torch.equal(rows, tensor[512:768])
    # only the blocks holding the rows or the record's headers were read, and each was hashed with its digest
    needed = needed_blocks(len(record), block_size, _data_start(record), wanted)
    assert fetched.crypto_blocks is not None and sorted(fetched.crypto_blocks) == needed
    assert len(needed) < len(block_digests) and fetched.read_bytes < len(record)
    assert {index: block_digests[index] for index in fetched.crypto_blocks} == fetched.crypto_blocks

    # a byte changed in a block the read needs: that block's digest no longer matches the signed one
    changed = bytearray(record)
    changed[start + 4096 + 1000] ^= 0xFF
    path.write_bytes(bytes(changed))
    forged = _fetch(path, len(record), tensor, wanted, block_size)
    assert forged.crypto_blocks is not None
    differing = [index for index, digest in forged.crypto_blocks.items() if digest != block_digests[index]]
    assert differing == [(start + 4096 + 1000 + _data_start(record)) // block_size]


def _data_start(record: bytes) -> int:
    """Where the record's tensor bytes begin (torch aligns them to 64 bytes after the zip headers)."""
    from lightning_shardckpt.engine.storage.chunk_reads import record_data_offset

    head, tail_start = bytearray(record[:4096]), len(record) - 4096
    offset = record_data_offset(head, bytearray(record[tail_start:]), tail_start, len(record), 2048 * 1024 * 4)
    assert offset is not None
    return offset
