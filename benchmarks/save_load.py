"""Save and load wall time of our checkpoint engine beside plain DCP and raw file I/O, in one run.

Run from the repository root:

    .venv/bin/python benchmarks/save_load.py                       # 1 GiB, 1 and 2 ranks, 3 repeats
    .venv/bin/python benchmarks/save_load.py --size-gib 0.25 --repeats 1 --ranks 2

For each rank count N, N gloo CPU ranks hold a state of --size-gib GiB in total: --tensors float32
tensors of varying sizes (1x to 8x), each a DTensor sharded Shard(0) over a 1-D CPU mesh, so every
rank holds and writes 1/N of the bytes. Each measurement is wall time from a barrier before to a
barrier after (the slowest rank's, so the rank that finishes last counts). One untimed warm-up round
(--warmup) runs every method first, so that one-time costs (first-touch memory, lazy imports) do not
land in the medians; its samples are kept in the JSON, marked. Every measurement is then repeated
--repeats times. The order of methods rotates from round to round (ours-dcp-raw, dcp-raw-ours,
raw-ours-dcp), so with a multiple of 3 repeats every method runs first, second and last equally
often: on this class of machine a write that follows two others is measurably slower (the disk is
still absorbing them), and plain alternation would leave one method last twice as often. Before each
timed method the ranks flush dirty pages (`sync`) and wait --settle-s. Every checkpoint goes to a
fresh directory under --workdir and is deleted after its round.

Table columns (seconds are medians over repeats):
  ranks     N, the number of gloo ranks
  op        save, or load into preallocated tensors (each load is checked bit-exact against the state)
  ours      save: CheckpointSaver(root, SaveConfig(async_save=False)).save(state, step).result():
            staging copy, checksum per chunk, sampled read-back verification, manifest commit (the JSON
            holds the saver's own phase times per save). load: load_checkpoint(state, dir), every
            chunk's checksum checked
  dcp       torch.distributed.checkpoint.save(state, checkpoint_id=dir) (FileSystemWriter, fsync on),
            and dcp.load(state, checkpoint_id=dir)
  raw       every rank writes its local shards' raw bytes to a file of its own and fsyncs it, or reads
            them back into the preallocated tensors: the physical floor
  ours/dcp  ratio of the medians; the target for save is <= 1.10
  ours/raw  ratio of the medians
  GiB/s     state size / ours median
A method that failed shows FAILED, with its errors under the table; the JSON (--out) keeps every
sample. Loads read what was just written, so they are page-cache reads unless --cold evicts each
checkpoint's files from the page cache first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

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

from lightning_shardckpt import CheckpointSaver, SaveConfig, load_checkpoint

METHODS = ("ours", "dcp", "raw")
OUR_PHASES = ("stage_s", "write_s", "verify_s", "commit_s", "total_s")  # CheckpointRecord fields
OPS = ("save", "load")
SAVE_TARGET = 1.10  # our save may take at most this multiple of plain dcp.save
RANK_TIMEOUT_S = 900  # bound on every collective of a rank's process group
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "save_load.json")  # gitignored


@dataclass(frozen=True)
class BenchConfig:
    size_gib: float
    tensors: int
    repeats: int
    warmup: int
    settle_s: float
    workdir: str
    cold: bool


@dataclass
class RankContext:
    """What the methods of one rank share."""

    rank: int
    world_size: int
    config: BenchConfig
    saver: CheckpointSaver
    round: int = 0  # warm-up rounds first, then the timed repeats
    last_phases: dict[str, float] | None = None  # our saver's own timings of the latest save


# --- the state ---


def state_rows(config: BenchConfig, world_size: int) -> list[int]:
    """Global rows of each tensor: --size-gib GiB in all, 1/N of it on each rank (see common.tensor_rows)."""
    return tensor_rows(config.tensors, world_size, config.size_gib, per_rank=False)


def local_tensors(state: dict[str, DTensor]) -> list[torch.Tensor]:
    """This rank's shards of `state`, in order."""
    return [value.to_local() for value in state.values()]


def state_bytes(config: BenchConfig, world_size: int) -> int:
    """Bytes of the whole state, over all ranks."""
    return sum(state_rows(config, world_size)) * COLUMNS * 4


