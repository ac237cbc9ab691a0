"""Time to resume: same-size and resharded restores beside a raw read of the same bytes and plain dcp.load, in one run.

Run from the repository root:

    .venv/bin/python benchmarks/resume.py                       # 1 GiB in all, 3 repeats, page cache warm
    .venv/bin/python benchmarks/resume.py --cold                # evict the files from the page cache before each load
    .venv/bin/python benchmarks/resume.py --size-gib 0.25 --repeats 1

A state of --size-gib GiB in all (--tensors float32 tensors of 1x..8x sizes, each a Shard(0) DTensor) is
saved once by our engine on 2, 3 and 4 gloo CPU ranks, then restored in a world of M ranks (2 and 4):

  case          what M ranks do, per rank                                        compared with
  same N->N     load_checkpoint of the checkpoint saved on N = M ranks            raw N
  resharded     load_checkpoint of the one saved on N != M (4->2, 3->2, 2->4)      same M->M
  raw N         read its own shard file of the N = M checkpoint into a reused      (the floor)
                buffer with plain readinto: the same bytes a same-size restore reads, no checksum
  dcp.load N->N torch.distributed.checkpoint.load of the N = M checkpoint (FileSystemReader)
  one tensor    load_checkpoint of a checkpoint saved on 2 ranks holding the same      same 2->2
                bytes as ONE tensor (each rank's shard one huge chunk)
  first 2->2    same 2->2, but into FRESH tensors every round (a new anonymous mapping,   same 2->2
                never touched): the kernel faults each page in during the load, as in a
                process's first restore (a drill's, a restarted job's before its model
                was initialized)

Each sample is wall time from a barrier before to a barrier after (the slowest rank counts), into
tensors allocated once (the warm-up round touches them; `first` excepted), checked bit-exact against the saved values.
Every load checks every chunk's checksum (load_checkpoint's default). Cases rotate order from round to
round. Without --cold the files sit in the page cache (they were just written or read): the numbers
are then memory-bound and show the software's cost; --cold asks the kernel to drop each file's pages
first (posix_fadvise DONTNEED on fsynced files), which this machine's disk honours only roughly.
Targets (issue 13): resharded <= 1.3x same-size; same-size <= 1.5x raw. Issue 30: one huge chunk reads at
>= 0.9x the throughput of many medium ones (one tensor <= 1.11x the time of same 2->2).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import save_load
import torch
import torch.distributed.checkpoint as dcp

# benchmarks/common.py and save_load.py: run as a script, this file's folder is sys.path[0]
from common import COLUMNS, checkpoint_workdir, environment, run_world, tensor_rows
from save_load import evict_from_page_cache, mismatch, timed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_shardckpt import CheckpointSaver, LoadConfig, SaveConfig, load_checkpoint
from lightning_shardckpt.engine.format.names import shard_filename

ONE_TENSOR = "2-one-tensor"  # saved on 2 ranks, the same bytes as one tensor
SAVED_WORLDS = (2, 3, 4, ONE_TENSOR)  # every checkpoint is saved once, on this many ranks (or this layout)
# restoring world -> (label, method, saved world); the first row of each world is its same-size reference
CASES = {
    2: [
        ("same 2->2", "ours", 2),
        ("resharded 4->2", "ours", 4),
        ("resharded 3->2", "ours", 3),
        ("raw 2", "raw", 2),
        ("dcp.load 2->2", "dcp", 2),
        ("one tensor 2->2", "ours", ONE_TENSOR),
        ("first 2->2", "first", 2),
    ],
    4: [("same 4->4", "ours", 4), ("resharded 2->4", "ours", 2), ("raw 4", "raw", 4), ("dcp.load 4->4", "dcp", 4)],
}
ROW_MULTIPLE = 12  # rows divisible by 2, 3 and 4: every world holds even shards
RESHARD_TARGET = 1.3  # resharded restore / same-size restore
RAW_TARGET = 1.5  # same-size restore / raw read
ONE_TENSOR_TARGET = 1 / 0.9  # one huge chunk / many medium chunks, same bytes: >= 0.9x the throughput
RANK_TIMEOUT_S = 900
DEFAULT_OUT = "benchmarks/results/resume.json"


@dataclass(frozen=True)
class BenchConfig(save_load.BenchConfig):
    """save_load.py's settings (size, tensors, repeats, warm-up, settle, workdir, cold) and the reader's threads."""

    read_threads: int | None = None  # None: the engine's default


def rows_of(config: BenchConfig, saved_on: int | str = 2) -> list[int]:
    rows = tensor_rows(config.tensors, ROW_MULTIPLE, config.size_gib, per_rank=False)
    return [sum(rows)] if saved_on == ONE_TENSOR else rows


def world_of(saved_on: int | str) -> int:
    return 2 if saved_on == ONE_TENSOR else int(saved_on)


def make_state(rows: list[int], rank: int, world_size: int, *, zeros: bool) -> dict[str, DTensor]:
    """This rank's Shard(0) part of every tensor; values depend only on (tensor, global row, column), so
    any world's restore can be checked against the values its own rows had when saved."""
    mesh = init_device_mesh("cpu", (world_size,))
    state = {}
    for index, global_rows in enumerate(rows):
        local_rows = global_rows // world_size
        first = rank * local_rows
        if zeros:
            local = torch.zeros(local_rows, COLUMNS)
        else:
            row_values = torch.arange(first, first + local_rows, dtype=torch.float32)[:, None] * 0.25
            local = row_values + torch.arange(COLUMNS, dtype=torch.float32)[None, :] * 1e-3 + index
        state[f"layer{index:02d}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], shape=torch.Size((global_rows, COLUMNS)), stride=(COLUMNS, 1)
        )
    return state


