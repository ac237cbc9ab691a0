"""Does torch's save-plan cache (`DefaultSavePlanner(enable_plan_caching=True)`) help our `RankZeroSavePlanner`?

    PYTHONPATH=$PWD .venv/bin/python benchmarks/plan_cache.py --ranks 8 64 512

Times the coordinator's `create_global_plan` (dedup, DCP's global plan and `.metadata`, its validation) on
synthetic FSDP2 plans (each of `--tensors` tensors row-sharded over every rank, plus rank 0's pickled Lightning
state), with the cache off, on for a first save, and on for a save whose layout did not change (every local plan
then arrives as DCP's empty "unusable" plan). Three runs each; prints min / median / max. One process: no gather,
no files. Only the format-v2 path plans through DCP (format v4 plans nothing on the coordinator), and the cache is
keyed process-wide by the planner's class name.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.distributed.checkpoint.default_planner import _compare_save_plans
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType

from lightning_shardckpt.engine.save.persist import RankZeroSavePlanner

ROWS, COLUMNS = 8192, 1024


def local_plans(world: int, tensors: int) -> list[SavePlan]:
    rows = max(1, ROWS // world)
    plans = []
    for rank in range(world):
        items = [
            WriteItem(
                index=MetadataIndex(f"t{t}", torch.Size([rank * rows, 0])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size([rank * rows, 0]), sizes=torch.Size([rows, COLUMNS])),
                    properties=TensorProperties(dtype=torch.bfloat16),
                    size=torch.Size([rows * world, COLUMNS]),
                ),
            )
            for t in range(tensors)
        ]
        if rank == 0:
            items.append(WriteItem(index=MetadataIndex("lightning"), type=WriteItemType.BYTE_IO))
        plans.append(SavePlan(items, planner_data={}))
    return plans


def clear_cache() -> None:
    for name in ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan"):
        getattr(SavePlanner, name).clear()
    SavePlanner._cached_metadata.clear()


def planner(cached: bool) -> RankZeroSavePlanner:
    made = RankZeroSavePlanner()
    made._enable_plan_caching = cached  # RankZeroSavePlanner does not pass DCP's constructor flag
    return made


def timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 1024])
    parser.add_argument("--tensors", type=int, default=300)
    args = parser.parse_args(argv)
    for world in args.ranks:
        plans = local_plans(world, args.tensors)
        unchanged = [SavePlan([], usable=False)] * world
        runs = []
        for _ in range(3):
            clear_cache()
            off = timed(planner(False).create_global_plan, plans)
            first = timed(planner(True).create_global_plan, plans)
            again = timed(planner(True).create_global_plan, unchanged)
            compare = timed(_compare_save_plans, plans[0], plans[0])  # each rank's check that its plan is unchanged
            runs.append((off, first, again, compare))
        columns = list(zip(*runs))
        text = ", ".join(
            f"{name} {' / '.join(f'{value:.4f}' for value in sorted(values))} s"
            for name, values in zip(("off", "on, first save", "on, unchanged layout", "per-rank compare"), columns)
        )
        print(f"{world:,} ranks x {args.tensors} tensors ({world * args.tensors:,} chunks): {text}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
