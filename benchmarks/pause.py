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
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

# benchmarks/common.py: run as a script, this file's folder is sys.path[0]
from common import (
    COLUMNS,
    add_shared_arguments,
    checkpoint_workdir,
    environment,
    error_text,
    make_state,
    parse_rank_counts,
    phase_medians,
    ratio_or_none,
    run_world,
    tensor_rows,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_shardckpt import CheckpointSaver, SaveConfig

METHODS = ("copy", "ours", "pl_sync", "pl_async", "dcp", "dcp_async")
LABELS = {
    "copy": "raw copy",
    "ours": "ours (async)",
    "ours_cold": "ours, 1st save",
    "pl_sync": "Lightning sync",
    "pl_async": "Lightning AsyncCheckpointIO",
    "dcp": "dcp.save",
    "dcp_async": "dcp.async_save",
}
OUR_PHASES = ("pause_s", "stage_s", "write_s", "verify_s", "commit_s", "total_s")  # CheckpointRecord fields
PAUSE_VS_COPY_TARGET = 1.5  # our pause may be at most this multiple of the raw copy
PAUSE_VS_PL_TARGET = 20.0  # our pause must be at least this many times shorter than Lightning's sync save
TOTAL_VS_DCP_TARGET = 1.10  # our total may be at most this multiple of plain dcp.save
RANK_TIMEOUT_S = 1800  # bound on every collective of a rank's process group


@dataclass(frozen=True)
class BenchConfig:
    size_gib: float  # per rank
    tensors: int
    repeats: int
    warmup: int
    threads: int
    workdir: str
    out_dir: str
    profile: bool
    profile_saves: int


@dataclass
class RankContext:
    """What the methods of one rank share."""

    rank: int
    world_size: int
    config: BenchConfig
    state: dict[str, DTensor]  # this rank's shards
    copy_buffers: list[torch.Tensor]  # the raw copy's preallocated destination
    full_state: dict[str, torch.Tensor] | None  # rank 0: the whole state, for the Lightning methods
    saver: CheckpointSaver
    dcp_group: Any  # dedicated gloo group for dcp.async_save
    lightning_async: Any  # one AsyncCheckpointIO for the run, as a Trainer holds one
    round: int = 0
    step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # per-sample details (our saver's record)


# --- the state ---


def state_rows(config: BenchConfig, world_size: int) -> list[int]:
    """Global rows of each tensor: --size-gib GiB per rank, N x --size-gib GiB in all (see common.tensor_rows)."""
    return tensor_rows(config.tensors, world_size, config.size_gib, per_rank=True)


def make_full_state(config: BenchConfig, state: dict[str, DTensor], world_size: int) -> dict[str, torch.Tensor]:
    """Rank 0's copy of the whole state (what DDP replicates and Lightning saves from rank 0)."""
    if world_size == 1:
        return {name: value.to_local() for name, value in state.items()}  # the same memory: nothing to gather
    generator = torch.Generator().manual_seed(1234)
    full = {}
    for (name, value), rows in zip(state.items(), state_rows(config, world_size)):
        tensor = torch.empty(rows, COLUMNS).uniform_(generator=generator)
        local = value.to_local()
        tensor[: local.shape[0]].copy_(local)
        full[name] = tensor
    return full


def bytes_per_rank(config: BenchConfig, world_size: int) -> int:
    """Bytes of the state each rank holds (its shards)."""
    return sum(state_rows(config, world_size)) // world_size * COLUMNS * 4


def lightning_checkpoint(ctx: RankContext) -> dict[str, Any]:
    """The shape of the dict Trainer.save_checkpoint hands to the CheckpointIO (model weights only)."""
    import lightning

    return {
        "epoch": 0,
        "global_step": ctx.step,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": ctx.full_state,
        "loops": {},
        "callbacks": {},
        "optimizer_states": [],
        "lr_schedulers": [],
    }


# --- the methods: start() returns after the blocking part, with a handle that finish() waits on ---


def start_copy(ctx: RankContext, directory: str) -> Any:
    for source, target in zip(ctx.state.values(), ctx.copy_buffers):
        target.copy_(source.to_local())
    return None


def start_ours(ctx: RankContext, directory: str) -> Any:
    return ctx.saver.save(ctx.state, step=ctx.step)


def finish_ours(ctx: RankContext, pending: Any) -> str:
    result = pending.result()
    records = ctx.saver.poll_records()
    if records:
        ctx.extra["phases"] = {phase: getattr(records[-1], phase) for phase in OUR_PHASES}
    if not result.committed:
        raise RuntimeError(f"not committed: {result.error}")
    return result.path


def start_pl_sync(ctx: RankContext, directory: str) -> Any:
    if ctx.rank == 0:
        from lightning.fabric.plugins.io import TorchCheckpointIO

        TorchCheckpointIO().save_checkpoint(lightning_checkpoint(ctx), os.path.join(directory, f"step={ctx.step}.ckpt"))
    return None


def start_pl_async(ctx: RankContext, directory: str) -> Any:
    if ctx.rank == 0:
        ctx.lightning_async.save_checkpoint(lightning_checkpoint(ctx), os.path.join(directory, f"step={ctx.step}.ckpt"))
    return None


def finish_pl_async(ctx: RankContext, handle: Any) -> None:
    if ctx.rank == 0:
        ctx.lightning_async.teardown()  # waits for the executor; the next save_checkpoint makes a new one


def start_dcp(ctx: RankContext, directory: str) -> Any:
    dcp.save(ctx.state, checkpoint_id=directory)
    return None


def start_dcp_async(ctx: RankContext, directory: str) -> Any:
    return dcp.async_save(ctx.state, checkpoint_id=directory, process_group=ctx.dcp_group)


def finish_dcp_async(ctx: RankContext, future: Any) -> None:
    future.result()


def _nothing(ctx: RankContext, handle: Any) -> None:
    return None


STARTS: dict[str, Callable[[RankContext, str], Any]] = {
    "copy": start_copy,
    "ours": start_ours,
    "pl_sync": start_pl_sync,
    "pl_async": start_pl_async,
    "dcp": start_dcp,
    "dcp_async": start_dcp_async,
}
FINISHES: dict[str, Callable[[RankContext, Any], Any]] = {
    "copy": _nothing,
    "ours": finish_ours,
    "pl_sync": _nothing,
    "pl_async": finish_pl_async,
    "dcp": _nothing,
    "dcp_async": finish_dcp_async,
}


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


def profile_ours(ctx: RankContext) -> dict[str, Any]:
    """Extra saves of ours, on every rank (the saves are collective); rank 0 profiles and times the pieces.

    Returns median seconds of: the whole save() call, and, timed separately on the same state, the
    layout signature, the CUDA check, the copy into the slot's buffers through _copy_state_dict, and a
    plain copy_ loop into the same buffers. Rank 0 also writes the cProfile listing.
    """
    from torch.distributed._state_dict_utils import _copy_state_dict

    from lightning_shardckpt.engine import staging

    pieces: dict[str, list[float]] = {
        "save_call": [], "layout_signature": [], "has_cuda_tensors": [], "copy_state_dict": [], "copy_loop": [],
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
            ("copy_state_dict", lambda: _copy_state_dict(ctx.state, buffers, non_blocking=False, type_check=False)),
            ("copy_loop", lambda: [b.to_local().copy_(s.to_local()) for s, b in zip(ctx.state.values(), buffers.values())]),
        ):
            started = time.perf_counter()
            fn()
            pieces[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in pieces.items() if values}
    if ctx.rank == 0:
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream).strip_dirs()
        stream.write(f"cProfile of {ctx.config.profile_saves} CheckpointSaver.save() calls on rank 0 of {ctx.world_size}, "
                     f"{ctx.config.size_gib} GiB/rank, {ctx.config.tensors} tensors\n\n")
        stream.write("pieces timed one by one (median s): " + json.dumps({k: round(v, 5) for k, v in medians.items()}) + "\n\n")
        stats.sort_stats("cumulative").print_stats(35)
        stats.sort_stats("tottime").print_stats(20)
        os.makedirs(ctx.config.out_dir, exist_ok=True)
        with open(os.path.join(ctx.config.out_dir, f"pause_profile_{ctx.world_size}ranks.txt"), "w") as handle:
            handle.write(stream.getvalue())
    return medians


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


