"""Peak memory of `shardckpt export`: a 1 GiB checkpoint of 64 MiB tensors, both formats, three runs each.

    .venv/bin/python benchmarks/export_memory.py [--size-gib 1] [--tensor-mib 64] [--runs 3] [--dir /tmp]

Each export runs in a fresh interpreter that reports its own peak RSS (ru_maxrss); a baseline interpreter
that only imports the package gives the interpreter's share. The target (issue 14) is

    peak RSS <= baseline + 3 x largest tensor

i.e. the model never has to fit in memory: one global tensor, one read buffer and the writer's copy at
most. Printed per format: min / median / max of the peak over the runs, and the ratio
(peak - baseline) / largest tensor. Page cache is not RSS: a warm read does not flatter the number.
No assertion: numbers are noisy on a shared machine; read the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMATS = ("torch", "safetensors")
TARGET_RATIO = 3.0  # peak above the interpreter, in units of the largest tensor

_SAVE = """
import sys, torch
from lightning_shardckpt import CheckpointSaver, SaveConfig
root, count, numel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
state = {"model": {f"layer{i:02d}.weight": torch.rand(numel) for i in range(count)}}
saver = CheckpointSaver(root, SaveConfig(async_save=False, write_events=False))
assert saver.save(state, step=1).result(timeout=600).committed
saver.close()
"""

_EXPORT = """
import json, resource, sys, time
from lightning_shardckpt import ExportOptions, export_checkpoint
started = time.perf_counter()
result = export_checkpoint(sys.argv[1], sys.argv[2], ExportOptions(format=sys.argv[3], progress=False))
print(json.dumps({"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "seconds": time.perf_counter() - started,
                  "bytes": result.bytes_written}))
"""

_BASELINE = """
import json, resource
import lightning_shardckpt, torch
from lightning_shardckpt.ops import export
print(json.dumps({"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def _python(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"benchmark step failed:\n{done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoint and the exports are written")
    args = parser.parse_args()
    count = max(1, round(args.size_gib * 1024 / args.tensor_mib))
    numel = args.tensor_mib * 2**20 // 4
    largest_mib = numel * 4 / 2**20
    work = tempfile.mkdtemp(prefix="export-memory-", dir=args.dir)
    try:
        root = os.path.join(work, "ckpt")
        _python(_SAVE, root, str(count), str(numel))
        baseline = [_python(_BASELINE)["peak_kib"] / 1024 for _ in range(args.runs)]
        base = statistics.median(baseline)
        print(
            f"state: {count} float32 tensors of {largest_mib:.0f} MiB = {count * largest_mib / 1024:.2f} GiB; "
            f"interpreter baseline (import only) median {base:.0f} MiB; load {os.getloadavg()[0]:.2f}"
        )
        print(
            f"{'format':<12} {'peak RSS MiB min/median/max':<30} {'(peak-base)/largest':<22} {'seconds median':<15} "
            f"target <= {TARGET_RATIO:g}x"
        )
        for fmt in FORMATS:
            peaks, seconds = [], []
            for run in range(args.runs):
                out = os.path.join(work, f"out-{run}.{fmt}")
                report = _python(_EXPORT, root, out, fmt)
                peaks.append(report["peak_kib"] / 1024)
                seconds.append(report["seconds"])
                os.remove(out)
            ratios = [(peak - base) / largest_mib for peak in peaks]
            spread = f"{min(peaks):.0f} / {statistics.median(peaks):.0f} / {max(peaks):.0f}"
            ratio = f"{min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}"
            verdict = "ok" if statistics.median(ratios) <= TARGET_RATIO else "OVER"
            print(f"{fmt:<12} {spread:<30} {ratio:<22} {statistics.median(seconds):<15.2f} {verdict}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
