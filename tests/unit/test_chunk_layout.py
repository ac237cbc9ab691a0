"""A layout rule names exactly the chunks DTensor (and so DCP) writes: every rank's box, empty shards included,
for 1-D and 2-D meshes, uneven splits and two mesh dimensions cutting one tensor dimension; and a reader of
a box gets exactly the cells that overlap it."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from lightning_shardckpt.engine.format import chunk_layout
from lightning_shardckpt.engine.format.chunk_layout import Layout


def _rule(mesh_shape, placements) -> Layout:
    """The rule save_layout derives for a row-major mesh of ranks 0..N-1."""
    strides = [1] * len(mesh_shape)
    for dim in range(len(mesh_shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * mesh_shape[dim + 1]
    split = tuple((p.dim, mesh_shape[m], strides[m]) for m, p in enumerate(placements) if isinstance(p, Shard))
    return Layout(rank=0, split=split)


def _dtensor_boxes(shape, mesh_shape, placements) -> set:
    """(offsets, sizes, rank) of every chunk DCP writes: the coordinate-0 replica of each shard writes it."""
    boxes = set()
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        if any(c and not isinstance(p, Shard) for c, p in zip(coordinate, placements)):
            continue
        sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)
        rank = 0
        for c, n in zip(coordinate, mesh_shape):
            rank = rank * n + c
        boxes.add((tuple(offsets), tuple(sizes), rank))
    return boxes


def test_rules_name_the_chunks_dtensor_writes_on_random_shapes_meshes_and_placements():
    rng = random.Random(35)
    cases = 0
    for _ in range(400):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.randint(0, 13) for _ in range(ndim))
        mesh_shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        placements = tuple(rng.choice([Replicate(), Shard(rng.randrange(ndim))]) for _ in mesh_shape)
        layout = _rule(mesh_shape, placements)
        cells = {(c.offsets, c.sizes, c.rank) for c in chunk_layout.cells(layout, shape)}
        assert cells == _dtensor_boxes(shape, mesh_shape, placements), (shape, mesh_shape, placements)
        assert chunk_layout.chunk_count(layout) == len(cells)
        assert sorted(chunk_layout.ranks_of(layout)) == sorted(c[2] for c in cells)
        # each cell alone, as a rank finds its own without visiting the others
        for index, grid in enumerate(itertools.product(*(range(pieces) for _, pieces, _ in layout.split))):
            cell = chunk_layout.cell_at(layout, shape, grid)
            assert (cell.offsets, cell.sizes, cell.rank) in cells, (index, grid)
        cases += 1
    assert cases == 400


def test_a_box_gets_exactly_the_cells_that_share_an_element_with_it():
    rng = random.Random(7)
    for _ in range(300):
        shape = (rng.randint(1, 40), rng.randint(1, 9))
        layout = Layout(rank=0, split=((0, rng.randint(1, 9), 1), (1, rng.randint(1, 3), 16)))
        start = [rng.randrange(n) for n in shape]
        box = (tuple(start), tuple(rng.randint(1, n - s) for s, n in zip(start, shape)))
        expected = [
            c
            for c in chunk_layout.cells(layout, shape)
            if all(o < bo + bs and bo < o + s and s > 0 for o, s, bo, bs in zip(c.offsets, c.sizes, *box))
        ]
        assert list(chunk_layout.cells_within(layout, shape, box)) == expected


def test_layout_problems_name_what_is_wrong():
    assert chunk_layout.layout_problems({"rank": 0, "split": [[1, 2, 1]]}, [4], 2) == [
        "layout.split[0] cuts dimension 1 of a 1-d tensor"
    ]
    assert "but 2 ranks wrote" in chunk_layout.layout_problems({"rank": 0, "split": [[0, 3, 1]]}, [4], 2)[0]
    assert chunk_layout.layout_problems({"rank": 1, "split": []}, [4], 2) == []
    assert chunk_layout.layout_problems({"chunks": [[[0], [4], 0]]}, [4], 1) == []


@settings(max_examples=300, deadline=None)
@given(
    base=st.integers(0, 40),
    split=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6), st.integers(0, 9)), max_size=3),
    first=st.integers(0, 120),
    width=st.integers(0, 60),
)
def test_a_leaders_share_of_the_ranks_is_the_worlds_restricted_to_its_group(base, split, first, width):
    """A group leader counts only its ranks' chunks (ranks_within), and gets exactly what counting the whole
    world's (ranks_of) and keeping its range gives, once per chunk, for any rule (zero strides included)."""
    layout = Layout(rank=base, split=tuple(split))
    stop = first + width
    expected = sorted(r for r in chunk_layout.ranks_of(layout) if first <= r < stop)
    assert sorted(chunk_layout.ranks_within(layout, first, stop)) == expected


def test_a_listed_layouts_share_of_the_ranks_keeps_each_chunk():
    cells = tuple(chunk_layout.Cell((i,), (1,), rank) for i, rank in enumerate([3, 1, 3, 7, 2]))
    assert sorted(chunk_layout.ranks_within(Layout(chunks=cells), 2, 7)) == [2, 3, 3]
