"""Format v5's two-step gather against v4's one gather, on real gloo ranks of this machine (issue 35).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/group_gather.py --ranks 16 --group-size 4 --saves 5

benchmarks/scale.py simulates 16,384 ranks in one process; this runs the protocol itself: `--ranks` gloo
processes each save a tiny row-sharded state `--saves` times in format v4 (rank 0 gathers every rank's
summary) and then in v5 (`--group-size` ranks a group: members send to their leader point to point, leaders
to rank 0; the group size is set for these processes through the tests-only environment variable), local
disk, synchronous saves. Printed per format, min / median / max over the saves: rank 0's commit
(`PartsCommitter`, its `commit_s`), and rank 0's whole save from its write to the verdict (`persist_s`), which
includes waiting for the slowest rank and the collectives. On a 2-core machine shared with other jobs the
collectives' latency dominates: what this shows is that the extra step costs little, not the 16,384-rank gain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine.format import groups
from tests.helpers.spawn import run_ranks


def save_repeatedly(rank, world_size, root, format_version, group_size, saves):
    os.environ[groups.GROUP_SIZE_ENV] = str(group_size)
    mesh = init_device_mesh("cpu", (world_size,))
    state = {}
    for index in range(20):
        full = torch.arange(world_size * 64, dtype=torch.float32).reshape(world_size * 8, 8) + index
        local = full.chunk(world_size)[rank].clone()
        state[f"model.t{index}"] = DTensor.from_local(local, mesh, [Shard(0)], shape=full.shape, stride=full.stride())
    config = SaveConfig(async_save=False, write_events=False, format_version=format_version, collective_timeout_s=120)
    saver = CheckpointSaver(root, config)
    timings = []
    for step in range(saves + 1):  # the first save warms up (imports, the checkpoint group's connections)
        result = saver.save(state, step=step).result(timeout=120)
        assert result.committed, result.error
        timings.append({**result.timings, "format_version": result.manifest["format_version"] if rank == 0 else None})
    saver.close()
    return timings[1:] if rank == 0 else None


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    return f"{ordered[0] * 1e3:.1f} / {statistics.median(ordered) * 1e3:.1f} / {ordered[-1] * 1e3:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args(argv)
    rows = {}
    for format_version in (4, 5):
        with tempfile.TemporaryDirectory() as tmp:
            outcome = run_ranks(
                save_repeatedly,
                args.ranks,
                os.path.join(tmp, "ckpt"),
                format_version,
                args.group_size,
                args.saves,
                timeout_s=600,
                pg_timeout_s=120,
            )
        timings = outcome[0].value
        written = {t["format_version"] for t in timings}
        rows[format_version] = {
            "written": sorted(written),
            "commit_s": [t["commit_s"] for t in timings],
            "persist_s": [t["persist_s"] for t in timings],
        }
        print(json.dumps({"format_version": format_version, **rows[format_version]}), flush=True)
    print(f"\n{args.ranks} gloo ranks, groups of {args.group_size}, {args.saves} saves each (min / median / max):")
    for format_version, row in rows.items():
        print(
            f"  v{format_version} (written: {', '.join(f'v{v}' for v in row['written'])}): rank 0's commit {summary(row['commit_s'])}, "
            f"its whole save {summary(row['persist_s'])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
