"""Where the chunks of one saved tensor are (format v4): a rule, or a list when no rule describes them.

A v4 manifest lists each tensor once, with its `layout`, never its chunks: those are in the parts
(parts.py) of the ranks that wrote them. The layout says which chunks exist and which rank wrote each:

- a **rule** `{"rank": r0, "split": [[dim, pieces, stride], ...]}`: the tensor is cut by each split entry in
  order; an entry cuts tensor dimension `dim` (within the range the earlier entries on that dimension left)
  into `pieces` pieces as `torch.chunk` and DTensor's `Shard` do: with n elements, c = ceil(n / pieces) and
  piece i is [i*c, min((i+1)*c, n)); pieces past the end are empty, and an empty piece's offset along `dim`
  is the tensor's whole size there (DTensor's convention, which DCP records). One chunk per cell of the
  grid; cell (i_1, ..., i_k) was written by rank r0 + i_1*stride_1 + ... + i_k*stride_k. No split: one chunk,
  the whole tensor, written by r0 (a replicated tensor).
- a **list** `{"chunks": [[offsets, sizes, rank], ...]}`: every chunk spelled out (a layout no rule fits).

A cell that holds no element (an empty piece: FSDP2's ranks past the last row) has no record: its rank writes
nothing for it, and no reader needs one (`stored_cells`, FORMAT.md §10.1). At 16,384 ranks half of an FSDP2
model's cells are empty; each record of zero elements cost a DCP header (~1.5 KB) and a part entry.

"Row-sharded evenly over 16,384 ranks" is then `{"rank": 0, "split": [[0, 16384, 1]]}`, a few bytes instead
of 16,384 entries. Pure Python: `shardckpt` and independent readers use it without torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

RULE_RANK, RULE_SPLIT, LIST_CHUNKS = "rank", "split", "chunks"

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True)
class Cell:
    """One chunk a layout describes: its place in the global tensor and the rank that wrote it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int


@dataclass(frozen=True)
class Layout:
    """A parsed `layout`: a rule (`split`, `rank`) or a list (`chunks`)."""

    rank: int = 0
    split: tuple[tuple[int, int, int], ...] = ()
    chunks: tuple[Cell, ...] | None = None

    @property
    def is_rule(self) -> bool:
        return self.chunks is None

    def to_json(self) -> dict[str, Any]:
        if self.chunks is not None:
            return {LIST_CHUNKS: [[list(c.offsets), list(c.sizes), c.rank] for c in self.chunks]}
        return {RULE_RANK: self.rank, RULE_SPLIT: [list(entry) for entry in self.split]}

    def rank_at(self, grid: list[int] | tuple[int, ...]) -> int:
        """The rank of a rule's cell at grid indices `grid` (one per split entry)."""
        return self.rank + sum(index * stride for index, (_, _, stride) in zip(grid, self.split))

    def pattern(self) -> tuple[Any, ...]:
        """What the ranks of the cells depend on (not the dimensions): layouts with one pattern put as many
        chunks on each rank, so a commit counts a pattern once however many tensors share it."""
        if self.chunks is not None:
            return ("list", tuple(c.rank for c in self.chunks))
        return ("rule", self.rank, tuple((pieces, stride) for _, pieces, stride in self.split))


def replicated(rank: int) -> Layout:
    """One chunk, the whole tensor, written by `rank`."""
    return Layout(rank=rank)


def from_json(value: Any) -> Layout:
    """A layout as the manifest holds it; ValueError naming what is wrong (layout_problems says it in full)."""
    problems = layout_problems(value, None, None)
    if problems:
        raise ValueError("; ".join(problems))
    if LIST_CHUNKS in value:
        return Layout(chunks=tuple(Cell(tuple(o), tuple(s), r) for o, s, r in value[LIST_CHUNKS]))
    return Layout(rank=value[RULE_RANK], split=tuple((d, p, s) for d, p, s in value[RULE_SPLIT]))


