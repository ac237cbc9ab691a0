"""A drill rank restores into the memory its warm pool keeps (policies/drills/pool.py): each tensor is a view
of the rank's region, and the region is all NaN bytes before the load, so nothing an earlier drill left
there can pass for a restored tensor: a tensor the load did not write fails the non-finite check."""

from __future__ import annotations

import pytest
import torch

from lightning_shardckpt.policies.drills.pool import destination_bytes
from lightning_shardckpt.policies.drills.worker import DrillFailed, build_target, check_finite

MANIFEST = {
    "tensors": [
        {"fqn": "model.weight", "shape": [5, 3], "dtype": "torch.float32"},
        {"fqn": "model.half", "shape": [7], "dtype": "torch.bfloat16"},
        {"fqn": "step", "shape": [], "dtype": "torch.int64"},
    ],
    "objects": [{"fqn": "lightning"}],
}


def test_a_drill_rank_restores_into_its_region_which_holds_no_earlier_drills_bytes():
    region = bytearray(destination_bytes(MANIFEST, 1))
    assert len(region) == 64 + 64 + 64  # each tensor on its own 64-byte boundary
    region[:] = torch.ones(len(region) // 4).numpy().tobytes()  # what an earlier drill restored: finite values
    target = build_target(MANIFEST, None, memoryview(region))
    base = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
    for fqn in ("model.weight", "model.half", "step"):
        assert base <= target[fqn].data_ptr() < base + len(region), f"{fqn} is not in the pool's region"
    assert target["model.weight"].shape == (5, 3) and target["model.half"].dtype == torch.bfloat16
    assert target["lightning"] is None
    with pytest.raises(DrillFailed, match="model.weight, model.half"):
        check_finite(MANIFEST, target)  # nothing restored yet: every float byte is NaN, not the earlier 1.0
    target["model.weight"].fill_(2.0)
    target["model.half"].fill_(3.0)
    assert check_finite(MANIFEST, target) == []


def test_a_region_too_small_for_the_manifest_falls_back_to_allocated_tensors():
    target = build_target(MANIFEST, None, memoryview(bytearray(64)))
    assert target["model.weight"].shape == (5, 3)  # the first fits the region, the rest are allocated
    assert target["model.half"].shape == (7,) and target["step"].shape == ()