def summarize(world_size: int, config: BenchConfig, per_rank: list[dict[str, Any]] | str) -> dict[str, Any]:
    """Per method: the slowest rank's pause and total per timed round, medians, errors; ratios; targets."""
    summary: dict[str, Any] = {
        "ranks": world_size,
        "bytes_per_rank": bytes_per_rank(config, world_size),
        "methods": {m: {"pause_s": [], "total_s": [], "warmup_pause_s": [], "warmup_total_s": [], "errors": []} for m in (*METHODS, "ours_cold")},
    }
    methods = summary["methods"]
    phases: list[list[dict[str, float]]] = []
    if isinstance(per_rank, str):
        for method in methods:
            methods[method]["errors"].append(f"run failed: {per_rank}")
    else:
        summary["per_rank_samples"] = [r["samples"] for r in per_rank]
        summary["pause_pieces_median_s_per_rank"] = [r["pieces"] for r in per_rank]
        summary["ours_staging_allocations"] = [r["staging_allocations"] for r in per_rank]
        first_ours = True
        for same in zip(*(r["samples"] for r in per_rank)):  # every rank's view of one (round, method)
            head = same[0]
            entry = methods[head["method"]]
            errors = [f"rank {rank}: {s['error']}" for rank, s in enumerate(same) if s["error"]]
            entry["errors"].extend(f"{'warm-up' if head['warmup'] else 'timed'} round {head['round']}: {e}" for e in errors)
            cold = head["method"] == "ours" and first_ours
            if head["method"] == "ours":
                first_ours = False
            if errors:
                continue
            pause, total = max(s["pause_s"] for s in same), max(s["total_s"] for s in same)
            if cold:  # the saver's first save: staging buffers are allocated inside its pause
                methods["ours_cold"]["pause_s"].append(pause)
                methods["ours_cold"]["total_s"].append(total)
            prefix = "warmup_" if head["warmup"] else ""
            entry[prefix + "pause_s"].append(pause)
            entry[prefix + "total_s"].append(total)
            if head["method"] == "ours" and not head["warmup"] and all(s.get("phases") for s in same):
                phases.append([s["phases"] for s in same])
    for entry in methods.values():
        entry["median_pause_s"] = statistics.median(entry["pause_s"]) if entry["pause_s"] else None
        entry["median_total_s"] = statistics.median(entry["total_s"]) if entry["total_s"] else None
    median = {m: (methods[m]["median_pause_s"], methods[m]["median_total_s"]) for m in methods}
    copy_s = median["copy"][1]
    pl_s = median["pl_sync"][1]
    for m, (pause, total) in median.items():
        methods[m]["ratios"] = {
            "pause/copy": ratio_or_none(pause, copy_s),
            "total/copy": ratio_or_none(total, copy_s),
            "pl_sync/pause": ratio_or_none(pl_s, pause),
            "total/pl_sync": ratio_or_none(total, pl_s),
        }
    ours_pause, ours_total = median["ours"]
    summary["targets"] = {
        f"ours pause <= {PAUSE_VS_COPY_TARGET}x raw copy": _verdict(ratio_or_none(ours_pause, copy_s), lambda r: r <= PAUSE_VS_COPY_TARGET, "{:.2f}x"),
        f"ours pause >= {PAUSE_VS_PL_TARGET:.0f}x shorter than Lightning sync": _verdict(
            ratio_or_none(pl_s, ours_pause), lambda r: r >= PAUSE_VS_PL_TARGET, "{:.1f}x shorter"
        ),
        f"ours total <= {TOTAL_VS_DCP_TARGET}x dcp.save": _verdict(
            ratio_or_none(ours_total, median["dcp"][1]), lambda r: r <= TOTAL_VS_DCP_TARGET, "{:.2f}x"
        ),
    }
    summary["ours_phases"] = {
        "per_save_per_rank": phases,
        "median_of_slowest_rank_s": phase_medians(phases, OUR_PHASES),
    }
    return summary


