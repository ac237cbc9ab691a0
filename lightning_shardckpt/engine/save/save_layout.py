"""The layout of a state being saved, known on every rank without asking the others (format v4).

DCP's save gathers every rank's plan on the coordinator to decide who writes each replicated item and to
build one global metadata: O(ranks x tensors) on one rank. Here each rank derives the same answer from
what it holds: a DTensor's mesh and placements say where every chunk is and which replica writes it
(coordinate 0 on the mesh dimensions it is replicated over); a plain tensor or object is written by rank 0,
or, when declared bit-identical on every rank, by the rank a deterministic balance assigns. Every rank
computes the same layout; its digest, compared in one all-reduce before writing (persist.py), proves it.
Ranks that disagree (different keys, submeshes) fall back to DCP's collective planning.

The result per item: a chunk_layout rule (or explicit list) for tensors, a writing rank for objects, and
whether this rank writes its own chunk.
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from ..collectives import group_ranks_of, rank_and_world
from ..format import chunk_layout
from ..format.checksum import checksum
from ..format.chunk_layout import Cell, Layout

TENSOR, OBJECT = "tensor", "object"


@dataclass
class ItemLayout:
    """One flattened item of the state: where its chunks are and who writes them."""

    fqn: str
    kind: str  # TENSOR | OBJECT
    writes_here: bool  # this rank writes its chunk of it (every tensor chunk of a rank is one cell)
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    layout: Layout | None = None  # tensors
    rank: int = 0  # objects: the rank that writes it
    own: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # tensors: this rank's chunk (offsets, sizes)
    properties: TensorProperties | None = field(default=None, repr=False)  # for DCP's .metadata (commit.py)

    @property
    def tensor_layout(self) -> Layout:
        """`layout` of a tensor's item (every tensor's has one; an object's has none)."""
        if self.layout is None:
            raise ValueError(f"{self.fqn} is an object: it has no chunk layout")
        return self.layout

    def describe(self) -> dict[str, Any]:
        """What the manifest lists for it (and what the ranks' digests compare)."""
        if self.kind == OBJECT:
            return {"fqn": self.fqn, "rank": self.rank}
        return {
            "fqn": self.fqn,
            "shape": list(self.shape),
            "dtype": str(self.dtype),
            "layout": self.tensor_layout.to_json(),
        }


@dataclass
class SaveLayout:
    """Every item's layout, as every rank derives it; `digest` is what the ranks compare before writing."""

    items: dict[str, ItemLayout]
    world_size: int
    digest: str
    mappings: dict[str, Any] = field(default_factory=dict, repr=False)  # fqn -> nested key path (DCP planner_data)

    def tensors(self) -> list[ItemLayout]:
        return [item for item in self.items.values() if item.kind == TENSOR]

    def objects(self) -> list[ItemLayout]:
        return [item for item in self.items.values() if item.kind == OBJECT]

    def chunk_count(self) -> int:
        return sum(chunk_layout.chunk_count(item.tensor_layout) for item in self.tensors()) + len(self.objects())

    def chunks_per_rank(self, ranks: range | None = None) -> list[int]:
        """How many chunks (records) each rank of `ranks` (None: every rank) must hold in its file, in rank
        order: what the coordinator, or a group's leader for its group, checks each part by. Only cells holding an
        element have records (chunk_layout.stored_cells). Tensors sharing a stored pattern (the ranks of their
        cells, and which are empty) are counted once per pattern: O(patterns x len(ranks)), not O(chunks), and
        not O(world) for a leader (at 131,072 ranks the whole world's count was 0.08 s of each leader's 0.09 s)."""
        ranks = range(self.world_size) if ranks is None else ranks
        counts = [0] * len(ranks)
        patterns: dict[tuple[Any, ...], tuple[ItemLayout, int]] = {}
        for item in self.tensors():
            key = chunk_layout.stored_pattern(item.tensor_layout, item.shape)
            first, seen = patterns.get(key, (item, 0))
            patterns[key] = (first, seen + 1)
        for item, times in patterns.values():
            for rank in chunk_layout.stored_ranks_within(item.tensor_layout, item.shape, ranks.start, ranks.stop):
                counts[rank - ranks.start] += times
        for item in self.objects():
            if item.rank in ranks:
                counts[item.rank - ranks.start] += 1
        return counts


