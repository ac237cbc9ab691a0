"""CPU-seconds a piece of the test suite costs: one pytest run per round (`-n 0`), user + system time of pytest
and every process it started and waited for (ranks, recipes, CLI calls, drills), with the wall time beside it.

    python benchmarks/suite_cpu.py tests/e2e/test_lightning_cli.py
    python benchmarks/suite_cpu.py "tests/e2e/test_documented_commands.py -k drills" --against ../main

Each argument is one piece (pytest arguments, quoted when several); `--rounds` runs (default 3), min / median /
max. `--against DIR` runs the same pieces in another checkout (with its own .venv), alternating with this one
round by round, so both see the same load: how issue 38's "full suite <= 8 minutes on 2 cores" budget (960
CPU-s) is split and what a change to a test saves. CPU time, unlike wall time, barely moves with the load the
other work on the machine puts on it; a process nobody waits for (one left running) is not counted.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_round(checkout: Path, piece: str) -> tuple[float, float, int]:
    """(CPU-seconds, wall seconds, pytest's exit code) of one `pytest -n 0 PIECE` in `checkout`."""
    python = checkout / ".venv" / "bin" / "python"
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *shlex.split(piece)]
    env = dict(os.environ, PYTHONPATH=str(checkout))  # that checkout's package, not the installed one
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, done.returncode


def spread(values: list[float]) -> str:
    return f"{min(values):7.1f} {statistics.median(values):7.1f} {max(values):7.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pieces", nargs="+", help="pytest arguments of one piece, e.g. 'tests/unit/test_gc.py -k x'")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another checkout to measure alternately (its .venv runs it)")
    args = parser.parse_args(argv)
    checkouts = {"this": REPO} | ({"against": args.against.resolve()} if args.against else {})
    failed = False
    print(f"{'piece':60} {'checkout':8} {'CPU-s min   med   max':>23} {'wall-s min   med   max':>24}")
    for piece in args.pieces:
        results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in checkouts}
        for _ in range(args.rounds):
            for name, checkout in checkouts.items():
                results[name].append(one_round(checkout, piece))
        for name, rounds in results.items():
            codes = sorted({code for _, _, code in rounds})
            failed |= codes != [0]
            note = "" if codes == [0] else f"  pytest exited {codes}"
            cpu, wall = [r[0] for r in rounds], [r[1] for r in rounds]
            print(f"{piece[:60]:60} {name:8} {spread(cpu):>23} {spread(wall):>24}{note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