def saved_root(config: BenchConfig, saved_on: int | str) -> str:
    return os.path.join(config.workdir, f"saved-on-{saved_on}")


def save_rank(rank: int, world_size: int, config: BenchConfig, saved_on: int | str) -> str:
    """A spawned rank of the saving world: one committed checkpoint; its directory."""
    saver = CheckpointSaver(saved_root(config, saved_on), SaveConfig(async_save=False))
    try:
        state = make_state(rows_of(config, saved_on), rank, world_size, zeros=False)
        result = saver.save(state, step=world_size).result()
    finally:
        saver.close()
    if not result.committed:
        raise RuntimeError(f"save on {world_size} ranks failed: {result.error}")
    return result.path


def load_rank(rank: int, world_size: int, config: BenchConfig) -> list[dict[str, Any]]:
    """A spawned rank of the restoring world: every case of CASES[world_size], warm-up and repeats; its samples."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    layouts = {saved_on for _, _, saved_on in CASES[world_size]}  # the one-tensor state has its own tensors
    expected = {layout: make_state(rows_of(config, layout), rank, world_size, zeros=False) for layout in layouts}
    targets = {layout: make_state(rows_of(config, layout), rank, world_size, zeros=True) for layout in layouts}
    shard_file = os.path.join(_committed_dir(saved_root(config, world_size)), shard_filename(rank))
    raw_buffer = bytearray(os.path.getsize(shard_file))
    load_config = LoadConfig() if config.read_threads is None else LoadConfig(read_threads=config.read_threads)
    cases = CASES[world_size]
    samples = []
    for round_index in range(config.warmup + config.repeats):
        shift = round_index % len(cases)
        for label, method, saved_on in cases[shift:] + cases[:shift]:
            directory = _committed_dir(saved_root(config, saved_on))
            if config.cold and rank == 0:
                evict_from_page_cache(directory)
            target = targets[saved_on] if method != "first" else fresh_state(rows_of(config, saved_on), world_size)
            for tensor in target.values() if method != "first" else ():
                tensor.to_local().zero_()  # a load that writes nothing must not pass the check
            if method == "raw":
                seconds, value, error = timed(config.settle_s, _read_raw, shard_file, raw_buffer)
            elif method == "dcp":
                seconds, value, error = timed(
                    config.settle_s,
                    lambda directory=directory, target=target: dcp.load(target, checkpoint_id=directory),
                )
            else:  # ours, into the targets or (first) into fresh ones
                seconds, value, error = timed(
                    config.settle_s,
                    lambda directory=directory, target=target: load_checkpoint(target, directory, config=load_config),
                )
            error = error or (None if method == "raw" else mismatch(expected[saved_on], target))
            sample = {"case": label, "seconds": seconds, "error": error, "warmup": round_index < config.warmup}
            if method in ("ours", "first") and value is not None:
                sample.update(
                    read_s=getattr(value, "read_s", None),
                    place_s=getattr(value, "place_s", None),
                    bytes_read=value.bytes_read,
                )
            samples.append(sample)
    return samples


def fresh_state(rows: list[int], world_size: int) -> dict[str, DTensor]:
    """This rank's Shard(0) part of every tensor in memory no one has touched: one new anonymous mapping
    (unmapped when the tensors are dropped). A fresh mapping reads as zeros, so a load that writes nothing
    fails the check as with the zeroed targets."""
    mesh = init_device_mesh("cpu", (world_size,))
    local_rows = [global_rows // world_size for global_rows in rows]
    memory = torch.frombuffer(mmap.mmap(-1, sum(local_rows) * COLUMNS * 4), dtype=torch.float32)
    state, used = {}, 0
    for index, (global_rows, count) in enumerate(zip(rows, local_rows)):
        local = memory[used : used + count * COLUMNS].view(count, COLUMNS)
        used += count * COLUMNS
        state[f"layer{index:02d}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], shape=torch.Size((global_rows, COLUMNS)), stride=(COLUMNS, 1)
        )
    return state


def _read_raw(path: str, buffer: bytearray) -> int:
    view = memoryview(buffer)
    filled = 0
    with open(path, "rb", buffering=0) as handle:
        while filled < len(view):
            count = handle.readinto(view[filled:])
            if not count:
                break
            filled += count
    return filled


def _committed_dir(root: str) -> str:
    names = sorted(name for name in os.listdir(root) if name.startswith("step-"))
    return os.path.join(root, names[-1])


# --- the parent ---


def summarize(world_size: int, per_rank: list[list[dict[str, Any]]] | str) -> list[dict[str, Any]]:
    """Per case: the slowest rank's seconds per timed round (min/median/max), errors, our reader's split."""
    rows = {
        label: {
            "case": label,
            "ranks": world_size,
            "seconds": [],
            "read_s": [],
            "place_s": [],
            "bytes_read": 0,
            "errors": [],
        }
        for label, _, _ in CASES[world_size]
    }
    if isinstance(per_rank, str):
        for row in rows.values():
            row["errors"].append(f"run failed: {per_rank}")
        return list(rows.values())
    for same_sample in zip(*per_rank):
        row = rows[same_sample[0]["case"]]
        errors = [f"rank {rank}: {s['error']}" for rank, s in enumerate(same_sample) if s["error"]]
        row["errors"].extend(errors)
        if errors or same_sample[0]["warmup"]:
            continue
        row["seconds"].append(max(s["seconds"] for s in same_sample))
        if same_sample[0].get("read_s") is not None:
            row["read_s"].append(max(s["read_s"] for s in same_sample))
            row["place_s"].append(max(s["place_s"] or 0.0 for s in same_sample))
            row["bytes_read"] = sum(s["bytes_read"] for s in same_sample)
    for row in rows.values():
        row["median_s"] = statistics.median(row["seconds"]) if row["seconds"] else None
    return list(rows.values())


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's ratio to what it is judged against (see the module docstring)."""
    by_case = {row["case"]: row for row in rows}
    for row in rows:
        label, world = row["case"], row["ranks"]
        reference = None
        if label.startswith(("resharded", "dcp.load", "one tensor", "first")):
            reference = f"same {world}->{world}"
        elif label.startswith("same"):
            reference = f"raw {world}"
        base = by_case.get(reference, {}).get("median_s") if reference else None
        row["vs"] = reference
        row["ratio"] = row["median_s"] / base if row["median_s"] and base else None
    return rows