# --- the methods: a save returns the directory its load reads ---


def save_ours(ctx: RankContext, state: dict[str, DTensor], directory: str) -> str:
    result = ctx.saver.save(state, step=ctx.round).result()
    if not result.committed:
        raise RuntimeError(str(result.error))
    records = ctx.saver.poll_records()
    if records:
        record = records[-1]
        ctx.last_phases = {phase: getattr(record, phase) for phase in OUR_PHASES}
    return result.path


def save_dcp(ctx: RankContext, state: dict[str, DTensor], directory: str) -> str:
    dcp.save(state, checkpoint_id=directory)
    return directory


def save_raw(ctx: RankContext, state: dict[str, DTensor], directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(_raw_file(directory, ctx.rank), "wb") as handle:
        for tensor in local_tensors(state):
            handle.write(memoryview(tensor.numpy()).cast("B"))
        handle.flush()
        os.fsync(handle.fileno())
    return directory


def load_ours(ctx: RankContext, target: dict[str, DTensor], directory: str) -> None:
    load_checkpoint(target, directory)


def load_dcp(ctx: RankContext, target: dict[str, DTensor], directory: str) -> None:
    dcp.load(target, checkpoint_id=directory)


def load_raw(ctx: RankContext, target: dict[str, DTensor], directory: str) -> None:
    with open(_raw_file(directory, ctx.rank), "rb", buffering=0) as handle:
        for tensor in local_tensors(target):
            view = memoryview(tensor.numpy()).cast("B")
            filled = 0
            while filled < len(view):  # readinto may return fewer bytes than asked
                count = handle.readinto(view[filled:])
                if not count:
                    raise EOFError(f"{handle.name} ended after {filled} of {len(view)} bytes of a tensor")
                filled += count


def _raw_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.bin")


SAVERS: dict[str, Callable[..., str]] = {"ours": save_ours, "dcp": save_dcp, "raw": save_raw}
LOADERS: dict[str, Callable[..., None]] = {"ours": load_ours, "dcp": load_dcp, "raw": load_raw}


# --- one rank ---


def timed(settle_s: float, fn: Callable[..., Any], *args: Any) -> tuple[float, Any, str | None]:
    """Settle, then run `fn` between two barriers; return (seconds, value, error). Failures are returned."""
    os.sync()  # earlier writes (of any method) drain before this one is timed
    time.sleep(settle_s)
    dist.barrier()
    started = time.perf_counter()
    value, error = None, None
    try:
        value = fn(*args)
    except Exception as err:  # recorded and shown in the table; the next method still runs
        error = error_text(err)
    dist.barrier()
    return time.perf_counter() - started, value, error


def mismatch(state: dict[str, DTensor], target: dict[str, DTensor]) -> str | None:
    wrong = [name for name in state if not torch.equal(state[name].to_local(), target[name].to_local())]
    return f"loaded values differ from the saved state in {len(wrong)} tensor(s), e.g. {wrong[0]}" if wrong else None


def on_every_rank(flag: bool) -> bool:
    """Collective "agree": True only if `flag` holds on every rank (ranks must skip a load together)."""
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return all(flags)


def evict_from_page_cache(directory: str) -> None:
    """Drop a written (fsynced, hence clean) checkpoint's pages, so the next read comes from disk."""
    for parent, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_round(ctx: RankContext, state: dict[str, DTensor], target: dict[str, DTensor]) -> list[dict[str, Any]]:
    """Save with every method, then load each back; one sample per (op, method)."""
    shift = (ctx.round - ctx.config.warmup) % len(METHODS)
    order = METHODS[shift:] + METHODS[:shift]
    warmup = ctx.round < ctx.config.warmup
    samples, directories = [], {}
    for method in order:
        fresh = os.path.join(ctx.config.workdir, f"{method}-{ctx.world_size}ranks-{ctx.round}")
        ctx.last_phases = None
        seconds, directories[method], error = timed(ctx.config.settle_s, SAVERS[method], ctx, state, fresh)
        sample = {"op": "save", "method": method, "seconds": seconds, "error": error, "warmup": warmup}
        if method == "ours":
            sample["phases"] = ctx.last_phases
        samples.append(sample)
    if ctx.config.cold and ctx.rank == 0:
        for directory in directories.values():
            if directory:
                evict_from_page_cache(directory)
    for method in order:
        if not on_every_rank(directories[method] is not None):
            error = "not run: the save failed"
            samples.append({"op": "load", "method": method, "seconds": None, "error": error, "warmup": warmup})
            continue
        for tensor in local_tensors(target):
            tensor.zero_()  # a load that writes nothing must not pass the check below
        seconds, _, error = timed(ctx.config.settle_s, LOADERS[method], ctx, target, directories[method])
        error = error or mismatch(state, target)
        samples.append({"op": "load", "method": method, "seconds": seconds, "error": error, "warmup": warmup})
    dist.barrier()  # every rank is done with the files before rank 0 deletes them
    if ctx.rank == 0:
        for directory in directories.values():
            if directory:
                shutil.rmtree(directory, ignore_errors=True)
    return samples


def rank_main(rank: int, world_size: int, config: BenchConfig) -> list[dict[str, Any]]:
    """One spawned rank (in its gloo group, see common.run_world): every round; this rank's samples."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mesh = init_device_mesh("cpu", (world_size,))
    rows = state_rows(config, world_size)
    state = make_state(rows, mesh, rank, world_size, zeros=False)
    target = make_state(rows, mesh, rank, world_size, zeros=True)
    saver = CheckpointSaver(os.path.join(config.workdir, f"ours-{world_size}ranks"), SaveConfig(async_save=False))
    ctx = RankContext(rank, world_size, config, saver)
    samples = []
    for round_index in range(config.warmup + config.repeats):
        ctx.round = round_index
        samples.extend(run_round(ctx, state, target))
    saver.close()
    dist.barrier()  # every rank closed the saver before its root goes
    if rank == 0:
        shutil.rmtree(saver.root.path, ignore_errors=True)  # uncommitted leftovers, `latest`, events
    return samples


# --- the parent: start ranks, merge, report ---


def summarize(world_size: int, config: BenchConfig, per_rank: list[list[dict[str, Any]]] | str) -> dict[str, Any]:
    """Per (op, method): the slowest rank's seconds per timed round, their median, every error; ratios."""
    summary: dict[str, Any] = {"ranks": world_size, "bytes_total": state_bytes(config, world_size)}
    for op in OPS:
        summary[op] = {m: {"seconds": [], "warmup_seconds": [], "median_s": None, "errors": []} for m in METHODS}
    phases: list[list[dict[str, float]]] = []  # per timed save of ours: every rank's phase times
    if isinstance(per_rank, str):
        for op in OPS:
            for method in METHODS:
                summary[op][method]["errors"].append(f"run failed: {per_rank}")
    else:
        for same_sample in zip(*per_rank):  # every rank's view of one (round, op, method)
            first = same_sample[0]
            entry = summary[first["op"]][first["method"]]
            errors = [f"rank {rank}: {s['error']}" for rank, s in enumerate(same_sample) if s["error"]]
            entry["errors"].extend(f"{'warm-up' if first['warmup'] else 'timed'} round: {e}" for e in errors)
            if errors:
                continue
            entry["warmup_seconds" if first["warmup"] else "seconds"].append(max(s["seconds"] for s in same_sample))
            if first.get("phases") and not first["warmup"]:
                phases.append([s["phases"] for s in same_sample])
    for op in OPS:
        for method in METHODS:
            entry = summary[op][method]
            entry["median_s"] = statistics.median(entry["seconds"]) if entry["seconds"] else None
        medians = {method: summary[op][method]["median_s"] for method in METHODS}
        summary[op]["ratios"] = {
            f"ours/{other}": ratio_or_none(medians["ours"], medians[other]) for other in ("dcp", "raw")
        }
    summary["ours_save_phases"] = {
        "per_save_per_rank": phases,
        "median_of_slowest_rank_s": phase_medians(phases, OUR_PHASES),
    }
    return summary


def format_table(summaries: list[dict[str, Any]]) -> str:
    """The table, the save target's verdict, our save's phases, and every failure."""
    names = ("ours s", "dcp s", "raw s", "ours/dcp", "ours/raw")
    header = f"{'ranks':>5}  {'op':<4}  " + "  ".join(f"{name:>8}" for name in names) + f"  {'GiB/s':>6}"
    lines, failures = [header, "-" * len(header)], []
    for summary in summaries:
        for op in OPS:
            cells = [_fmt_seconds(summary[op][method]) for method in METHODS]
            for method in METHODS:
                where = f"{summary['ranks']} rank(s), {op} {method}"
                failures.extend(f"{where}, {error}" for error in summary[op][method]["errors"])
            ours = summary[op]["ours"]["median_s"]
            rate = f"{summary['bytes_total'] / 2**30 / ours:6.2f}" if ours else f"{'-':>6}"
            ratios = summary[op]["ratios"]
            lines.append(
                f"{summary['ranks']:>5}  {op:<4}  {'  '.join(cells)}  "
                f"{_fmt_ratio(ratios['ours/dcp'])}  {_fmt_ratio(ratios['ours/raw'])}  {rate}"
            )
    lines.append("")
    for summary in summaries:
        ratio = summary["save"]["ratios"]["ours/dcp"]
        verdict = "no result" if ratio is None else f"{'met' if ratio <= SAVE_TARGET else 'MISSED'} ({ratio:.2f}x)"
        phases = summary["ours_save_phases"]["median_of_slowest_rank_s"]
        breakdown = ", ".join(f"{name[:-2]} {seconds:.3f}" for name, seconds in phases.items()) or "none recorded"
        lines.append(f"{summary['ranks']} rank(s): ours save <= {SAVE_TARGET:.2f}x dcp.save: {verdict}")
        lines.append(f"           ours save phases, s (median, slowest rank): {breakdown}")
    if failures:
        lines.append("failures (! marks a median over fewer samples than asked):")
        lines.extend(f"  {failure}" for failure in failures)
    return "\n".join(lines)


def _fmt_seconds(entry: dict[str, Any]) -> str:
    if entry["median_s"] is None:
        return f"{'FAILED':>8}"
    mark = "!" if entry["errors"] else ""
    return f"{entry['median_s']:.3f}{mark}".rjust(8)


def _fmt_ratio(ratio: float | None) -> str:
    return f"{ratio:7.2f}x" if ratio is not None else f"{'-':>8}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shared_arguments(
        parser,
        size_help="total state size over all ranks, GiB",
        repeats_help="samples per measurement; the median is reported",
        warmup_help="untimed rounds before the timed repeats",
    )
    parser.add_argument("--settle-s", type=float, default=1.0, help="pause after a sync before each timed method")
    parser.add_argument("--tensors", type=int, default=32, help="number of tensors in the state")
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: a fresh dir in the temp dir)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON file with every sample")
    parser.add_argument("--cold", action="store_true", help="evict checkpoint files from the page cache before loading")
    args = parser.parse_args(argv)
    if args.size_gib <= 0 or args.repeats < 1 or args.tensors < 1 or args.warmup < 0 or args.settle_s < 0:
        parser.error("--size-gib must be > 0, --repeats and --tensors >= 1, --warmup and --settle-s >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank_counts = parse_rank_counts(args.ranks)
    with checkpoint_workdir(args.workdir, prefix="shardckpt-bench-") as workdir:
        config = BenchConfig(
            size_gib=args.size_gib,
            tensors=args.tensors,
            repeats=args.repeats,
            warmup=args.warmup,
            settle_s=args.settle_s,
            workdir=workdir,
            cold=args.cold,
        )
        report: dict[str, Any] = {"config": {**asdict(config), "ranks": rank_counts}, "environment": environment()}
        report["results"] = []
        for world_size in rank_counts:
            print(f"running {world_size} rank(s): {args.size_gib} GiB, {args.repeats} repeat(s), {workdir}", flush=True)
            report["results"].append(
                summarize(world_size, config, run_world(world_size, rank_main, config, RANK_TIMEOUT_S))
            )
    table = format_table(report["results"])
    report["table"] = table.splitlines()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=2)
    print(table)
    print(f"wrote {args.out}")
    failed = any(s[op][method]["errors"] for s in report["results"] for op in OPS for method in METHODS)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
