"""`shardckpt compare A B`: per global tensor, how two checkpoints differ numerically.

Global tensors, not shards: A saved on 4 ranks and B on 2 compare tensor by tensor (each assembled from
its chunks, every byte checked; engine/load/global_tensors.py). At most one tensor of each checkpoint is in
memory at a time, and the statistics run over blocks of BLOCK elements, so temporaries stay small too.

Per tensor: `equal` (bit for bit), `max_abs` (largest |B - A| over elements finite in both),
`relative` (max_abs / largest |A|: the change relative to the tensor's scale), and the NaN/Inf counts
of each side. Rows are sorted by change: tensors that became non-finite first, then by `relative`,
then `max_abs`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..engine.load.global_tensors import GlobalTensorReader, TensorSpec
from .progress import progress

BLOCK = 1 << 22  # elements per statistics block: each float64 temporary is 32 MiB, whatever the tensor size
TINY = 1e-30  # |A| below this counts as zero scale: `relative` is then max_abs itself
EQUAL, CHANGED, SHAPE, ONLY_A, ONLY_B = "equal", "changed", "shape_differs", "only_a", "only_b"


@dataclass
class TensorChange:
    """How one global tensor differs from A to B."""

    fqn: str
    status: str  # equal | changed | shape_differs | only_a | only_b
    shape_a: list[int] | None = None
    shape_b: list[int] | None = None
    dtype: str | None = None
    max_abs: float | None = None
    relative: float | None = None
    nonfinite_a: int = 0
    nonfinite_b: int = 0
    files_a: list[str] | None = None
    files_b: list[str] | None = None

    @property
    def became_nonfinite(self) -> bool:
        return self.nonfinite_b > self.nonfinite_a

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_readers(
    a: GlobalTensorReader, b: GlobalTensorReader, fqns: list[str] | None = None, *, progress_bar: bool | None = None
) -> list[TensorChange]:
    """Every tensor of A and B (or only `fqns`), sorted by change, largest first; `progress_bar`: tensors
    compared so far on stderr (None: when stderr is a terminal)."""
    names = sorted(set(a.specs) | set(b.specs)) if fqns is None else fqns
    changes = []
    with progress(len(names), "compare", unit="tensor", wanted=progress_bar) as bar:
        for fqn in names:
            changes.append(_compare_one(a, b, fqn))
            bar.update(1)
    changes.sort(key=change_order)
    return changes


def change_order(change: TensorChange) -> tuple:
    """Sort key: newly non-finite first, then the larger relative and absolute change; ties by name."""
    relative = change.relative if change.relative is not None and not math.isnan(change.relative) else -1.0
    max_abs = change.max_abs if change.max_abs is not None else -1.0
    missing = change.status in (ONLY_A, ONLY_B, SHAPE)
    return (not change.became_nonfinite, not missing, -relative, -max_abs, change.fqn)


def summary(changes: list[TensorChange]) -> dict[str, int]:
    counts = {EQUAL: 0, CHANGED: 0, SHAPE: 0, ONLY_A: 0, ONLY_B: 0}
    for change in changes:
        counts[change.status] += 1
    counts["became_nonfinite"] = sum(change.became_nonfinite for change in changes)
    return counts


def _compare_one(a: GlobalTensorReader, b: GlobalTensorReader, fqn: str) -> TensorChange:
    spec_a, spec_b = a.specs.get(fqn), b.specs.get(fqn)
    either = spec_b or spec_a
    assert either is not None  # fqn comes from one side's specs or the other's
    change = TensorChange(
        fqn,
        CHANGED,
        _shape(spec_a),
        _shape(spec_b),
        str(either.dtype),
        files_a=_files(spec_a),
        files_b=_files(spec_b),
    )
    if spec_a is None or spec_b is None:
        change.status = ONLY_B if spec_a is None else ONLY_A
        count = nonfinite_count((b if spec_a is None else a).read(fqn))
        change.nonfinite_a, change.nonfinite_b = (0, count) if spec_a is None else (count, 0)
        return change
    if spec_a.shape != spec_b.shape:
        change.status = SHAPE
        return change
    tensor_a = a.read(fqn)
    tensor_b = b.read(fqn)  # one tensor of each checkpoint: the most this ever holds
    change.nonfinite_a, change.nonfinite_b = nonfinite_count(tensor_a), nonfinite_count(tensor_b)
    change.max_abs, change.relative, equal = _differences(tensor_a, tensor_b)
    change.status = EQUAL if equal else CHANGED
    return change


def nonfinite_count(tensor: torch.Tensor) -> int:
    """NaN and ±Inf elements, counted block by block (0 for integer tensors)."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return 0
    flat = tensor.reshape(-1)
    return sum(int((~torch.isfinite(flat[start : start + BLOCK])).sum()) for start in range(0, flat.numel(), BLOCK))


def _differences(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, bool]:
    """(max_abs, relative, bit-equal) over blocks; a dtype change (export-style) is compared by value."""
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    equal = a.dtype == b.dtype
    max_abs = scale = 0.0
    for start in range(0, flat_a.numel(), BLOCK):
        block_a, block_b = flat_a[start : start + BLOCK], flat_b[start : start + BLOCK]
        if equal:  # bit for bit: NaN == NaN here, and -0.0 != 0.0
            equal = bool(torch.equal(_bits(block_a), _bits(block_b)))
        wide_a, wide_b = block_a.to(torch.float64), block_b.to(torch.float64)
        both = torch.isfinite(wide_a) & torch.isfinite(wide_b)
        if bool(both.any()):
            max_abs = max(max_abs, float((wide_b[both] - wide_a[both]).abs().max()))
            scale = max(scale, float(wide_a[both].abs().max()))
    relative = max_abs / scale if scale > TINY else max_abs
    return max_abs, relative, equal


def _bits(block: torch.Tensor) -> torch.Tensor:
    return block.view(torch.uint8) if block.is_floating_point() or block.is_complex() else block


def _shape(spec: TensorSpec | None) -> list[int] | None:
    return None if spec is None else list(spec.shape)


def _files(spec: TensorSpec | None) -> list[str] | None:
    return None if spec is None else spec.files
