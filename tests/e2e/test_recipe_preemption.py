"""SIGTERM to every rank of the main job (recipes/train.py), as SLURM's `scancel` or Kubernetes sends it.

tests/distributed/test_preemption_signals.py covers the cases (all ranks, one rank, different steps, SIGUSR1,
a stuck rank) on a small script; this runs the job users run, on 2 and 4 ranks, each rank started as torchrun
or SLURM would start it, so each process's exit status is its own. The run is long enough that only the
signal can end it: the final committed checkpoint must be a step after the signal, and every rank exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lightning_shardckpt import verify_checkpoint
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.recipe_ranks import start_recipe_ranks

MAX_STEPS = 100_000  # never reached: the signal ends the run
START_TIMEOUT_S = 240  # imports and the first commit of up to 4 ranks on a shared 2-core machine
EXIT_BOUND_S = 90  # the recipe's default preemption_grace_s is 60 s; a clean stop takes seconds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def committed_steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return [entry.step for entry in catalog.list_checkpoints(fsio.resolve(str(root))) if entry.committed]


def tails(ranks: list[tuple[subprocess.Popen, Path]]) -> str:
    return "\n".join(f"--- {log.name} ---\n" + "\n".join(log.read_text().splitlines()[-25:]) for _, log in ranks)


def kill(ranks: list[tuple[subprocess.Popen, Path]]) -> None:
    for proc, _ in ranks:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("world", [2, 4])
def test_sigterm_to_every_rank_of_the_main_job_saves_once_more_and_every_rank_exits_0(tmp_path, world):
    overrides = (f"trainer.max_steps={MAX_STEPS}", "checkpoint.every_n_train_steps=5", "~logger")
    ranks = start_recipe_ranks(tmp_path, world, *overrides)
    root = tmp_path / "ckpt"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not committed_steps(root):
            assert time.monotonic() < deadline, f"no commit within {START_TIMEOUT_S} s\n{tails(ranks)}"
            assert all(proc.poll() is None for proc, _ in ranks), f"a rank exited early\n{tails(ranks)}"
            time.sleep(0.2)
        before = max(committed_steps(root))
        sent = time.monotonic()
        for proc, _ in ranks:
            os.kill(proc.pid, signal.SIGTERM)
        codes = []
        for proc, _ in ranks:
            try:
                codes.append(proc.wait(timeout=max(0.1, sent + EXIT_BOUND_S - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        kill(ranks)
    assert codes == [0] * world, (
        f"exit statuses {codes} ({time.monotonic() - sent:.0f} s after SIGTERM)\n{tails(ranks)}"
    )
    latest = catalog.find(fsio.resolve(str(root)), "latest")
    assert before < latest.step < MAX_STEPS, f"latest is step {latest.step}; step {before} was committed before"
    report = verify_checkpoint(str(root), "latest")  # the final save, every byte read back
    assert report.ok, report.problems
    rank0 = ranks[0][1].read_text()
    assert f"preempted: step {latest.step} is committed" in rank0, tails(ranks)
