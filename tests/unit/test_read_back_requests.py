"""The read-back before commit in few requests, as strong per piece as before (issue 35).

The sampled read-back reads one run of consecutive pieces from a random one (wrapping past the file's end), so
it is one contiguous span, two at most, each read with one request; every piece is as likely to be read as
any other. On S3 a span is one ranged GET whose Content-Range gives the stored size: the size check needs no
HEAD, a truncated upload is still named, and a transient error on the GET is retried. Counted on the wire by
the loopback proxy (tests/helpers/s3_server.py).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from lightning_shardckpt.engine.config import VerifyConfig
from lightning_shardckpt.engine.storage import fsio, retry
from lightning_shardckpt.engine.storage.writer import ChunkFileWriter, choose_reads_to_verify, spans_of, verify_reads
from lightning_shardckpt.errors import CorruptCheckpoint
from tests.helpers.backends import NO_HTTP_RETRIES

MIB = 2**20


def _write_shard(fs, path: str, tensors: int = 200) -> ChunkFileWriter:
    writer = ChunkFileWriter(fs, path)
    writer.add_bytes(b"small pickled state")
    for index in range(tensors):
        writer.add_tensor(torch.full((16, 16), float(index)))
    writer.add_tensor(torch.arange(2 * MIB, dtype=torch.float32))  # 8 MiB: checksummed by block
    writer.close()
    return writer


def test_a_sampled_read_back_is_one_or_two_spans_and_reads_every_piece_at_least_a_fraction_of_the_time(tmp_path):
    fs = fsio.resolve(str(tmp_path)).fs
    writer = _write_shard(fs, str(tmp_path / "__0_0.distcp"))
    total = sum(length for _, length, _ in writer.chunks)
    fraction = 0.01
    policy = VerifyConfig(fraction=fraction, min_chunks=1)
    seen: Counter = Counter()
    read_bytes = []
    draws = 4000
    for seed in range(draws):
        reads = choose_reads_to_verify(writer.chunks, writer.blocks, policy, random.Random(seed))
        assert len(spans_of(reads)) <= 2, seed  # one run, split in two only where it wraps past the end
        read_bytes.append(sum(read.length for read in reads))
        assert read_bytes[-1] >= fraction * total
        seen.update((read.chunk, read.block) for read in reads)
    pieces = len(writer.chunks) - 1 + len(writer.blocks[-1][1])  # small chunks whole, the large one by block
    assert len(seen) == pieces  # no piece is out of reach, the first and last included
    # the window starts at a uniform byte and wraps: every piece, a 19-byte chunk or a 1 MiB block, the first and
    # the last, is read with probability at least `fraction` (here ~1.0%; the bound leaves room for the draws'
    # noise. A run of pieces started at a random piece instead of a random byte read the 9 blocks holding 94% of
    # the bytes 20-50x less often than `fraction`; one that stopped at its first large piece, the chunks after it)
    assert min(seen.values()) / draws >= 0.5 * fraction, sorted(seen.items(), key=lambda item: item[1])[:3]
    # and reads not much more than asked: the window plus the two pieces it cuts
    assert sum(read_bytes) / draws < fraction * total + 2 * MIB


def test_the_read_back_on_s3_is_one_ranged_get_per_span_and_needs_no_head(s3_server, s3_root, s3_fault_proxy):
    location = fsio.resolve(s3_root.url, s3_server.storage_options(s3_fault_proxy.endpoint))
    path = fsio.join(location.path, "__0_0.distcp")
    writer = _write_shard(location.fs, path)
    file_bytes = sum(length for _, length, _ in writer.chunks)
    names = ["state"] + [f"t{i}" for i in range(len(writer.chunks) - 1)]
    for mode in ("full", "sample"):
        s3_fault_proxy.clear()
        reads = choose_reads_to_verify(writer.chunks, writer.blocks, VerifyConfig(mode=mode), random.Random(3))
        assert verify_reads(location.fs, path, reads, names) == file_bytes  # the stored size, from Content-Range
        methods = Counter(request.method for request in s3_fault_proxy.requests(pattern=r"__0_0\.distcp"))
        assert methods == {"GET": len(spans_of(reads))}, (mode, methods)
        assert len(spans_of(reads)) == 1 or mode == "sample"


def test_a_truncated_upload_on_s3_is_named_by_the_read_back_with_its_stored_size(s3_server, s3_root):
    location = fsio.resolve(s3_root.url, s3_server.storage_options())
    path = fsio.join(location.path, "__0_0.distcp")
    writer = _write_shard(location.fs, path, tensors=20)
    names = ["state"] + [f"t{i}" for i in range(len(writer.chunks) - 1)]
    kept = writer.chunks[5][0] + 10  # storage kept the first bytes only, 10 bytes into chunk 5
    location.fs.pipe_file(path, location.fs.cat_file(path, start=0, end=kept))
    full = choose_reads_to_verify(writer.chunks, writer.blocks, VerifyConfig(mode="full"), random.Random(0))
    with pytest.raises(CorruptCheckpoint, match=f"<10 of {writer.chunks[5][1]} bytes>") as raised:
        verify_reads(location.fs, path, full, names)
    assert [problem["tensor"] for problem in raised.value.problems] == ["t4"]  # chunk 5; nothing after is read
    # a span that starts past the stored end (S3 answers 416, no size): short, and the size from one HEAD
    past = [read for read in full if read.offset > kept]
    with pytest.raises(CorruptCheckpoint, match="<0 of"):
        verify_reads(location.fs, path, past[:1], names)


def test_a_transient_error_on_the_read_back_get_is_retried_and_counted(
    s3_server, s3_root, s3_fault_proxy, fast_retries
):
    location = fsio.resolve(s3_root.url, s3_server.storage_options(s3_fault_proxy.endpoint, **NO_HTTP_RETRIES))
    path = fsio.join(location.path, "__0_0.distcp")
    writer = _write_shard(location.fs, path, tensors=20)
    names = ["state"] + [f"t{i}" for i in range(len(writer.chunks) - 1)]
    full = choose_reads_to_verify(writer.chunks, writer.blocks, VerifyConfig(mode="full"), random.Random(0))
    s3_fault_proxy.clear()
    fault = s3_fault_proxy.fail("GET", r"__0_0\.distcp$", status=503, code="ServiceUnavailable", times=1)
    before = retry.counters.total("retried.read_range")
    assert verify_reads(location.fs, path, full, names) == sum(length for _, length, _ in writer.chunks)
    assert fault.hits == 1 and len(s3_fault_proxy.requests("GET", r"__0_0\.distcp$")) == 2  # the span, again
    assert retry.counters.total("retried.read_range") == before + 1
