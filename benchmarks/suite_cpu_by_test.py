"""CPU-seconds each test of a whole suite run costs, as a pytest plugin; and the table of a run's records.

    CI=true PYTHONPATH=benchmarks bash -c 'time ./scripts/run_tests.sh -p suite_cpu_by_test'   # writes the records
    .venv/bin/python benchmarks/suite_cpu_by_test.py report                                      # files, then tests

`benchmarks/suite_cpu.py` counts what pytest waited for, so it misses the ranks a forkserver reaps and the ranks
Lightning's launcher leaves behind. Here every xdist worker (or the one pytest process) reads, before and after
each test, the CPU time of its whole live process tree from /proc: each process's own user + system time and
that of the children it has reaped. A worker runs one test at a time, so the difference is that test's: its
ranks (forked or started), recipes, CLI calls, drills, and the worker itself. A process that outlives its parent
(re-parented to init) leaves the tree with the CPU it spent; the worker's forkserver, started by the first test
that spawns ranks, is counted to that test. Records: one JSON line per test in $SUITE_CPU_DIR (default
/tmp/suite-cpu-by-test), a file per worker; remove the directory between runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

RECORDS = Path(os.environ.get("SUITE_CPU_DIR", "/tmp/suite-cpu-by-test"))
TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> float:
    """utime + stime + cutime + cstime of `root` and every live process below it, in seconds."""
    parent, ticks = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:  # ended while we looked
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        parent[int(name)], ticks[int(name)] = int(fields[1]), sum(int(value) for value in fields[11:15])
    children = collections.defaultdict(list)
    for pid, ppid in parent.items():
        children[ppid].append(pid)
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += ticks.get(pid, 0)
        stack.extend(children[pid])
    return total / TICKS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = tree_cpu_s(os.getpid()), time.monotonic()
    yield
    record = {"test": item.nodeid, "cpu_s": tree_cpu_s(os.getpid()) - cpu, "wall_s": time.monotonic() - wall}
    RECORDS.mkdir(parents=True, exist_ok=True)
    with open(RECORDS / f"{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps(record) + "\n")


def report(records: Path, top: int) -> None:
    rows = [json.loads(line) for path in sorted(records.glob("*.jsonl")) for line in path.read_text().splitlines()]
    if not rows:
        raise SystemExit(f"no records in {records}: run the suite with `-p suite_cpu_by_test` first")
    total = sum(row["cpu_s"] for row in rows)
    print(f"{len(rows)} tests, {total:.0f} CPU-s, {sum(row['wall_s'] for row in rows):.0f} test-seconds of wall")
    by_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        entry = by_file[row["test"].split("::")[0]]
        entry[0] += row["cpu_s"]
        entry[1] += row["wall_s"]
        entry[2] += 1
    print(f"\n{'CPU-s':>7} {'wall-s':>7} {'tests':>5} {'cum':>5}  file")
    running = 0.0
    for name, (cpu, wall, count) in sorted(by_file.items(), key=lambda item: -item[1][0])[:top]:
        running += cpu
        print(f"{cpu:7.1f} {wall:7.1f} {count:5d} {running / total:5.2f}  {name}")
    print(f"\n{'CPU-s':>7} {'wall-s':>7}  test")
    for row in sorted(rows, key=lambda row: -row["cpu_s"])[:top]:
        print(f"{row['cpu_s']:7.1f} {row['wall_s']:7.1f}  {row['test']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["report"])
    parser.add_argument("--records", type=Path, default=RECORDS)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    report(args.records, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
