"""What restore drills cost: training slowdown at the default cadence, and time-to-resume by drill world size.

Run from the repository root:

    .venv/bin/python benchmarks/drills.py                      # both parts, 3 runs each
    .venv/bin/python benchmarks/drills.py --part resume --size-gib 0.25
    .venv/bin/python benchmarks/drills.py --part slowdown --runs 3 --every-n-checkpoints 1

Part `slowdown`: the main job's model (recipes/lm.py, wider) trains on 2 DDP CPU ranks with a
checkpoint every --save-every steps, once without drills, once with in-training drills every
--every-n-checkpoints checkpoints (the recipe's default cadence unless given) and once with drills
`external`: a follower (`shardckpt drill --follow`, started warm before training, under `nice -n 19` on
this same node: the case with no spare node) drills at that cadence, rotating the order, --runs times.
Loop time is measured on rank 0 from on_train_start to on_train_end (the final save's wait is not in it).
Slowdown = with / without - 1, within each run; min/median/max over runs.

Part `resume`: a state of --size-gib GiB per rank is written on 2 ranks. The reference is the warm
same-size resume of `resume.py` (same 2 -> 2): 2 gloo ranks load it with `load_checkpoint` into tensors
they already touched, a warm-up round then --runs timed rounds, barrier to barrier; once before the
2-rank drills and once after them (2 x --runs samples: the load of a shared machine drifts). It is drilled
--runs times on 2 ranks (= the writer), then --runs times on 1 rank (resharded), all through ONE warm pool
kept for the part (as a training run's drill runner or a follower keeps one), with --keep-memory-gib
(default: drill.keep_memory_gib's 2 GiB; 0: ranks forked per drill): a warm-up drill first on each world
size (it starts the kept ranks and builds their destination, as a run's first drill does; printed, not in
the statistics). Grouped by world size, since a world-size change replaces the kept ranks. Before each
timed load and each drill: `sync` and --settle-s of pause, as `resume.py` does (and drills come checkpoints
apart: a kept rank refills its tensors with NaN after each drill, ~0.1-0.2 s per 0.5 GiB here, which a drill
handed over back to back would wait for in its process start). Time-to-resume
is wall time from the starter handing out the drill to the restored state; the drill record splits it
(process start = fork or hand-over to the kept ranks, process group, listing, target = the destination
tensors, load: metadata + read + reshard with checksums; each phase also as process CPU seconds,
`*_cpu_s`). Printed: drill on 2 ranks / warm same-size resume, medians (target <= 1.3x, issue 36).

Writes --out-dir/drills.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = Path(__file__).with_name("drills_training.py")


MODES = ("none", "training", "external")


def slowdown(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for run in range(args.runs):
        order = MODES[run % 3 :] + MODES[: run % 3]  # each mode goes first once in three runs
        times = {mode: _train(args, mode) for mode in order}
        off, off_cpu = times["none"]["loop_s"], times["none"]["loop_cpu_s"]
        runs.append(
            {
                "order": list(order),
                "loop_s": {mode: times[mode]["loop_s"] for mode in MODES},
                "slowdown": {mode: times[mode]["loop_s"] / off - 1 for mode in MODES[1:]},
                # rank 0's own CPU over the loop: the cost drills put into the training process itself
                "cpu_slowdown": {mode: times[mode]["loop_cpu_s"] / off_cpu - 1 for mode in MODES[1:]},
                "drills": {mode: times[mode].get("drills") for mode in MODES[1:]},
                "checkpoints": times["none"].get("checkpoints"),
            }
        )
        print(
            f"  run {run + 1}: without drills {off:.2f}s; "
            + "; ".join(
                f"{mode} {times[mode]['loop_s']:.2f}s ({runs[-1]['slowdown'][mode] * 100:+.1f}%, "
                f"rank 0 CPU {runs[-1]['cpu_slowdown'][mode] * 100:+.1f}%, {times[mode].get('drills')} drills)"
                for mode in MODES[1:]
            ),
            flush=True,
        )
    result: dict[str, Any] = {"runs": runs}
    for mode in MODES[1:]:
        slow = [run["slowdown"][mode] for run in runs]
        cpu = [run["cpu_slowdown"][mode] for run in runs]
        result[mode] = {"min": min(slow), "median": statistics.median(slow), "max": max(slow)}
        result[f"{mode}_rank0_cpu"] = {"min": min(cpu), "median": statistics.median(cpu), "max": max(cpu)}
    return result


def _start_follower(root: str, args: argparse.Namespace) -> subprocess.Popen:
    """A warm follower on this node at nice +19 (its drill workers too); returns once it is warm."""
    command = ["nice", "-n", "19", sys.executable, "-m", "lightning_shardckpt.cli.main", "drill", root, "--follow"]
    command += ["--every-n-checkpoints", str(args.every_n_checkpoints), "--interval", "1", "--probe", "lm:probe"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "recipes"), str(REPO)])}
    follower = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    for line in follower.stderr:  # "following ROOT: drill workers warm in ..."
        if "drill workers warm" in line:
            return follower
    raise RuntimeError(f"the drill follower exited with {follower.wait()} before it was warm")


def _train(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="shardckpt-drillbench-") as workdir:
        out = os.path.join(workdir, "result.json")
        command = [
            sys.executable,
            str(TRAIN_SCRIPT),
            "--root",
            os.path.join(workdir, "ckpt"),
            "--out",
            out,
            "--steps",
            str(args.steps),
            "--save-every",
            str(args.save_every),
            "--d-model",
            str(args.d_model),
        ]
        follower = None
        if mode == "training":
            command += ["--drill-every", str(args.every_n_checkpoints)]
        elif mode == "external":
            command += ["--drill-mode", "external"]
            follower = _start_follower(os.path.join(workdir, "ckpt"), args)
        try:
            subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            if follower is not None:
                follower.terminate()  # SIGTERM: the follower stops cleanly
                follower.wait(60)
        result = json.loads(Path(out).read_text())
        if mode == "external":  # the follower's drills, counted once it stopped
            from lightning_shardckpt.engine.format import drill_records
            from lightning_shardckpt.engine.storage.fsio import resolve

            records = drill_records.list_record_names(resolve(os.path.join(workdir, "ckpt")))
            result["drills"] = sum(len(names) for names in records.values())
        return result


def resume(args: argparse.Namespace) -> dict[str, Any]:
    from common import run_world, tensor_rows

    from lightning_shardckpt.policies.drills.runner import DrillOptions, run_drill, warm_pool

    with tempfile.TemporaryDirectory(prefix="shardckpt-drillbench-") as workdir:
        root = os.path.join(workdir, "ckpt")
        rows = tensor_rows(16, 2, args.size_gib, per_rank=True)
        outcome = run_world(2, _write_state, {"root": root, "rows": rows}, 600)
        if isinstance(outcome, str):
            raise RuntimeError(outcome)
        path = outcome[0]
        config = {"path": path, "rows": rows, "rounds": args.runs, "settle_s": args.settle_s}
        warm_s: list[float] = []
        samples: dict[int, list[dict[str, Any]]] = {2: [], 1: []}
        first: dict[int, dict[str, Any]] = {}
        options = DrillOptions(timeout_s=1200, nice=0, keep_memory_gib=args.keep_memory_gib)
        pool = warm_pool(options)
        try:
            for world_size in (2, 1):
                # the reference before the 2-rank drills and again after them: a shared machine's load drifts
                warm_s += _warm_rounds(run_world, config)
                sized = DrillOptions(**{**options.__dict__, "world_size": world_size})
                first[world_size] = _drill(run_drill, path, sized, pool, args.settle_s)
                print(f"  warm-up drill on {world_size} rank(s): {_line(first[world_size])}", flush=True)
                for run in range(args.runs):
                    record = _drill(run_drill, path, sized, pool, args.settle_s)
                    samples[world_size].append(record)
                    print(f"  run {run + 1}: drill on {world_size} rank(s): {_line(record)}", flush=True)
        finally:
            pool.close()
        bytes_total = samples[2][0]["bytes_read"]
        return {
            "bytes": bytes_total,
            "warm_resume_s": {"samples": warm_s, **_spread(warm_s)},
            "first_drill": first,
            "by_world_size": {ws: _stats(records) for ws, records in samples.items()},
        }


def _warm_rounds(run_world: Any, config: dict[str, Any]) -> list[float]:
    """One world of 2 ranks doing resume.py's warm same-size rounds; each round's slowest rank."""
    warm = run_world(2, _warm_resume, config, 600)
    if isinstance(warm, str):
        raise RuntimeError(warm)
    rounds = [max(per_rank[index] for per_rank in warm) for index in range(config["rounds"])]
    print("  warm same-size resume 2 -> 2: " + ", ".join(f"{seconds:.3f}s" for seconds in rounds), flush=True)
    return rounds


def _warm_resume(rank: int, world_size: int, config: dict[str, Any]) -> list[float]:
    """resume.py's same N -> N, warm: load_checkpoint into tensors this rank touched, a warm-up round first;
    the seconds of each timed round, barrier to barrier."""
    from common import make_state
    from save_load import timed
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_shardckpt import LoadConfig, load_checkpoint

    mesh = init_device_mesh("cpu", (world_size,))
    target = {"model": make_state(config["rows"], mesh, rank, world_size, zeros=True)}
    seconds, load_config = [], LoadConfig()
    for round_index in range(1 + config["rounds"]):
        spent, _, error = timed(config["settle_s"], lambda: load_checkpoint(target, config["path"], config=load_config))
        if error:
            raise RuntimeError(error)
        if round_index:
            seconds.append(spent)
    return seconds


def _drill(run_drill: Any, path: str, options: Any, pool: Any, settle_s: float) -> dict[str, Any]:
    os.sync()  # as resume.py's timed rounds: earlier writes drain, then a pause (drills come checkpoints apart)
    time.sleep(settle_s)
    record = run_drill(path, options, pool=pool)
    if record["verdict"] != "passed":
        raise RuntimeError(f"drill failed: {record.get('cause')}")
    return record


def _line(record: dict[str, Any]) -> str:
    timings = record["timings"]
    phases = ("init", "listing", "target", "load")
    return (
        f"time to resume {record['time_to_resume_s']:.3f}s (process start {timings['process_start_s']:.3f}; "
        + ", ".join(
            f"{phase} {timings[f'{phase}_s']:.3f} wall / {timings[f'{phase}_cpu_s']:.3f} CPU" for phase in phases
        )
        + ")"
    )


def _write_state(rank: int, world_size: int, config: dict[str, Any]) -> str:
    from common import make_state
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_shardckpt import CheckpointSaver, SaveConfig

    mesh = init_device_mesh("cpu", (world_size,))
    state = make_state(config["rows"], mesh, rank, world_size)
    saver = CheckpointSaver(config["root"], SaveConfig(async_save=False))
    result = saver.save({"model": state}, step=1).result()
    saver.close()
    return result.path


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    split = {key: _spread([r["timings"][key] for r in records]) for key in records[0]["timings"]}
    return {
        "rank_process": sorted({r["rank_process"] for r in records}),
        "time_to_resume_s": _spread([r["time_to_resume_s"] for r in records]),
        "minus_process_start_s": _spread([r["time_to_resume_s"] - r["timings"]["process_start_s"] for r in records]),
        "read_gbps": _spread([r["read_gbps"] for r in records]),
        "split_s": split,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("both", "slowdown", "resume"), default="both")
    parser.add_argument("--runs", type=int, default=3, help="pairs (slowdown) / drills per world size (resume)")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per training run")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--every-n-checkpoints", type=int, default=None, help="drill cadence (default: the recipe's)")
    parser.add_argument("--d-model", type=int, default=192, help="model width: sets the step time")
    parser.add_argument("--size-gib", type=float, default=0.5, help="state per rank for the resume part")
    parser.add_argument(
        "--settle-s", type=float, default=1.0, help="resume part: sync and pause before each timed load or drill"
    )
    parser.add_argument(
        "--keep-memory-gib", type=float, default=2.0, help="drill.keep_memory_gib for the resume part (0: fork)"
    )
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.every_n_checkpoints is None:
        import yaml

        args.every_n_checkpoints = yaml.safe_load((REPO / "conf/checkpoint/default.yaml").read_text())["drill"][
            "every_n_checkpoints"
        ]
    report: dict[str, Any] = {"args": vars(args), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if args.part in ("both", "slowdown"):
        print(
            f"slowdown: 2 DDP ranks, {args.steps} steps, checkpoint every {args.save_every}, "
            f"drill every {args.every_n_checkpoints} checkpoint(s); {args.runs} pairs",
            flush=True,
        )
        report["slowdown"] = result = slowdown(args)
        for mode, target in (("training", 5), ("external", 1)):
            print(
                f"training slowdown with drills {mode}: min {result[mode]['min'] * 100:+.1f}%, median "
                f"{result[mode]['median'] * 100:+.1f}%, max {result[mode]['max'] * 100:+.1f}% (target <= +{target}%)"
            )
            cpu = result[f"{mode}_rank0_cpu"]
            print(
                f"  rank 0's own CPU over the loop, drills {mode}: min {cpu['min'] * 100:+.1f}%, median "
                f"{cpu['median'] * 100:+.1f}%, max {cpu['max'] * 100:+.1f}%"
            )
    if args.part in ("both", "resume"):
        print(
            f"resume: {args.size_gib} GiB per rank written on 2 ranks; drills on 2 and on 1 rank, {args.runs} each",
            flush=True,
        )
        report["resume"] = result = resume(args)
        for world_size, stats in result["by_world_size"].items():
            ttr, split, net = stats["time_to_resume_s"], stats["split_s"], stats["minus_process_start_s"]
            print(
                f"  drill on {world_size} rank(s){' (= writer)' if world_size == 2 else ' (resharded)'}, "
                f"{'/'.join(stats['rank_process'])} ranks: time to resume "
                f"min {ttr['min']:.3f} / median {ttr['median']:.3f} / max {ttr['max']:.3f} s; minus process start "
                f"{net['min']:.3f} / {net['median']:.3f} / {net['max']:.3f} s; median split: "
                + ", ".join(f"{k} {v['median']:.3f}" for k, v in split.items() if k != "time_to_resume_s")
                + f"; read {stats['read_gbps']['median']:.2f} GB/s"
            )
        warm = result["warm_resume_s"]
        drill = result["by_world_size"][2]["time_to_resume_s"]
        print(
            f"  warm same-size resume 2 -> 2: min {warm['min']:.3f} / median {warm['median']:.3f} / max "
            f"{warm['max']:.3f} s; drill on 2 ranks / warm resume, medians: {drill['median'] / warm['median']:.2f}x "
            "(target <= 1.3x)"
        )
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "drills.json")
    Path(path).write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