def describe(state_dict: dict[str, Any], group: Any, identical: Callable[[str], bool] | None) -> SaveLayout | None:
    """The layout of `state_dict` (DCP's flattening), or None when it holds something only DCP's collective
    planning describes (a ShardedTensor)."""
    rank, world = rank_and_world(group)
    flat, mappings = flatten_state_dict(state_dict)
    items: dict[str, ItemLayout] = {}
    balanced: list[tuple[int, str]] = []  # (bytes, fqn) of replicated items whose writes are spread
    for fqn, value in flat.items():
        if isinstance(value, DTensor):
            items[fqn] = _dtensor_item(fqn, value, rank, world, group)
        elif isinstance(value, ShardedTensor):
            return None
        elif isinstance(value, torch.Tensor):
            items[fqn] = ItemLayout(
                fqn,
                TENSOR,
                False,
                tuple(value.shape),
                value.dtype,
                chunk_layout.replicated(0),
                own=((0,) * value.dim(), tuple(value.shape)),
                properties=TensorProperties.create_from_tensor(value),
            )
            if identical is not None and identical(fqn):
                balanced.append((value.numel() * value.element_size(), fqn))
        else:
            items[fqn] = ItemLayout(fqn, OBJECT, False)
            if identical is not None and identical(fqn):
                balanced.append((0, fqn))
    owners = _balance(balanced, world)
    for fqn, item in items.items():
        if item.kind == OBJECT:
            item.rank = owners.get(fqn, 0)
            item.writes_here = item.rank == rank
        elif item.tensor_layout.is_rule and not item.tensor_layout.split and not isinstance(flat[fqn], DTensor):
            item.layout = chunk_layout.replicated(owners.get(fqn, 0))
            item.writes_here = item.layout.rank == rank
    digest = checksum(
        json.dumps([items[fqn].describe() for fqn in sorted(items)], sort_keys=True, separators=(",", ":")).encode()
    )
    return SaveLayout(items, world, digest, mappings)


def _balance(items: list[tuple[int, str]], world: int) -> dict[str, int]:
    """Replicated items declared identical, spread over the ranks: largest first, each to the rank with the
    fewest bytes so far (the lowest such rank), as every rank computes it alike."""
    loads = [(0, rank) for rank in range(world)]
    owners: dict[str, int] = {}
    for nbytes, fqn in sorted(items, key=lambda item: (-item[0], item[1])):
        load, rank = heapq.heappop(loads)
        owners[fqn] = rank
        heapq.heappush(loads, (load + max(nbytes, 1), rank))
    return owners


# (shape, mesh shape, mesh ranks, placements) -> explicit cells: computed once per process and layout
_EXPLICIT_CACHE: dict[tuple, tuple[Cell, ...]] = {}


def _dtensor_item(fqn: str, tensor: DTensor, rank: int, world: int, group: Any) -> ItemLayout:
    mesh = tensor.device_mesh
    shape = tuple(tensor.shape)
    placements = tuple(tensor.placements)
    mesh_shape = tuple(mesh.shape)
    ranks = _mesh_group_ranks(mesh, group)  # group rank at each mesh coordinate, row-major
    layout = _rule(mesh_shape, ranks, placements)
    coordinate = mesh.get_coordinate()
    own = None
    if coordinate is not None:
        sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)
        own = (tuple(offsets), tuple(sizes))
        grid = [c for c, p in zip(coordinate, placements) if type(p) is Shard]
        # the rule must put this rank's own chunk where DTensor (and so DCP) puts it; else spell it out
        if layout is not None and chunk_layout.cell_at(layout, shape, grid) != Cell(*own, layout.rank_at(grid)):
            layout = None
    if layout is None:
        layout = Layout(chunks=_explicit_cells(shape, mesh_shape, ranks, placements))
    writes_here = False
    if coordinate is not None:
        writer = ranks[_flat_index(_writer_coordinate(coordinate, placements), mesh_shape)]
        writes_here = writer == rank
    return ItemLayout(
        fqn,
        TENSOR,
        writes_here,
        shape,
        tensor.dtype,
        layout,
        own=own,
        properties=TensorProperties.create_from_tensor(tensor.to_local()),
    )