def _verdict(ratio: float | None, ok: Callable[[float], bool], fmt: str) -> dict[str, Any]:
    if ratio is None:
        return {"ratio": None, "met": None, "text": "no result"}
    met = ok(ratio)
    return {"ratio": ratio, "met": met, "text": f"{'met' if met else 'MISSED'} ({fmt.format(ratio)})"}


def format_table(summaries: list[dict[str, Any]]) -> str:
    header = (
        f"{'ranks':>5}  {'method':<28}  {'pause s':>8}  {'total s':>8}  {'pause/copy':>10}  {'total/copy':>10}"
        f"  {'pl_sync/pause':>13}  {'total/pl_sync':>13}"
    )
    lines, failures = [header, "-" * len(header)], []
    for summary in summaries:
        for method in (*METHODS[:2], "ours_cold", *METHODS[2:]):
            entry = summary["methods"][method]
            failures.extend(f"{summary['ranks']} rank(s), {method}, {e}" for e in entry["errors"])
            mark = "!" if entry["errors"] else ""
            ratios = entry["ratios"]
            lines.append(
                f"{summary['ranks']:>5}  {LABELS[method] + mark:<28}  {_fmt_s(entry['median_pause_s'])}  {_fmt_s(entry['median_total_s'])}"
                f"  {_fmt_x(ratios['pause/copy'], 10)}  {_fmt_x(ratios['total/copy'], 10)}"
                f"  {_fmt_x(ratios['pl_sync/pause'], 13)}  {_fmt_x(ratios['total/pl_sync'], 13)}"
            )
        lines.append("")
    for summary in summaries:
        gib = summary["bytes_per_rank"] / 2**30
        lines.append(f"{summary['ranks']} rank(s), {gib:.2f} GiB per rank ({summary['ranks'] * gib:.2f} GiB in all; Lightning saves all of it from rank 0):")
        for name, verdict in summary["targets"].items():
            lines.append(f"  target: {name:<48} {verdict['text']}")
        phases = summary["ours_phases"]["median_of_slowest_rank_s"]
        breakdown = ", ".join(f"{name[:-2]} {seconds:.3f}" for name, seconds in phases.items()) or "none recorded"
        lines.append(f"  ours, the saver's own record (median of the slowest rank, s): {breakdown}")
        pieces = [p for p in summary.get("pause_pieces_median_s_per_rank", []) if p]
        if pieces:
            lines.append("  ours pause, pieces timed one by one (--profile, median s, rank 0): "
                         + ", ".join(f"{k} {v:.4f}" for k, v in pieces[0].items()))
    if failures:
        lines.append("failures (! marks a median over fewer samples than asked):")
        lines.extend(f"  {failure}" for failure in failures)
    return "\n".join(lines)


