"""ShardedStrategy(parallelism="fsdp") mesh sizes: data-parallel over every rank unless sizes are given."""

from __future__ import annotations

import pytest

from lightning_shardckpt.errors import ConfigError
from lightning_shardckpt.lightning.parallelism import mesh_sizes


def test_no_sizes_shard_over_every_rank():
    assert mesh_sizes("auto", "auto", 4) == (4, 1)


def test_one_size_given_fills_the_other_and_both_given_are_kept():
    assert mesh_sizes("auto", 2, 4) == (2, 2)
    assert mesh_sizes(2, "auto", 8) == (2, 4)
    assert mesh_sizes(1, 4, 4) == (1, 4)


@pytest.mark.parametrize("dp,tp", [(3, "auto"), ("auto", 3), (2, 3)])
def test_sizes_that_do_not_make_the_world_size_are_refused_with_the_fix(dp, tp):
    with pytest.raises(ConfigError, match="world size 4"):
        mesh_sizes(dp, tp, 4)


@pytest.mark.parametrize("dp,tp", [("2", "2"), ("2", 2), (2, 0), (True, 4)])
def test_sizes_that_are_not_whole_numbers_are_refused_by_name_not_multiplied(dp, tp):
    # "2" × "2" was a TypeError, "2" × 2 the string "22": both passed the check's arithmetic, not the option's
    with pytest.raises(ConfigError, match="is not a mesh size"):
        mesh_sizes(dp, tp, 4)
