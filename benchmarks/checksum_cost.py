"""What block checksums cost the writer: one rank's shard written with and without them, side by side.

    python benchmarks/checksum_cost.py                  1 GiB in 64 MiB tensors, 3 rounds of each
    python benchmarks/checksum_cost.py --size-gib 0.25 --tensor-mib 16

Writes through the engine's ChunkFileWriter (the same record layout and hashing pass as a save) into
/dev/null, so only CPU is measured (the writing thread's `time.thread_time`): the record encoding and the
checksums (docs/FORMAT.md §3). Without blocks a chunk's checksum is one xxh3 pass over its bytes; with blocks
(`checksum_algorithm: xxh3_64_blocks`) it is the digest of the block digests, also one pass; before issue 36
(`xxh3_64`) the chunk checksum was a second pass beside the block digests. Prints CPU seconds per GiB and the
ratio measured in this run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import fsspec
import torch

from lightning_shardckpt.engine.format.checksum import block_size_for
from lightning_shardckpt.engine.storage import writer as storage

SINK = "/dev/null"


def write_seconds(tensors: list[torch.Tensor], *, blocks: bool) -> float:
    """CPU seconds (this thread) to write `tensors` as one shard file's chunks, with or without block checksums."""
    storage.block_size_for = block_size_for if blocks else (lambda nbytes: None)
    try:
        writer = storage.ChunkFileWriter(fsspec.filesystem("file"), SINK)
        started = time.thread_time()  # CPU, not wall: on a shared machine wall time measures the neighbours
        for tensor in tensors:
            writer.add_tensor(tensor)
        elapsed = time.thread_time() - started
        writer.close()
    finally:
        storage.block_size_for = block_size_for
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="bytes written per round, GiB")
    parser.add_argument("--tensor-mib", type=int, default=64, help="size of each tensor (one chunk each), MiB")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each, alternating; the median is reported")
    args = parser.parse_args(argv)
    count = max(1, round(args.size_gib * 1024 / args.tensor_mib))
    tensors = [torch.randn(args.tensor_mib * 2**20 // 4) for _ in range(count)]
    gib = count * args.tensor_mib / 1024
    write_seconds(tensors, blocks=True)  # warm-up: first touch of the writer's code paths
    plain, blocked = [], []
    for _ in range(args.repeats):
        plain.append(write_seconds(tensors, blocks=False) / gib)
        blocked.append(write_seconds(tensors, blocks=True) / gib)
    print(
        f"chunk checksum only:        {statistics.median(plain):.3f} CPU-s/GiB (min {min(plain):.3f}, max {max(plain):.3f})"
    )
    print(
        f"chunk + block checksums:    {statistics.median(blocked):.3f} CPU-s/GiB (min {min(blocked):.3f}, max {max(blocked):.3f})"
    )
    print(
        f"added by block checksums:   {statistics.median(blocked) - statistics.median(plain):+.3f} CPU-s/GiB, "
        f"{statistics.median(blocked) / statistics.median(plain):.2f}x the writer's CPU"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