def _rule(mesh_shape: tuple[int, ...], ranks: tuple[int, ...], placements: tuple[Any, ...]) -> Layout | None:
    """The rule for Shard/Replicate placements over a mesh whose ranks step evenly along each dimension;
    None for anything else (strided shards, partial placements, irregular meshes)."""
    if not all(type(p) is Shard or isinstance(p, Replicate) for p in placements):
        return None
    strides = _mesh_strides(mesh_shape, ranks)
    if strides is None:
        return None
    split = tuple((p.dim, mesh_shape[m], strides[m]) for m, p in enumerate(placements) if type(p) is Shard)
    return Layout(rank=ranks[0], split=split)


_STRIDES: dict[tuple, tuple[int, ...] | None] = {}


def _mesh_strides(mesh_shape: tuple[int, ...], ranks: tuple[int, ...]) -> tuple[int, ...] | None:
    """Rank steps along each mesh dimension when rank(coordinate) = rank(0) + sum(coordinate * step) holds
    for the whole mesh (checked once per mesh: O(mesh size)), else None."""
    key = (mesh_shape, ranks)
    if key not in _STRIDES:
        strides = []
        for dim in range(len(mesh_shape)):
            unit = [1 if d == dim else 0 for d in range(len(mesh_shape))]
            strides.append(ranks[_flat_index(unit, mesh_shape)] - ranks[0] if mesh_shape[dim] > 1 else 0)
        affine = all(
            ranks[_flat_index(coordinate, mesh_shape)] == ranks[0] + sum(c * s for c, s in zip(coordinate, strides))
            for coordinate in itertools.product(*(range(n) for n in mesh_shape))
        )
        _STRIDES[key] = tuple(strides) if affine and all(s >= 0 for s in strides) else None
    return _STRIDES[key]


def _explicit_cells(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], ranks: tuple[int, ...], placements: tuple[Any, ...]
) -> tuple[Cell, ...]:
    key = (shape, mesh_shape, ranks, tuple(repr(p) for p in placements))
    cells = _EXPLICIT_CACHE.get(key)
    if cells is None:
        out = []
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            if list(coordinate) != _writer_coordinate(coordinate, placements):
                continue  # a replica: written by its coordinate-0 twin
            sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)
            out.append(Cell(tuple(offsets), tuple(sizes), ranks[_flat_index(coordinate, mesh_shape)]))
        cells = _EXPLICIT_CACHE[key] = tuple(out)
    return cells


def _writer_coordinate(coordinate: Any, placements: tuple[Any, ...]) -> list[int]:
    """The replica that writes a chunk: the same coordinate, 0 along every mesh dimension that does not shard."""
    return [c if isinstance(p, Shard) else 0 for c, p in zip(coordinate, placements)]


def _flat_index(coordinate: Any, mesh_shape: tuple[int, ...]) -> int:
    index = 0
    for c, n in zip(coordinate, mesh_shape):
        index = index * n + c
    return index


_MESH_RANKS: dict[tuple, tuple[int, ...]] = {}


def _mesh_group_ranks(mesh: Any, group: Any) -> tuple[int, ...]:
    global_ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    key = (global_ranks, id(group))
    if key not in _MESH_RANKS:
        _MESH_RANKS[key] = group_ranks_of(global_ranks, group)
    return _MESH_RANKS[key]