def _fmt_s(seconds: float | None) -> str:
    return f"{seconds:8.3f}" if seconds is not None else f"{'FAILED':>8}"


def _fmt_x(ratio: float | None, width: int) -> str:
    return f"{ratio:.2f}x".rjust(width) if ratio is not None else "-".rjust(width)


def plot(summaries: list[dict[str, Any]], path: str, config: BenchConfig) -> None:
    """Grouped bars per rank count: pause and total per method, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ("copy", "ours", "ours_cold", "dcp_async", "dcp", "pl_async", "pl_sync")
    fig, axes = plt.subplots(1, len(summaries), figsize=(6.5 * len(summaries), 5.2), sharey=True, squeeze=False)
    width = 0.38
    for ax, summary in zip(axes[0], summaries):
        xs = range(len(order))
        for offset, key, color, label in ((-width / 2, "median_pause_s", "#d62728", "pause (training blocked)"),
                                          (width / 2, "median_total_s", "#1f77b4", "total (until complete)")):
            values = [summary["methods"][m][key] or 0.0 for m in order]
            bars = ax.bar([x + offset for x in xs], [v if v > 0 else float("nan") for v in values], width, color=color, label=label)
            for bar, value in zip(bars, values):
                if value > 0:
                    ax.annotate(f"{value:.2g}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                                fontsize=7, xytext=(0, 2), textcoords="offset points")
        copy_s = summary["methods"]["copy"]["median_total_s"]
        if copy_s:
            ax.axhline(copy_s * PAUSE_VS_COPY_TARGET, color="#d62728", linestyle=":", linewidth=1,
                       label=f"pause target: {PAUSE_VS_COPY_TARGET}x raw copy")
        ax.set_yscale("log")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([LABELS[m].replace(" ", "\n", 1) if m != "ours_cold" else "ours,\n1st save" for m in order], fontsize=8)
        gib = summary["bytes_per_rank"] / 2**30
        ax.set_title(f"{summary['ranks']} gloo rank(s), {gib:.2f} GiB per rank")
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0][0].set_ylabel("seconds (median, slowest rank; log scale)")
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Checkpoint pause vs total, {config.tensors} float32 tensors, CPU, {config.repeats} repeat(s)", fontsize=11)
    fig.text(0.5, 0.005, "pause = training thread blocked; total = until the checkpoint is complete. Lightning's methods write the whole "
             "state (ranks x size) from rank 0; the others write each rank's shard. Dotted: our pause target.", ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    parser.add_argument("--profile", action="store_true", help="cProfile extra saves of ours on rank 0 and time the pause's pieces")
    parser.add_argument("--profile-saves", type=int, default=5, help="saves profiled with --profile")
    args = parser.parse_args(argv)
    if args.size_gib <= 0 or args.repeats < 1 or args.tensors < 1 or args.warmup < 1 or args.threads < 1 or args.profile_saves < 1:
        parser.error("--size-gib must be > 0; --repeats, --warmup, --tensors, --threads, --profile-saves >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank_counts = parse_rank_counts(args.ranks)
    out_dir = os.path.abspath(args.out_dir)
    with checkpoint_workdir(args.workdir, prefix="shardckpt-pause-") as workdir:
        config = BenchConfig(
            size_gib=args.size_gib, tensors=args.tensors, repeats=args.repeats, warmup=args.warmup, threads=args.threads,
            workdir=workdir, out_dir=out_dir, profile=args.profile, profile_saves=args.profile_saves,
        )
        report: dict[str, Any] = {"config": {**asdict(config), "ranks": rank_counts}, "environment": environment(), "results": []}
        for world_size in rank_counts:
            print(f"running {world_size} rank(s), {args.size_gib} GiB per rank, {args.repeats} repeat(s) in {workdir} ...", flush=True)
            report["results"].append(summarize(world_size, config, run_world(world_size, rank_main, config, RANK_TIMEOUT_S)))
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
