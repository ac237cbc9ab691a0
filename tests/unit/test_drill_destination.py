"""A drill rank restores into its `Destination` (policies/drills/worker.py): a kept rank reuses the tensors while
the checkpoints' tensors keep their names, shapes and dtypes, and builds new ones when they change. Either way
every byte is NaN before the load, so nothing an earlier drill restored can pass for this checkpoint's values:
a tensor the load did not write fails the non-finite check."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_shardckpt.errors import ConfigError
from lightning_shardckpt.policies.drills.pool import destination_bytes
from lightning_shardckpt.policies.drills.runner import DrillOptions, host_memory_gib
from lightning_shardckpt.policies.drills.worker import Destination, DrillFailed, check_finite

MANIFEST = {
    "tensors": [
        {"fqn": "model.weight", "shape": [5, 3], "dtype": "torch.float32"},
        {"fqn": "model.half", "shape": [7], "dtype": "torch.bfloat16"},
        {"fqn": "step", "shape": [], "dtype": "torch.int64"},
    ],
    "objects": [{"fqn": "lightning"}],
}


def _restore_everything(target: dict) -> None:
    """What a load does: every element of every tensor written (finite values), every object replaced."""
    target["model.weight"].fill_(2.0)
    target["model.half"].fill_(3.0)
    target["step"].fill_(7)
    target["lightning"] = b"state"


def test_the_same_shapes_reuse_the_tensors_and_hand_them_out_all_nan_again():
    destination = Destination()
    first = destination.target(MANIFEST, 1)
    assert not destination.reused
    _restore_everything(first)
    assert check_finite(MANIFEST, first) == []
    destination.scrub()  # a kept rank does this after each drill, off the next one's clock

    second = destination.target(copy.deepcopy(MANIFEST), 1)
    assert destination.reused
    for fqn in ("model.weight", "model.half", "step"):
        assert second[fqn].data_ptr() == first[fqn].data_ptr(), f"{fqn} was allocated again"
    assert second["lightning"] is None  # objects are the load's to fill, never the last drill's
    assert second["step"].item() == -1  # 0xFF bytes
    with pytest.raises(DrillFailed, match="model.weight, model.half"):
        check_finite(MANIFEST, second)  # nothing restored yet: NaN, not the earlier 2.0 and 3.0


def test_a_load_that_leaves_a_reused_tensor_unwritten_fails_the_drill_even_without_a_scrub_call():
    destination = Destination()
    _restore_everything(destination.target(MANIFEST, 1))
    # no scrub() (a rank that died before it, say): target() fills the reused tensors itself
    again = destination.target(MANIFEST, 1)
    again["model.weight"].fill_(2.0)  # model.half is missing from what this load wrote
    with pytest.raises(DrillFailed, match="model.half"):
        check_finite(MANIFEST, again)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m["tensors"][0].update(shape=[6, 3]),
        lambda m: m["tensors"][1].update(dtype="torch.float16"),
        lambda m: m["tensors"][0].update(fqn="model.other"),
        lambda m: m["tensors"].pop(),
    ],
    ids=["shape", "dtype", "name", "one-tensor-fewer"],
)
def test_another_shape_dtype_or_tensor_list_rebuilds_the_destination(change):
    destination = Destination()
    first = destination.target(MANIFEST, 1)
    _restore_everything(first)
    manifest = copy.deepcopy(MANIFEST)
    change(manifest)
    second = destination.target(manifest, 1)
    assert not destination.reused
    assert {t["fqn"] for t in manifest["tensors"]} | {"lightning"} == set(second)
    for tensor in manifest["tensors"]:
        value = second[tensor["fqn"]]
        assert list(value.shape) == tensor["shape"] and str(value.dtype) == tensor["dtype"]
    assert torch.isnan(second[manifest["tensors"][0]["fqn"]]).all()


def test_destination_bytes_is_one_ranks_share_which_the_keep_bound_is_checked_against():
    assert destination_bytes(MANIFEST, 1) == 64 + 64 + 64  # each tensor counted on its own 64-byte boundary
    assert destination_bytes(MANIFEST, 2) == 64 + 64 + 64  # ceil(5/2) rows of 3 float32: still under 64 bytes
    unknown = {"tensors": [{"fqn": "x", "shape": [4], "dtype": "torch.float8_e4m3fn"}], "objects": []}
    assert destination_bytes(unknown, 1) == 0  # size unknown: its drills fork ranks, never kept


def test_keep_memory_above_this_hosts_memory_is_refused_naming_the_bound():
    too_much = host_memory_gib() * 2
    with pytest.raises(ConfigError, match=r"drill.keep_memory_gib=.*at most this host's .* GiB; 0: keep none"):
        DrillOptions(keep_memory_gib=too_much)
    assert DrillOptions(keep_memory_gib=0).keep_memory_gib == 0