def layout_problems(value: Any, shape: list[int] | None, world_size: int | None) -> list[str]:
    """Why `value` is not a layout of a tensor of `shape` written by `world_size` ranks (either may be None:
    not checked). A list's chunks are checked for their types and ranks here; whether they tile the tensor is
    the manifest schema's tiling check."""
    if not isinstance(value, dict):
        return [f"layout {value!r} is not an object"]
    if LIST_CHUNKS in value:
        chunks = value[LIST_CHUNKS]
        if not isinstance(chunks, list):
            return ["layout.chunks is not a list"]
        for index, chunk in enumerate(chunks):
            if not (isinstance(chunk, list) and len(chunk) == 3 and _ints(chunk[0]) and _ints(chunk[1])):
                return [f"layout.chunks[{index}] is not [offsets, sizes, rank] with lists of integers >= 0"]
            if shape is not None and (len(chunk[0]) != len(shape) or len(chunk[1]) != len(shape)):
                return [f"layout.chunks[{index}] has {len(chunk[0])} offsets for a {len(shape)}-d tensor"]
            problem = _rank_problem(chunk[2], world_size, f"layout.chunks[{index}]")
            if problem:
                return [problem]
        return []
    rank, split = value.get(RULE_RANK), value.get(RULE_SPLIT)
    problem = _rank_problem(rank, world_size, "layout.rank")
    if problem:
        return [problem]
    if not isinstance(split, list):
        return [f"layout.split is {split!r}, not a list"]
    assert _is_int(rank)  # _rank_problem found none
    highest = rank
    for index, entry in enumerate(split):
        if not (isinstance(entry, list) and len(entry) == 3 and all(_is_int(x) for x in entry)):
            return [f"layout.split[{index}] is {entry!r}, not [dim, pieces, stride] integers"]
        dim, pieces, stride = entry
        if dim < 0 or (shape is not None and dim >= len(shape)):
            return [f"layout.split[{index}] cuts dimension {dim} of a {len(shape or [])}-d tensor"]
        if pieces < 1 or stride < 0:
            return [f"layout.split[{index}] has {pieces} pieces and stride {stride}; pieces >= 1, stride >= 0"]
        highest += (pieces - 1) * stride
    if world_size is not None and highest >= world_size:
        return [f"layout places a chunk on rank {highest}, but {world_size} ranks wrote the checkpoint"]
    return []


def cells(layout: Layout, shape: list[int] | tuple[int, ...]) -> Iterator[Cell]:
    """Every chunk of the tensor, in the order of the grid (the first split entry varies slowest)."""
    if layout.chunks is not None:
        yield from layout.chunks
        return
    yield from _cells(layout, tuple(shape), None)


def holds_elements(sizes: tuple[int, ...] | list[int]) -> bool:
    """Whether a chunk of these sizes holds an element (a scalar's, sizes (), does): only such chunks have records."""
    return math.prod(sizes) > 0


def stored_cells(layout: Layout, shape: list[int] | tuple[int, ...]) -> Iterator[Cell]:
    """The cells that have a record in their rank's part: those holding at least one element, in grid order."""
    for cell in cells(layout, shape):
        if holds_elements(cell.sizes):
            yield cell


def stored_ranks_within(layout: Layout, shape: list[int] | tuple[int, ...], first: int, stop: int) -> list[int]:
    """The ranks in [first, stop) that recorded a chunk of `layout` (an element-holding cell), once per chunk: what
    each rank's part must hold, without visiting the world's cells for a range of it (as ranks_within)."""
    if layout.chunks is not None:
        return [c.rank for c in layout.chunks if first <= c.rank < stop and holds_elements(c.sizes)]
    return [cell.rank for cell in _cells(layout, tuple(shape), None, (first, stop)) if holds_elements(cell.sizes)]


def stored_pattern(layout: Layout, shape: list[int] | tuple[int, ...]) -> tuple[Any, ...]:
    """What the ranks of the stored cells depend on: `pattern()` and, for a rule, the sizes of the dimensions it
    cuts (which pieces are empty). Layouts with one stored pattern put as many records on each rank."""
    if layout.chunks is not None:
        return ("list", tuple((c.rank, holds_elements(c.sizes)) for c in layout.chunks))
    return ("rule", layout.rank, layout.split, tuple(shape[dim] for dim, _, _ in layout.split), holds_elements(shape))


def cells_within(layout: Layout, shape: list[int] | tuple[int, ...], box: Box) -> Iterator[Cell]:
    """The chunks that share at least one element with `box` (offsets, sizes): what a reader of that box needs.
    Only the pieces overlapping the box are visited, so a rank of 16,384 finds its one or two rows at once."""
    offsets, sizes = box
    if shape and math.prod(sizes) == 0:
        return
    if layout.chunks is not None:
        for cell in layout.chunks:
            if _overlaps(cell.offsets, cell.sizes, offsets, sizes):
                yield cell
        return
    yield from _cells(layout, tuple(shape), (tuple(offsets), tuple(sizes)))


