"""Shutdown order: a closed saver's worker thread is joined before its process group goes or the process exits.

A daemon worker thread only told to stop (not joined) could still be running when the rank destroyed the
checkpoint group and the interpreter exited; a rank then aborted ("terminate called without an active
exception", SIGABRT). Ranks here are real processes started with torch's env:// variables, which exit
through the interpreter's normal shutdown (spawned test ranks skip it), so their exit status counts.
The race showed in about one run in three, so the job runs RUNS times here, where a run costs under half of a
recipe run's CPU (tests/e2e/test_recipe_exits_clean.py runs the whole recipe once on top: five chances, as before).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.spawn import free_port

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
RUNS = 4

pytestmark = pytest.mark.timeout(300)


def run_job(root: Path, saves: int) -> list[tuple[int, str]]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.teardown_rank", str(root), str(saves)],
            cwd=REPO,
            env=dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(WORLD),
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(REPO),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    return [(proc.wait(timeout=120), proc.stdout.read()) for proc in procs]


def test_closing_a_saver_joins_its_worker_so_every_rank_exits_0(tmp_path):
    for run in range(RUNS):
        outcomes = run_job(tmp_path / f"root{run}", saves=3)
        for rank, (code, output) in enumerate(outcomes):
            assert code == 0 and "terminate called" not in output, (
                f"run {run} rank {rank} exited {code}:\n{output[-3000:]}"
            )
            assert "'committed': 3" in output, f"run {run} rank {rank}: not every save committed:\n{output[-3000:]}"
