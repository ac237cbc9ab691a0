"""Neighbouring small chunks of one shard file, read in one request (issue 46: no request storm on one object).

A resharded resume reads, from each shard file it needs, every chunk overlapping its share: with an FSDP2 model
that is one small chunk per tensor (a few rows each), neighbours in the file. One range request per chunk made
about a thousand requests per rank to one object for a 1,000-tensor model (8 M GETs for a 16,384 -> 8,192 resume).
Here the reader's chunks (in file and offset order) are grouped into runs: consecutive chunks of one file, each at
most SMALL_CHUNK_BYTES, at most GAP_BYTES apart, RUN_MAX_BYTES in all. A run of two or more is read with one range
request when its first chunk comes up, and its chunks are served from memory (InMemoryShard), checked exactly as
bytes read from storage are: only the number of requests changes. Large chunks keep their own reads (direct into
the targets, several threads for one chunk).
"""

from __future__ import annotations

from typing import Any, Protocol

from .chunk_reads import InMemoryShard, ShardFile

SMALL_CHUNK_BYTES = 1 * 2**20  # a chunk this size or smaller joins a run; a larger one is its own request anyway
GAP_BYTES = 64 * 2**10  # bytes between two chunks of a run that are read for nothing (other ranks' rows' records)
# one run's bytes, held in memory until its chunks are placed (beside the read-ahead's 256 MiB by default): a
# 16,384-rank FSDP2 shard of a 1,000-tensor, ~100 B-parameter model is ~20 MB of small chunks, one run
RUN_MAX_BYTES = 64 * 2**20


class Chunk(Protocol):
    relative_path: str
    offset: int
    length: int


class CoalescedReads:
    """The runs of `chunks` (the reader's, in file and offset order), and the bytes of the run being served."""

    def __init__(self, chunks: list[Any]) -> None:
        self._run_of: dict[tuple[str, int], tuple[str, int, int]] = {}  # (file, offset) -> (file, start, end)
        self._runs = 0
        self._current: tuple[tuple[str, int, int], InMemoryShard] | None = None
        run: list[Any] = []
        for chunk in [*chunks, None]:
            if chunk is not None and run and _joins(run, chunk):
                run.append(chunk)
                continue
            if len(run) >= 2:
                span = (run[0].relative_path, run[0].offset, run[-1].offset + run[-1].length)
                self._runs += 1
                for member in run:
                    self._run_of[(member.relative_path, member.offset)] = span
            run = [chunk] if chunk is not None and chunk.length <= SMALL_CHUNK_BYTES else []

    @property
    def runs(self) -> int:
        """Runs of two chunks or more: one request each."""
        return self._runs

    def serve(self, chunk: Chunk, shard: ShardFile) -> InMemoryShard | None:
        """The in-memory bytes of `chunk`'s run (read now, in one request, if it is a run's first chunk), or None
        when the chunk is read on its own."""
        span = self._run_of.get((chunk.relative_path, chunk.offset))
        if span is None:
            return None
        if self._current is None or self._current[0] != span:
            _, start, end = span
            data = bytearray(max(0, min(end, shard.size) - start))
            filled = shard.read_into(start, memoryview(data)) if data else 0
            # a file cut short: the run holds what it holds, and each chunk's check names its short read
            self._current = (span, InMemoryShard(shard.path, shard.size, [(start, bytes(data[:filled]))]))
        return self._current[1]


def _joins(run: list[Any], chunk: Any) -> bool:
    last = run[-1]
    return (
        chunk.relative_path == last.relative_path
        and chunk.length <= SMALL_CHUNK_BYTES
        and 0 <= chunk.offset - (last.offset + last.length) <= GAP_BYTES
        and chunk.offset + chunk.length - run[0].offset <= RUN_MAX_BYTES
    )
