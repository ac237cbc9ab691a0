"""RankZeroSavePlanner: replicated items come from rank 0 unless declared identical (then spread)."""

from __future__ import annotations

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from lightning_shardckpt.engine.save.persist import RankZeroSavePlanner


def _plans(world_size: int, fqns: list[str]) -> list[SavePlan]:
    return [
        SavePlan([WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO) for fqn in fqns])
        for _ in range(world_size)
    ]


def _writer_of(plans: list[SavePlan]) -> dict[str, list[int]]:
    writers: dict[str, list[int]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            writers.setdefault(item.index.fqn, []).append(rank)
    return writers


def test_items_not_declared_identical_are_written_by_rank_0_and_identical_ones_are_spread():
    fqns = [f"model.w{i}" for i in range(6)] + ["model.bn.running_mean", "lightning"]
    planner = RankZeroSavePlanner(identical=lambda fqn: fqn.startswith("model.w"))
    writers = _writer_of(planner._dedup_save_plans(_plans(3, fqns)))
    assert all(len(ranks) == 1 for ranks in writers.values()), "every item is written exactly once"
    assert writers["model.bn.running_mean"] == [0] and writers["lightning"] == [0]
    assert {writers[f"model.w{i}"][0] for i in range(6)} == {0, 1, 2}  # balanced over all ranks


def test_without_a_declaration_every_replicated_item_comes_from_rank_0():
    writers = _writer_of(RankZeroSavePlanner()._dedup_save_plans(_plans(2, ["a", "b", "c"])))
    assert writers == {"a": [0], "b": [0], "c": [0]}
