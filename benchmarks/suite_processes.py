"""Every Python process a whole suite run starts, by kind and by test: where the suite's fresh interpreters go.

    .venv/bin/python benchmarks/suite_processes.py run                 # CI=true ./scripts/run_tests.sh with the census on
    .venv/bin/python benchmarks/suite_processes.py run tests/e2e -n 2  # any test command arguments
    .venv/bin/python benchmarks/suite_processes.py report              # the last run's tables again

`suite_cpu_by_test.py` says which tests cost CPU; this says what inside them does: each recipe, CLI call, drill pool,
moto server and document command is its own interpreter, and a fresh one pays ~1-4 CPU-s of imports before its
work. For the run, a `.pth` hook in the environment's site-packages (removed afterwards, also on Ctrl-C) makes every
Python process of the environment write, at exit, its argv, the test that was running (PYTEST_CURRENT_TEST; the
documented commands drop PYTEST_* and are told by their working directory), its own CPU time, and whether it was
forked (its sys.orig_argv is a forkserver's or a pytest worker's) rather than started fresh. A process that ends
without exit handlers (SIGKILL, os._exit: multiprocessing's forked ranks) writes nothing; the per-test plugin
counts those.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORDS = Path(os.environ.get("SUITE_PROCESSES_DIR", "/tmp/suite-processes"))
HOOK_NAME = "_suite_processes_census"
# Runs at the start of every interpreter of the environment while the census is on; a no-op without the variable.
HOOK = """import os
if os.environ.get("SUITE_PROCESSES_DIR"):
    import atexit, json, resource, sys

    def _census():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        record = {
            "argv": sys.argv[:4], "orig_argv": getattr(sys, "orig_argv", [])[:4], "cwd": os.getcwd(),
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
            "cpu_s": usage.ru_utime + usage.ru_stime, "modules": len(sys.modules),
        }
        with open(os.path.join(os.environ["SUITE_PROCESSES_DIR"], f"{os.getpid()}.jsonl"), "a") as out:
            out.write(json.dumps(record) + "\\n")

    atexit.register(_census)
"""


def run(pytest_args: list[str]) -> int:
    site = Path(sysconfig.get_paths()["purelib"])
    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        raise SystemExit(
            f"run this with the suite's environment: {REPO / '.venv' / 'bin' / 'python'} {' '.join(sys.argv)}"
        )
    RECORDS.mkdir(parents=True, exist_ok=True)
    for old in RECORDS.glob("*.jsonl"):
        old.unlink()
    module, pth = site / f"{HOOK_NAME}.py", site / f"{HOOK_NAME}.pth"
    module.write_text(HOOK)
    pth.write_text(f"import {HOOK_NAME}\n")
    try:
        env = dict(os.environ, CI="true", SUITE_PROCESSES_DIR=str(RECORDS))
        code = subprocess.call(["./scripts/run_tests.sh", *pytest_args], cwd=REPO, env=env)
    finally:
        pth.unlink(missing_ok=True)
        module.unlink(missing_ok=True)
    report(RECORDS, 30)
    return code


def kind(record: dict) -> str:
    """What the process was: the drill pool, a recipe, a `shardckpt` command, a pytest worker, ..."""
    argv, orig = record["argv"] or [""], " ".join(record["orig_argv"])
    if "drills.pool import serve" in orig:
        return "drill pool (policies/drills/pool.py)"
    if "exec(eval(sys.stdin.readline()))" in orig:
        return "pytest-xdist worker (in-process tests)"
    program = argv[0]
    if program.endswith("shardckpt"):
        return f"shardckpt {argv[1] if len(argv) > 1 else ''}".strip()
    if program in ("-c", "-"):
        return "python -c / stdin"
    if program == "-m":
        return f"python -m {argv[1] if len(argv) > 1 else ''}"
    return f"{'/'.join(Path(program).parts[-2:])}"


def forked(record: dict) -> bool:
    """Forked from a forkserver, an xdist worker or a `python -m pytest` process: its orig_argv is its parent's."""
    orig, argv = record["orig_argv"], record["argv"]
    xdist_worker = "exec(eval(sys.stdin.readline()))" in " ".join(orig)
    return (
        "multiprocessing.forkserver" in " ".join(orig)
        or (xdist_worker and argv != ["-c"])
        or orig[1:3] == ["-m", "pytest"]
    )


def owner(record: dict) -> str:
    if record["test"]:
        return record["test"].split("::")[0]
    if "test_every_bash_block" in record["cwd"]:
        return "tests/e2e/test_documented_commands.py"
    return "(outside a test: workers, servers)"


def report(records: Path, top: int) -> None:
    rows = [json.loads(line) for path in sorted(records.glob("*.jsonl")) for line in path.read_text().splitlines()]
    if not rows:
        raise SystemExit(f"no records in {records}: `run` first")
    fresh = [row for row in rows if not forked(row)]
    print(
        f"{len(rows)} processes wrote a record: {len(fresh)} fresh interpreters ({sum(r['cpu_s'] for r in fresh):.0f}"
        f" CPU-s), {len(rows) - len(fresh)} forked ({sum(r['cpu_s'] for r in rows if forked(r)):.0f} CPU-s)"
    )
    for title, key in (("fresh interpreters by kind", kind), ("fresh interpreters by test file", owner)):
        table: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for row in fresh:
            entry = table[key(row)]
            entry[0] += 1
            entry[1] += row["cpu_s"]
        print(f"\n{title}\n{'CPU-s':>7} {'count':>5} {'each':>5}  what")
        for name, (count, cpu) in sorted(table.items(), key=lambda item: -item[1][1])[:top]:
            print(f"{cpu:7.1f} {count:5d} {cpu / count:5.1f}  {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["run", "report"])
    parser.add_argument("--top", type=int, default=30)
    args, rest = parser.parse_known_args(argv)
    if args.command == "run":
        return run(rest)
    report(RECORDS, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
