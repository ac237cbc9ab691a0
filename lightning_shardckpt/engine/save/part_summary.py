"""What a rank tells its group leader and the coordinator about its part of one save (`PartSummary`), and the
O(ranks) checks that those summaries make a checkpoint (`summary_problems`): shared by the rank that writes
(parts_save.py), the leaders of format v5's groups (group_summaries.py) and the committer (parts_commit.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .save_layout import SaveLayout


class PickledAsValues:
    """A dataclass pickled as a tuple of its values, not a dict of names to values: the coordinator (or a group's
    leader) unpickles one per rank, and names repeated per object are most of the bytes and the time."""

    __dataclass_fields__: dict[str, Any]

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__dataclass_fields__)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for name, value in zip(self.__dataclass_fields__, state):
            setattr(self, name, value)


@dataclass
class PartSummary(PickledAsValues):
    """What a rank tells the coordinator about its part of one save (and all the coordinator hears of it)."""

    rank: int
    layout_digest: str
    error: str | None = None
    chunks: int = 0
    file_bytes: int | None = None
    file_checksum: str | None = None
    part_bytes: int | None = None
    part_checksum: str | None = None
    part_digest: str | None = None  # signing on: the digest of the part's bytes, for the signed manifest
    verified_chunks: int = 0
    verified_bytes: int = 0
    bytes_total: int = 0
    write_s: float | None = None
    nonfinite: list[str] = field(default_factory=list)  # floating tensors with NaN/Inf in this rank's chunks
    part: dict[str, Any] | None = None  # the part itself, only when rank 0 writes DCP's .metadata
    # incremental: (sibling directory, holder rank, bytes, chunks) per file its referenced chunks are in
    referenced: list[tuple[str, int, int, int]] = field(default_factory=list)


def summary_problems(
    summaries: list[PartSummary | None], layout: SaveLayout, verify_mode: str, ranks: range | None = None
) -> list[str]:
    """Why the summaries of `ranks` (None: every rank) do not make a checkpoint: O(ranks) checks, never a chunk."""
    problems = []
    ranks = range(layout.world_size) if ranks is None else ranks
    if len(summaries) != len(ranks):
        problems.append(f"{len(summaries)} ranks reported, {len(ranks)} write the checkpoint")
    expected = layout.chunks_per_rank(ranks)
    for rank, summary in zip(ranks, summaries):
        if not isinstance(summary, PartSummary):
            problems.append(f"rank {rank} sent no summary")
            continue
        if summary.error is not None:
            problems.append(summary.error)
            continue
        if summary.rank != rank:
            problems.append(f"rank {rank} sent rank {summary.rank}'s summary")
        if summary.layout_digest != layout.digest:
            problems.append(f"rank {rank} planned another layout ({summary.layout_digest}, rank 0: {layout.digest})")
        if rank < layout.world_size and summary.chunks != expected[rank - ranks.start]:
            problems.append(
                f"rank {rank} wrote {summary.chunks} chunk(s), its layout gives it {expected[rank - ranks.start]}"
            )
        if summary.chunks and (summary.file_bytes is None or summary.part_checksum is None):
            problems.append(f"rank {rank} wrote chunks but reported no file or part")
        written = summary.chunks - sum(entry[3] for entry in summary.referenced)  # referenced ones are not
        if verify_mode != "off" and written and not summary.verified_chunks:
            problems.append(f"rank {rank}: no chunk was read back although verify.mode={verify_mode!r}")
    return problems