def cell_at(layout: Layout, shape: list[int] | tuple[int, ...], grid: list[int] | tuple[int, ...]) -> Cell:
    """A rule's cell at grid indices `grid` (one per split entry), without visiting the others."""
    start, size = [0] * len(shape), list(shape)
    for (dim, pieces, _), index in zip(layout.split, grid):
        piece = -(-size[dim] // pieces) if size[dim] else 0
        lo = index * piece
        if lo >= size[dim]:
            start[dim], size[dim] = shape[dim], 0
        else:
            start[dim], size[dim] = start[dim] + lo, min(size[dim], lo + piece) - lo
    return Cell(tuple(start), tuple(size), layout.rank_at(grid))


def chunk_count(layout: Layout) -> int:
    """How many cells the layout describes, empty pieces included (an upper bound on its records: stored_cells)."""
    if layout.chunks is not None:
        return len(layout.chunks)
    return math.prod(pieces for _, pieces, _ in layout.split)


def ranks_of(layout: Layout) -> list[int]:
    """The rank of every chunk, in grid order (a rank appears once per chunk it wrote)."""
    if layout.chunks is not None:
        return [cell.rank for cell in layout.chunks]
    ranks = [layout.rank]
    for _, pieces, stride in layout.split:
        ranks = [rank + i * stride for rank in ranks for i in range(pieces)]
    return ranks


def ranks_within(layout: Layout, first: int, stop: int) -> list[int]:
    """The ranks in [first, stop) that wrote a chunk of `layout`, once per chunk: a group leader's share of
    `ranks_of`, in O(its chunks) rather than O(the world's) (strides are >= 0, so a branch of the grid whose
    lowest and highest ranks both miss the range is skipped whole)."""
    if layout.chunks is not None:
        return [cell.rank for cell in layout.chunks if first <= cell.rank < stop]
    split = layout.split
    reach = [0] * (len(split) + 1)  # reach[k]: the most entries k, k+1, ... add to a rank
    for k in range(len(split) - 1, -1, -1):
        reach[k] = reach[k + 1] + (split[k][1] - 1) * split[k][2]
    found: list[int] = []

    def walk(k: int, rank: int) -> None:
        if rank >= stop or rank + reach[k] < first:
            return
        if k == len(split):
            found.append(rank)
            return
        _, pieces, stride = split[k]
        if stride == 0:
            for _ in range(pieces):
                walk(k + 1, rank)
            return
        low = max(0, -(-(first - rank - reach[k + 1]) // stride))
        for index in range(low, min(pieces, -(-(stop - rank) // stride))):
            walk(k + 1, rank + index * stride)

    walk(0, layout.rank)
    return found


def _cells(
    layout: Layout, shape: tuple[int, ...], box: Box | None, ranks: tuple[int, int] | None = None
) -> Iterator[Cell]:
    """The rule's cells overlapping `box` (None: all), of ranks in [first, stop) `ranks` (None: any)."""
    # per dimension, the (start, size) the entries so far left; a cell is complete after the last entry
    start = [0] * len(shape)
    size = list(shape)
    reach = [0] * (len(layout.split) + 1)  # reach[k]: the most entries k, k+1, ... add to a rank
    for k in range(len(layout.split) - 1, -1, -1):
        reach[k] = reach[k + 1] + (layout.split[k][1] - 1) * layout.split[k][2]

    def walk(entry: int, rank: int) -> Iterator[Cell]:
        if ranks is not None and (rank >= ranks[1] or rank + reach[entry] < ranks[0]):
            return  # strides are >= 0: no cell below this branch is of a wanted rank
        if entry == len(layout.split):
            if box is None or _overlaps(start, size, *box) or not shape:
                yield Cell(tuple(start), tuple(size), rank)
            return
        dim, pieces, stride = layout.split[entry]
        outer_start, outer_size = start[dim], size[dim]
        piece = -(-outer_size // pieces) if outer_size else 0
        first, last = 0, pieces - 1
        if box is not None and piece:  # only the pieces that reach into the box along this dimension
            low, high = box[0][dim], box[0][dim] + box[1][dim]
            first = max(0, (low - outer_start) // piece)
            last = min(pieces - 1, (high - 1 - outer_start) // piece)
        if ranks is not None and stride:  # only the pieces whose branch reaches a wanted rank
            first = max(first, -(-(ranks[0] - rank - reach[entry + 1]) // stride))
            last = min(last, -(-(ranks[1] - rank) // stride) - 1)
        for index in range(first, last + 1):
            lo = index * piece
            if lo >= outer_size:  # empty: DTensor puts it at the end of the whole dimension
                if box is not None:
                    continue  # holds nothing a reader needs
                start[dim], size[dim] = shape[dim], 0
            else:
                start[dim], size[dim] = outer_start + lo, min(outer_size, lo + piece) - lo
            yield from walk(entry + 1, rank + index * stride)
        start[dim], size[dim] = outer_start, outer_size

    yield from walk(0, layout.rank)


def _overlaps(a_offsets: Any, a_sizes: Any, b_offsets: Any, b_sizes: Any) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_ and as_ > 0 and bs > 0
        for ao, as_, bo, bs in zip(a_offsets, a_sizes, b_offsets, b_sizes)
    )


def _rank_problem(rank: Any, world_size: int | None, name: str) -> str | None:
    if not _is_int(rank) or rank < 0:
        return f"{name} is {rank!r}, not a rank (an integer >= 0)"
    if world_size is not None and rank >= world_size:
        return f"{name} is {rank}, but {world_size} ranks wrote the checkpoint"
    return None


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(_is_int(item) and item >= 0 for item in value)
