"""How long a checkpoint blocks the training loop (pause) and how long it takes in all (total), in one run.

Run from the repository root:

    .venv/bin/python benchmarks/pause.py                          # 1 GiB per rank, 1 and 2 ranks, 3 repeats
    .venv/bin/python benchmarks/pause.py --size-gib 0.25 --repeats 1
    .venv/bin/python benchmarks/pause.py --profile                # also cProfile our save() on rank 0

For each rank count N, N gloo CPU ranks (spawned processes, --threads torch threads each) hold a state of
--size-gib GiB *per rank*: --tensors float32 tensors of varying sizes (1x to 8x), each a DTensor
sharded Shard(0) over init_device_mesh("cpu", (N,)), so every rank holds 1/N of N x --size-gib GiB.

Methods (each is timed from a barrier; pause = until the call that blocks the training loop returns,
total = until the checkpoint is complete; both measured on every rank, the slowest rank counts):
  copy        a copy of this rank's local shards into preallocated, already-used buffers (one copy_ per
              tensor): the physical floor for a consistent snapshot. pause = total.
  ours        CheckpointSaver(root, SaveConfig(async_save=True)).save(state, step): pause = until save()
              returns, total = until .result() returns (committed, verified, manifest written). The first
              save of the run allocates the staging buffers; it is reported on its own as "ours cold".
  pl_sync     Lightning's default synchronous save as Trainer.save_checkpoint does it under DDP: rank 0
              calls TorchCheckpointIO().save_checkpoint(checkpoint, path) (torch.save into memory, then one
              file) with the FULL state (N x --size-gib GiB) while the other ranks wait at the barrier
              that Trainer.save_checkpoint ends with. pause = total. (A Trainer is not built: inside the
              spawned ranks the direct call is what runs reliably, and it is the same code path. Under
              DDP the state is replicated, so there is no gather; with sharded state Lightning would
              first gather it onto rank 0, which is not timed here: these numbers are a lower bound.)
  pl_async    Lightning's AsyncCheckpointIO(TorchCheckpointIO()) on rank 0 with the full state: pause =
              until save_checkpoint returns (it clones every tensor on the caller), total = until
              teardown() returns (its one-thread executor finished the torch.save).
  dcp         torch.distributed.checkpoint.save(state, checkpoint_id=dir), synchronous: pause = total.
  dcp_async   dcp.async_save(state, checkpoint_id=dir, process_group=<a dedicated gloo group>), thread
              mode, default stager: pause = until it returns the future, total = until future.result().

One untimed warm-up round (--warmup) runs every method first (so the copy's buffers and our staging
buffers are warm, as in a training run's steady state); its samples are kept in the JSON, marked.
Then --repeats timed rounds; methods run in the opposite order on alternate rounds. Every save goes to
a fresh directory under --workdir, deleted after its round.

Table columns (seconds are medians over repeats of the slowest rank):
  pause s, total s        as above
  pause/copy, total/copy  against the copy's median
  pl_sync/pause           how many times shorter the pause is than Lightning's synchronous save's
  total/pl_sync           total against Lightning's synchronous save
Targets: ours pause <= 1.5x copy; ours pause >= 20x shorter than pl_sync; ours total <= 1.1x dcp.

Writes --out-dir/pause.json (every sample, per rank) and --out-dir/pause.png (grouped bars, log scale).
With --profile, rank 0 also profiles --profile-saves extra saves of ours under cProfile after the
timed rounds, times the pieces of the pause one by one (layout signature, CUDA check, the copy,
everything else), and writes --out-dir/pause_profile_<N>ranks.txt.

This file runs the rounds and writes the report; the pieces read on their own: pause_methods.py (the
state and each method's start/finish), pause_report.py (medians, ratios, targets, table, plot) and
pause_profile.py (--profile).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# benchmarks/*.py: run as a script, this file's folder is sys.path[0]
from common import (
    add_shared_arguments,
    checkpoint_workdir,
    environment,
    error_text,
    make_state,
    parse_rank_counts,
    run_world,
)
from pause_methods import FINISHES, METHODS, STARTS, BenchConfig, RankContext, make_full_state, state_rows
from pause_profile import profile_ours
from pause_report import format_table, plot, summarize
from torch.distributed.device_mesh import init_device_mesh

from lightning_shardckpt import CheckpointSaver, SaveConfig

RANK_TIMEOUT_S = 1800  # bound on every collective of a rank's process group


# --- one rank ---


def measure(ctx: RankContext, method: str, directory: str) -> dict[str, Any]:
    """One sample of one method on this rank: pause and total seconds, or the error."""
    ctx.extra = {}
    ctx.step += 1
    dist.barrier()
    started = time.perf_counter()
    pause = total = None
    error = None
    try:
        handle = STARTS[method](ctx, directory)
        pause = time.perf_counter() - started
        saved_at = FINISHES[method](ctx, handle)
        total = time.perf_counter() - started
        if isinstance(saved_at, str):
            ctx.extra["path"] = saved_at
    except Exception as err:  # recorded and shown in the table; the next method still runs
        error = error_text(err)
    dist.barrier()
    return {"method": method, "pause_s": pause, "total_s": total, "error": error, **ctx.extra}


def run_round(ctx: RankContext) -> list[dict[str, Any]]:
    order = METHODS if ctx.round % 2 == 0 else METHODS[::-1]
    warmup = ctx.round < ctx.config.warmup
    samples, directories = [], []
    for method in order:
        directory = os.path.join(ctx.config.workdir, f"{method}-{ctx.world_size}ranks-{ctx.round}")
        if ctx.rank == 0:
            os.makedirs(directory, exist_ok=True)
        sample = measure(ctx, method, directory)
        sample.update(round=ctx.round, warmup=warmup)
        samples.append(sample)
        directories.append(sample.pop("path", None) or directory)
        dist.barrier()
        if ctx.rank == 0:  # delete right away: page cache and disk stay free for the next method
            shutil.rmtree(directories[-1], ignore_errors=True)
            shutil.rmtree(directory, ignore_errors=True)
    return samples


def rank_main(rank: int, world_size: int, config: BenchConfig) -> dict[str, Any]:
    """One spawned rank (in its gloo group, see common.run_world): every round, then --profile; what rank 0 reports."""
    torch.set_num_threads(config.threads)
    from lightning.fabric.plugins.io import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    mesh = init_device_mesh("cpu", (world_size,))
    state = make_state(state_rows(config, world_size), mesh, rank, world_size)
    saver = CheckpointSaver(os.path.join(config.workdir, f"ours-{world_size}ranks"), SaveConfig(async_save=True))
    dcp_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=RANK_TIMEOUT_S))
    ctx = RankContext(
        rank=rank,
        world_size=world_size,
        config=config,
        state=state,
        copy_buffers=[torch.empty_like(value.to_local()) for value in state.values()],
        full_state=make_full_state(config, state, world_size) if rank == 0 else None,
        saver=saver,
        dcp_group=dcp_group,
        lightning_async=AsyncCheckpointIO(TorchCheckpointIO()),
    )
    samples: list[dict[str, Any]] = []
    for round_index in range(config.warmup + config.repeats):
        ctx.round = round_index
        samples.extend(run_round(ctx))
    pieces = profile_ours(ctx) if config.profile else None
    saver.close()
    return {"samples": samples, "pieces": pieces, "staging_allocations": saver.slots[0].allocations}


# --- the parent: start ranks, merge, report ---


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shared_arguments(
        parser,
        size_help="state size PER RANK, GiB (Lightning's rank 0 holds N times this)",
        repeats_help="timed rounds; the median is reported",
        warmup_help="untimed rounds first (>= 1: the first holds our cold save)",
    )
    parser.add_argument("--tensors", type=int, default=32, help="number of tensors in the state")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--workdir", default=None, help="where checkpoints are written (default: a fresh temp dir)")
    parser.add_argument("--out-dir", default="benchmarks/results", help="where pause.json and pause.png go")
    parser.add_argument(
        "--profile", action="store_true", help="cProfile extra saves of ours on rank 0 and time the pause's pieces"
    )
    parser.add_argument("--profile-saves", type=int, default=5, help="saves profiled with --profile")
    args = parser.parse_args(argv)
    if (
        args.size_gib <= 0
        or args.repeats < 1
        or args.tensors < 1
        or args.warmup < 1
        or args.threads < 1
        or args.profile_saves < 1
    ):
        parser.error("--size-gib must be > 0; --repeats, --warmup, --tensors, --threads, --profile-saves >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank_counts = parse_rank_counts(args.ranks)
    out_dir = os.path.abspath(args.out_dir)
    with checkpoint_workdir(args.workdir, prefix="shardckpt-pause-") as workdir:
        config = BenchConfig(
            size_gib=args.size_gib,
            tensors=args.tensors,
            repeats=args.repeats,
            warmup=args.warmup,
            threads=args.threads,
            workdir=workdir,
            out_dir=out_dir,
            profile=args.profile,
            profile_saves=args.profile_saves,
        )
        report: dict[str, Any] = {
            "config": {**asdict(config), "ranks": rank_counts},
            "environment": environment(),
            "results": [],
        }
        for world_size in rank_counts:
            print(
                f"running {world_size} rank(s), {args.size_gib} GiB per rank, {args.repeats} repeat(s) in {workdir} ...",
                flush=True,
            )
            report["results"].append(
                summarize(world_size, config, run_world(world_size, rank_main, config, RANK_TIMEOUT_S))
            )
    table = format_table(report["results"])
    report["table"] = table.splitlines()
    os.makedirs(out_dir, exist_ok=True)
    json_path, png_path = os.path.join(out_dir, "pause.json"), os.path.join(out_dir, "pause.png")
    with open(json_path, "w") as handle:
        json.dump(report, handle, indent=2)
    plot(report["results"], png_path, config)
    print(table)
    print(f"wrote {json_path} and {png_path}")
    failed = any(entry["errors"] for s in report["results"] for entry in s["methods"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