def format_table(rows: list[dict[str, Any]], size_bytes: int) -> str:
    header = f"{'case':<16} {'ranks':>5} {'min s':>7} {'median s':>8} {'max s':>7} {'GiB/s':>6} {'read s':>7} {'place s':>7}  ratio"
    lines = [header, "-" * len(header)]
    failures = []
    for row in rows:
        failures.extend(f"{row['case']}: {error}" for error in row["errors"])
        if row["median_s"] is None:
            lines.append(f"{row['case']:<16} {row['ranks']:>5} {'FAILED':>7}")
            continue
        ratio = f"{row['ratio']:.2f}x {row['vs']}" if row["ratio"] else ""
        read = f"{statistics.median(row['read_s']):7.3f}" if row["read_s"] else f"{'-':>7}"
        place = f"{statistics.median(row['place_s']):7.3f}" if row["place_s"] else f"{'-':>7}"
        lines.append(
            f"{row['case']:<16} {row['ranks']:>5} {min(row['seconds']):7.3f} {row['median_s']:8.3f} {max(row['seconds']):7.3f} "
            f"{size_bytes / 2**30 / row['median_s']:6.2f} {read} {place}  {ratio}"
        )
    lines.append("")
    for row in rows:
        target = (
            RESHARD_TARGET
            if row["case"].startswith("resharded")
            else RAW_TARGET
            if row["case"].startswith("same")
            else ONE_TENSOR_TARGET
            if row["case"].startswith("one tensor")
            else None
        )
        if target and row["ratio"]:
            lines.append(
                f"target {row['case']} <= {target}x {row['vs']}: {'met' if row['ratio'] <= target else 'MISSED'} ({row['ratio']:.2f}x)"
            )
    if failures:
        lines.append("failures:")
        lines.extend(f"  {failure}" for failure in failures)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="state size over all ranks, GiB")
    parser.add_argument("--tensors", type=int, default=16, help="number of tensors in the state")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; min/median/max over them")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed rounds first (first touch of buffers, lazy imports)"
    )
    parser.add_argument("--settle-s", type=float, default=0.5, help="pause after a sync before each timed load")
    parser.add_argument(
        "--cold", action="store_true", help="drop each checkpoint's pages from the page cache before a load"
    )
    parser.add_argument(
        "--read-threads", type=int, default=None, help="LoadConfig.read_threads (default: the engine's)"
    )
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: a fresh dir in the temp dir)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON file with every sample")
    args = parser.parse_args(argv)
    if args.size_gib <= 0 or args.repeats < 1 or args.tensors < 1 or args.warmup < 0 or args.settle_s < 0:
        parser.error("--size-gib must be > 0, --repeats and --tensors >= 1, --warmup and --settle-s >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with checkpoint_workdir(args.workdir, prefix="shardckpt-resume-") as workdir:
        config = BenchConfig(
            size_gib=args.size_gib,
            tensors=args.tensors,
            repeats=args.repeats,
            warmup=args.warmup,
            settle_s=args.settle_s,
            workdir=workdir,
            cold=args.cold,
            read_threads=args.read_threads,
        )
        report: dict[str, Any] = {"config": asdict(config), "environment": environment(), "results": []}
        for saved_on in SAVED_WORLDS:
            print(f"saving on {saved_on} rank(s): {args.size_gib} GiB in {workdir}", flush=True)
            saved = run_world(world_of(saved_on), partial(save_rank, saved_on=saved_on), config, RANK_TIMEOUT_S)
            if isinstance(saved, str):
                print(f"save on {saved_on} ranks failed: {saved}")
                return 1
        for world_size in CASES:
            print(f"restoring on {world_size} rank(s), {args.repeats} repeat(s)", flush=True)
            report["results"].extend(
                with_ratios(summarize(world_size, run_world(world_size, load_rank, config, RANK_TIMEOUT_S)))
            )
    table = format_table(report["results"], sum(rows_of(config)) * COLUMNS * 4)
    report["table"] = table.splitlines()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=2)
    print(table)
    print(f"wrote {args.out}")
    return 1 if any(row["errors"] for row in report["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
