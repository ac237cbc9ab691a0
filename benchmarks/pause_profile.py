"""`benchmarks/pause.py --profile`: where our pause goes, piece by piece, and a cProfile of save()."""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import time
from typing import Any

import torch.distributed as dist
from pause_methods import RankContext


def profile_ours(ctx: RankContext) -> dict[str, Any]:
    """Extra saves of ours, on every rank (the saves are collective); rank 0 profiles and times the pieces.

    Returns median seconds of: the whole save() call, and, timed separately on the same state, the
    layout signature, the CUDA check, the copy into the slot's buffers through _copy_state_dict, and a
    plain copy_ loop into the same buffers. Rank 0 also writes the cProfile listing.
    """
    from torch.distributed._state_dict_utils import _copy_state_dict

    from lightning_shardckpt.engine.save import staging

    pieces: dict[str, list[float]] = {
        "save_call": [],
        "layout_signature": [],
        "has_cuda_tensors": [],
        "copy_state_dict": [],
        "copy_loop": [],
        "stage_s(record)": [],
    }
    profiler = cProfile.Profile()
    for _ in range(ctx.config.profile_saves):
        ctx.step += 1
        dist.barrier()
        started = time.perf_counter()
        if ctx.rank == 0:
            profiler.enable()
        pending = ctx.saver.save(ctx.state, step=ctx.step)
        if ctx.rank == 0:
            profiler.disable()
        pieces["save_call"].append(time.perf_counter() - started)
        result = pending.result()
        records = ctx.saver.poll_records()
        if records:
            pieces["stage_s(record)"].append(records[-1].stage_s)
        dist.barrier()
        if ctx.rank == 0 and result.path:
            shutil.rmtree(result.path, ignore_errors=True)
        # the pieces, one by one, with the saver idle (its slot is free again)
        slot = ctx.saver.slots[0]
        buffers = slot._buffers  # private: the reused staging buffers
        for name, fn in (
            ("layout_signature", lambda: staging.layout_signature(ctx.state)),
            ("has_cuda_tensors", lambda: staging._has_cuda_tensors(ctx.state)),
            (
                "copy_state_dict",
                lambda buffers=buffers: _copy_state_dict(ctx.state, buffers, non_blocking=False, type_check=False),
            ),
            (
                "copy_loop",
                lambda buffers=buffers: [
                    b.to_local().copy_(s.to_local()) for s, b in zip(ctx.state.values(), buffers.values())
                ],
            ),
        ):
            started = time.perf_counter()
            fn()
            pieces[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in pieces.items() if values}
    if ctx.rank == 0:
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream).strip_dirs()
        stream.write(
            f"cProfile of {ctx.config.profile_saves} CheckpointSaver.save() calls on rank 0 of {ctx.world_size}, "
            f"{ctx.config.size_gib} GiB/rank, {ctx.config.tensors} tensors\n\n"
        )
        stream.write(
            "pieces timed one by one (median s): " + json.dumps({k: round(v, 5) for k, v in medians.items()}) + "\n\n"
        )
        stats.sort_stats("cumulative").print_stats(35)
        stats.sort_stats("tottime").print_stats(20)
        os.makedirs(ctx.config.out_dir, exist_ok=True)
        with open(os.path.join(ctx.config.out_dir, f"pause_profile_{ctx.world_size}ranks.txt"), "w") as handle:
            handle.write(stream.getvalue())
    return medians
