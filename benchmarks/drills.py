"""What restore drills cost: training slowdown at the default cadence, and time-to-resume by drill world size.

Run from the repository root:

    .venv/bin/python benchmarks/drills.py                      # both parts, 3 runs each
    .venv/bin/python benchmarks/drills.py --part resume --size-gib 0.25
    .venv/bin/python benchmarks/drills.py --part slowdown --runs 3 --every-n-checkpoints 1

Part `slowdown`: the main job's model (recipes/lm.py, wider) trains on 2 DDP CPU ranks with a
checkpoint every --save-every steps, once without drills and once with drills every
--every-n-checkpoints checkpoints (the recipe's default cadence unless given), alternating, --runs
times. Loop time is measured on rank 0 from on_train_start to on_train_end (the final save's wait is
not in it). Slowdown = with / without - 1, per pair; min/median/max over pairs.

Part `resume`: a state of --size-gib GiB per rank is written on 2 ranks, then drilled --runs times on
2 ranks (= the writer) and on 1 rank (resharded), alternating. Time-to-resume is wall time from the
drill's process start to the restored state; the drill record splits it (process start and imports,
process group, listing, load: metadata + read + reshard with checksums).

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


def slowdown(args: argparse.Namespace) -> dict[str, Any]:
    pairs = []
    for run in range(args.runs):
        order = (None, args.every_n_checkpoints) if run % 2 == 0 else (args.every_n_checkpoints, None)
        times = {}
        for cadence in order:
            times[cadence] = _train(args, cadence)
        off, on = times[None], times[args.every_n_checkpoints]
        pairs.append(
            {
                "without_s": off["loop_s"],
                "with_s": on["loop_s"],
                "slowdown": on["loop_s"] / off["loop_s"] - 1,
                "drills": on.get("drills"),
                "checkpoints": on.get("checkpoints"),
            }
        )
        print(
            f"  run {run + 1}: without drills {off['loop_s']:.2f}s, with {on['loop_s']:.2f}s "
            f"({pairs[-1]['slowdown'] * 100:+.1f}%), drills finished {on.get('drills')}",
            flush=True,
        )
    slow = [pair["slowdown"] for pair in pairs]
    return {
        "pairs": pairs,
        "slowdown_min": min(slow),
        "slowdown_median": statistics.median(slow),
        "slowdown_max": max(slow),
    }


def _train(args: argparse.Namespace, cadence: int | None) -> dict[str, Any]:
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
        if cadence is not None:
            command += ["--drill-every", str(cadence)]
        subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(Path(out).read_text())


def resume(args: argparse.Namespace) -> dict[str, Any]:
    from common import run_world, tensor_rows

    from lightning_shardckpt.policies.drill_runner import DrillOptions, run_drill

    with tempfile.TemporaryDirectory(prefix="shardckpt-drillbench-") as workdir:
        root = os.path.join(workdir, "ckpt")
        rows = tensor_rows(16, 2, args.size_gib, per_rank=True)
        outcome = run_world(2, _write_state, {"root": root, "rows": rows}, 600)
        if isinstance(outcome, str):
            raise RuntimeError(outcome)
        path = outcome[0]
        samples: dict[int, list[dict[str, Any]]] = {2: [], 1: []}
        for run in range(args.runs):
            for world_size in (2, 1) if run % 2 == 0 else (1, 2):
                record = run_drill(path, DrillOptions(world_size=world_size, timeout_s=1200, nice=0))
                if record["verdict"] != "passed":
                    raise RuntimeError(f"drill failed: {record.get('cause')}")
                samples[world_size].append(record)
                print(
                    f"  run {run + 1}: drill on {world_size} rank(s): time to resume {record['time_to_resume_s']:.2f}s",
                    flush=True,
                )
        bytes_total = samples[2][0]["bytes_read"]
        return {"bytes": bytes_total, "by_world_size": {ws: _stats(records) for ws, records in samples.items()}}


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


def _stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    def spread(values: list[float]) -> dict[str, float]:
        return {"min": min(values), "median": statistics.median(values), "max": max(values)}

    split = {key: spread([r["timings"][key] for r in records]) for key in records[0]["timings"]}
    return {
        "time_to_resume_s": spread([r["time_to_resume_s"] for r in records]),
        "read_gbps": spread([r["read_gbps"] for r in records]),
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
        print(
            f"training slowdown with drills: min {result['slowdown_min'] * 100:+.1f}%, median "
            f"{result['slowdown_median'] * 100:+.1f}%, max {result['slowdown_max'] * 100:+.1f}% (target <= +5%)"
        )
    if args.part in ("both", "resume"):
        print(
            f"resume: {args.size_gib} GiB per rank written on 2 ranks; drills on 2 and on 1 rank, {args.runs} each",
            flush=True,
        )
        report["resume"] = result = resume(args)
        for world_size, stats in result["by_world_size"].items():
            ttr, split = stats["time_to_resume_s"], stats["split_s"]
            print(
                f"  drill on {world_size} rank(s){' (= writer)' if world_size == 2 else ' (resharded)'}: time to resume "
                f"min {ttr['min']:.2f} / median {ttr['median']:.2f} / max {ttr['max']:.2f} s; median split: "
                + ", ".join(f"{k} {v['median']:.2f}" for k, v in split.items() if k != "time_to_resume_s")
                + f"; read {stats['read_gbps']['median']:.2f} GB/s"
            )
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "drills.json")
    Path(path).write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
