"""How long `shardckpt` takes to answer: `--help`, and `ls` / `inspect` of a local root, as a user runs them.

    python benchmarks/cli_startup.py            3 rounds of each, min / median / max, target <= 1 s

Each command is a fresh process (the installed console script next to this interpreter), timed wall-clock
from start to exit. For scale, the same is measured for `python -c pass` and `python -c "import torch"`:
the command stays under a second only while nothing on its path imports torch (tests/unit/test_cli_startup.py
holds that rule).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 1.0


def seconds(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def make_root(root: str) -> None:
    """Three committed checkpoints of a small model (made in a child process: this one stays torch-free)."""
    code = (
        "import sys, torch\n"
        "from lightning_shardckpt import CheckpointSaver, SaveConfig\n"
        "saver = CheckpointSaver(sys.argv[1], SaveConfig(async_save=False, run_id='bench'))\n"
        "for step in (10, 20, 30):\n"
        "    state = {'model': torch.nn.Linear(64, 64).state_dict()}\n"
        "    assert saver.save(state, step=step).result().committed\n"
        "saver.close()\n"
    )
    subprocess.run([sys.executable, "-c", code, root], check=True, stderr=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    script = Path(sys.executable).parent / "shardckpt"
    shardckpt = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_shardckpt.cli.main"]
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "root")
        make_root(root)
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "shardckpt --help": [*shardckpt, "--help"],
            "shardckpt ls ROOT": [*shardckpt, "ls", root],
            "shardckpt inspect ROOT/latest": [*shardckpt, "inspect", f"{root}/latest"],
        }
        print(f"{'command':32} {'min':>7} {'median':>7} {'max':>7}   ({args.rounds} rounds, seconds)")
        for name, command in cases.items():
            times = [seconds(command) for _ in range(args.rounds)]
            verdict = ""
            if name.startswith("shardckpt"):
                verdict = f"   {statistics.median(times) / TARGET_S:.2f}x of the {TARGET_S:.0f} s target"
            print(f"{name:32} {min(times):7.3f} {statistics.median(times):7.3f} {max(times):7.3f}{verdict}")


if __name__ == "__main__":
    main()
