"""The read-back before commit: which pieces of a rank's shard file to read back, and reading them.

A piece is a small chunk whole, or one block of a large chunk (each block has its own checksum). `sample`
reads every piece overlapping one window of `fraction` of the file's bytes at a random byte, wrapping past the
end (choose_chunks_to_verify); `full` every chunk whole. Consecutive pieces are read as one span, one request
each where the storage allows (span_reads.py: on S3 one ranged GET, whose Content-Range also gives the file's
stored size). What this proves, and what the window gives up against pieces drawn one by one:
docs/GUARANTEES.md, "What the read-back proves".
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass
from functools import partial
from typing import Any

from ...errors import CorruptCheckpoint
from ..config import VerifyConfig
from ..format.checksum import ChunkHasher
from . import retry
from .backends import backend_for
from .chunk_reads import PIECE_BYTES, SHORT_READ


def choose_chunks_to_verify(lengths: list[int], policy: VerifyConfig, rng: random.Random) -> list[int]:
    """Indices of the pieces to read back, in file order: "sample" reads every piece that overlaps a window of
    `fraction` of the file's bytes at a random byte offset (wrapping past the end to the start), extended by the
    pieces after it to at least `min_chunks`.

    One window, not pieces scattered over the file: consecutive pieces are consecutive bytes, so the read-back is
    one ranged request (two when the window wraps), where scattered pieces cost one request each (11 GETs and a
    HEAD per rank at 1,000 tensors on S3). Every byte's piece is read with probability at least `fraction` (the
    window starts at a uniform byte and wraps); what one window gives up against scattered pieces is
    independence: see docs/GUARANTEES.md, "What the read-back proves".
    """
    if policy.mode == "off" or not lengths:
        return []
    if policy.mode == "full":
        return list(range(len(lengths)))
    count, total = len(lengths), sum(lengths)
    if total == 0:
        start, window = rng.randrange(count), 0
    else:
        at = rng.randrange(total)
        ends = list(itertools.accumulate(lengths))
        start = bisect.bisect_right(ends, at)  # the piece holding the window's first byte
        window = math.ceil(policy.fraction * total) - (ends[start] - at)  # the window's bytes after that piece
    chosen = [start] if policy.fraction > 0 or policy.min_chunks > 0 else []
    for step in range(1, count):
        if window <= 0 and len(chosen) >= policy.min_chunks:
            break
        index = (start + step) % count
        chosen.append(index)
        window -= lengths[index]
    return sorted(chosen)


@dataclass(frozen=True)
class VerifyRead:
    """One range read back before commit: a whole chunk, or one block of a chunk checksummed by block."""

    chunk: int  # index into the file's chunks
    offset: int
    length: int
    expected: str
    block: int | None = None  # the block's index in its chunk; None: the whole chunk
    block_size: int | None = None  # a whole chunk checksummed by block: its checksum is of its block digests


def choose_reads_to_verify(
    chunks: list[tuple[int, int, str]],
    blocks: list[tuple[int, tuple[str, ...]] | None],
    policy: VerifyConfig,
    rng: random.Random,
) -> list[VerifyRead]:
    """What to read back, in file order: "full" every chunk whole; "sample" every piece overlapping a window of
    `fraction` of the bytes at a random offset, at least `min_chunks` pieces (choose_chunks_to_verify), where a
    piece is a small chunk whole or one block of a large chunk.

    A large chunk is sampled by block, each checked against its own block checksum: min_chunks=1 once
    meant reading a whole 512 MiB tensor back (50x the 1% asked for, and most of a save's CPU).
    """
    if policy.mode == "full":
        return [
            VerifyRead(index, offset, length, digest, block_size=chunk_blocks[0] if chunk_blocks else None)
            for index, ((offset, length, digest), chunk_blocks) in enumerate(zip(chunks, blocks))
        ]
    pieces: list[VerifyRead] = []
    for index, ((offset, length, digest), chunk_blocks) in enumerate(zip(chunks, blocks)):
        if chunk_blocks is None:
            pieces.append(VerifyRead(index, offset, length, digest))
            continue
        size, digests = chunk_blocks
        pieces.extend(
            VerifyRead(index, offset + b * size, min(size, length - b * size), block_digest, b)
            for b, block_digest in enumerate(digests)
        )
    lengths = [piece.length for piece in pieces]
    chosen = choose_chunks_to_verify(lengths, policy, rng)
    return sorted((pieces[i] for i in chosen), key=lambda piece: piece.offset)


def verify_chunks(fs: Any, path: str, chunks: list[tuple[int, int, str]], indices: list[int], names: list[str]) -> None:
    """Read chosen chunks (ones without blocks: `add_bytes`'s) back whole from storage; raise CorruptCheckpoint
    naming each mismatch."""
    verify_reads(fs, path, [VerifyRead(i, *chunks[i]) for i in indices], names)


def verify_reads(fs: Any, path: str, reads: list[VerifyRead], names: list[str]) -> int | None:
    """Read `reads` back from storage; raise CorruptCheckpoint naming each mismatch (tensor, and block if one).
    Returns the file's size on storage as the reads found it (None: nothing was read).

    Reads that follow one another in the file are one span, read with one request where the storage allows
    (S3: one ranged GET, whose Content-Range also gives the file's size: no HEAD; span_reads.py); a sampled run
    is one span, or two where it wraps, and "full" is one. Each span streams through one reused piece buffer,
    hashed piece by piece: reading a chunk whole into fresh memory cost 3-4x as much CPU (a new allocation the
    chunk's size, faulted in page by page, on every save).
    """
    if not reads:
        return None
    backend = backend_for(fs)
    piece = memoryview(bytearray(min(PIECE_BYTES, max(read.length for read in reads))))
    problems: list[dict[str, Any]] = []
    stored: int | None = None
    for span in spans_of(reads):
        # a span is retried whole on a transient error (its request, or its body cut off midway)
        size, found = retry.call("read_range", partial(_check_span, backend, path, span, piece), target=path)
        stored = size if stored is None else stored
        problems.extend(_named(problem, names) for problem in found)
    if problems:
        raise CorruptCheckpoint(
            f"read-back verification failed for {len(problems)} chunk(s) of {path}: {problems}; "
            "the storage returned other bytes than were written, so this checkpoint will not commit",
            problems=problems,
        )
    return stored  # the file's size on storage, as the reads found it (the writer checks it: no extra request)


def _named(problem: dict[str, Any], names: list[str]) -> dict[str, Any]:
    named = {"file": problem["file"], "tensor": names[problem["chunk"]]}
    named.update((key, value) for key, value in problem.items() if key not in ("file", "chunk"))
    return named


def spans_of(reads: list[VerifyRead]) -> list[list[VerifyRead]]:
    """`reads` in file order, grouped into runs where each read starts where the one before it ends."""
    spans: list[list[VerifyRead]] = []
    for read in sorted(reads, key=lambda read: read.offset):
        if spans and spans[-1][-1].offset + spans[-1][-1].length == read.offset:
            spans[-1].append(read)
        else:
            spans.append([read])
    return spans


def _check_span(backend: Any, path: str, span: list[VerifyRead], piece: memoryview) -> tuple[int, list[dict]]:
    """(the file's size, a problem per read whose bytes do not match), reading the span once, in order."""
    start, stop = span[0].offset, span[-1].offset + span[-1].length
    stream = backend.open_span(path, start, stop)
    problems = []
    try:
        for read in span:
            actual = _read_back_checksum(stream, read.length, piece, read.block_size)
            if actual != read.expected:
                problem = {"file": path, "chunk": read.chunk, "expected": read.expected, "actual": actual}
                if read.block is not None:
                    problem["block"] = read.block
                problems.append(problem)
            if actual.startswith("<"):  # SHORT_READ: the file ends here, so the reads after it are not there either
                break
    finally:
        stream.close()
    return stream.size, problems


def _read_back_checksum(stream: Any, length: int, piece: memoryview, block_size: int | None = None) -> str:
    """The checksum of the stream's next `length` bytes, or '<n of length bytes>' if it ends first.
    `block_size`: a whole chunk checksummed by block (its checksum is the digest of its block digests)."""
    hasher = ChunkHasher(block_size)
    filled = 0
    while filled < length:
        view = piece[: min(len(piece), length - filled)]
        count = stream.readinto(view)
        hasher.update(view[:count])
        filled += count
        if count < len(view):
            return SHORT_READ.format(filled=filled, length=length)
    return hasher.hexdigest()
