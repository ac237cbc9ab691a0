"""A format v5 group leader checks its members' summaries against the chunk counts of its own ranks only
(O(group), not O(world)), and catches the same wrong counts the whole world's count does."""

from __future__ import annotations

import pytest
import torch

from lightning_shardckpt.engine.format.chunk_layout import Layout
from lightning_shardckpt.engine.save.part_summary import PartSummary, summary_problems
from lightning_shardckpt.engine.save.save_layout import OBJECT, TENSOR, ItemLayout, SaveLayout

WORLD = 12


def _layout() -> SaveLayout:
    """Rows of an 8-row tensor over 12 ranks (ranks 8-11 hold none, as FSDP2 leaves them), a 2x3 mesh cut of a
    matrix on ranks 0-5, and an object written by rank 5."""
    items = {
        "rows": ItemLayout("rows", TENSOR, False, (8, 4), torch.float32, Layout(rank=0, split=((0, 8, 1),))),
        "mesh": ItemLayout("mesh", TENSOR, False, (4, 6), torch.float32, Layout(rank=0, split=((0, 2, 3), (1, 3, 1)))),
        "note": ItemLayout("note", OBJECT, False, rank=5),
    }
    return SaveLayout(items, WORLD, "d" * 16)


def _summaries(counts: dict[int, int], ranks: range) -> list[PartSummary]:
    return [
        PartSummary(
            rank,
            "d" * 16,
            chunks=counts[rank],
            file_bytes=8 if counts[rank] else None,
            part_checksum="0" * 16 if counts[rank] else None,
            verified_chunks=counts[rank],
        )
        for rank in ranks
    ]


@pytest.mark.parametrize("group", [range(0, 4), range(4, 8), range(8, 12), range(10, 12)])
def test_a_leader_counts_its_own_ranks_chunks_as_the_whole_worlds_count_does(group):
    layout = _layout()
    world = layout.chunks_per_rank()
    assert world == [2, 2, 2, 2, 2, 3, 1, 1, 0, 0, 0, 0]
    assert layout.chunks_per_rank(group) == world[group.start : group.stop]
    counts = dict(enumerate(world))
    assert summary_problems(_summaries(counts, group), layout, "sample", group) == []


def test_a_leader_names_a_member_that_wrote_another_number_of_chunks_than_its_layout_gives_it():
    layout = _layout()
    counts = dict(enumerate(layout.chunks_per_rank()))
    counts[5] = 2  # rank 5 left out its object
    counts[9] = 1  # rank 9 wrote a chunk no layout gives it
    assert summary_problems(_summaries(counts, range(4, 8)), layout, "sample", range(4, 8)) == [
        "rank 5 wrote 2 chunk(s), its layout gives it 3"
    ]
    assert summary_problems(_summaries(counts, range(8, 12)), layout, "sample", range(8, 12)) == [
        "rank 9 wrote 1 chunk(s), its layout gives it 0"
    ]


@pytest.mark.parametrize("world", [129, 256, 16_384, 16_385, 65_536, 100_000, 131_072, 262_144])
def test_rank_0_and_every_leader_each_hear_at_most_512_messages_to_131072_ranks_and_beyond(world):
    """Issue 46's bound on the two-step gather: rank 0 leads no group and hears the leaders; a leader hears its
    members. Groups grow as sqrt(world) past 16,384 ranks (128 a group up to there)."""
    from lightning_shardckpt.engine.format import groups

    size = groups.writer_group_size(world)
    count = groups.group_count(world, size)
    leaders = [groups.group_leader(g, size, world) for g in range(count)]
    assert 0 not in leaders and len(set(leaders)) == count
    assert all(leader in groups.group_ranks(g, size, world) for g, leader in enumerate(leaders))
    heard_by_rank_0, heard_by_a_leader = count, size - 1
    assert size == 128 or world > 16_384
    if world <= 131_072:
        assert heard_by_rank_0 <= 512 and heard_by_a_leader <= 512, (size, count)
    if world > 16_384:
        assert heard_by_rank_0 <= 2 * world**0.5 and heard_by_a_leader <= 2 * world**0.5
