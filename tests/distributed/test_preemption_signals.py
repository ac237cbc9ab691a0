"""Real SIGTERM / SIGUSR1 to real rank processes: one final committed save, every rank out within the grace period.

What SLURM's `scancel`, a preemption notice (`--signal=USR1@90`) and Kubernetes do: signal every process of
the job, or (torchrun forwarding one at a time, a node drained) some of them, at different steps. Lightning's
own SIGTERM handler broadcasts from inside the signal handler, which pairs with whatever collective the other
ranks run next: the job hung with no final save (issue 25, item 12). ShardedCheckpoint's handler only sets a
flag; the ranks agree on it at the next batch end, save once (blocking) and stop.

Every rank is a process of its own with the environment torchrun or SLURM gives it (tests/helpers/preemption_rank.py
run as `python -m` would run it, forked from the tests' forkserver so that it does not import torch and Lightning
again: tests.helpers.spawn.ForkedMain), so each process's exit status is its own. A run trains until the test
has seen a committed checkpoint, then gets its signals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lightning_shardckpt import verify_checkpoint
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.spawn import ForkedMain, free_port, launched_rank_env

REPO = Path(__file__).resolve().parents[2]
EXIT_BOUND_S = 60  # generous: a final save of the tiny model takes well under a second
START_TIMEOUT_S = 150  # imports and the first commit, on a shared 2-core machine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


class Run:
    """`world` rank processes of tests/helpers/preemption_rank.py on loopback, each with its own log."""

    def __init__(self, workdir: Path, world: int, *options: str) -> None:
        self.root = str(workdir / "ckpt")
        self.logs = [workdir / f"rank{rank}.log" for rank in range(world)]
        port = free_port()
        self.procs = [
            ForkedMain(
                ["-m", "tests.helpers.preemption_rank", self.root, *options],
                env=launched_rank_env(rank, world, port),
                cwd=REPO,
                log=self.logs[rank],
            )
            for rank in range(world)
        ]

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def tails(self) -> str:
        return "\n".join(
            f"--- rank {r} ---\n" + "\n".join(self.output(r).splitlines()[-30:]) for r in range(len(self.logs))
        )

    def committed_steps(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        return [entry.step for entry in catalog.list_checkpoints(fsio.resolve(self.root)) if entry.committed]

    def wait_for_a_commit(self) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if any(proc.poll() is not None for proc in self.procs):
                self.kill()
                pytest.fail(f"a rank exited before the first commit\n{self.tails()}")
            steps = self.committed_steps()
            if steps:
                return max(steps)
            time.sleep(0.2)
        self.kill()
        pytest.fail(f"no commit within {START_TIMEOUT_S} s\n{self.tails()}")

    def signal(self, rank: int, signum: int) -> None:
        os.kill(self.procs[rank].pid, signum)

    def wait_all(self, since: float, bound_s: float) -> list[int | None]:
        """Exit statuses; None for a rank still running `bound_s` after `since` (then killed: the hang)."""
        codes: list[int | None] = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, since + bound_s - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        if None in codes:
            self.kill()
        return codes

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def results(self) -> list[dict]:
        found = []
        for rank in range(len(self.logs)):
            lines = [line for line in self.output(rank).splitlines() if line.startswith("RESULT ")]
            assert lines, f"rank {rank} printed no RESULT line\n{self.tails()}"
            found.append(json.loads(lines[-1][len("RESULT ") :]))
        return found


def _assert_one_final_save_after(run: Run, before: int, codes: list[int | None], elapsed: float) -> int:
    assert None not in codes, (
        f"ranks {[r for r, c in enumerate(codes) if c is None]} hung ({elapsed:.0f} s)\n{run.tails()}"
    )
    assert codes == [0] * len(codes), f"exit statuses {codes}\n{run.tails()}"
    results = run.results()
    stopped = {result["global_step"] for result in results}
    assert len(stopped) == 1, f"the ranks stopped at different steps: {results}"
    (step,) = stopped
    assert step > before, f"stopped at step {step}, not after the signal (step {before} was committed)"
    assert all(result["last_saved_step"] == step for result in results), results
    latest = catalog.find(fsio.resolve(run.root), "latest")
    assert latest.step == step, f"latest committed is step {latest.step}, the ranks stopped at {step}"
    report = verify_checkpoint(run.root, "latest")  # every byte read back against the manifest's checksums
    assert report.ok and report.step == step, report.problems
    return step


@pytest.mark.parametrize(
    ("world", "options"),
    [(2, ("--health",)), (4, ())],
    ids=["2-ranks-health-rules", "4-ranks-health-off"],
)
def test_sigterm_to_every_rank_commits_one_final_save_and_every_rank_exits_0(tmp_path, world, options):
    run = Run(tmp_path, world, *options)
    before = run.wait_for_a_commit()
    sent = time.monotonic()
    for rank in range(world):
        run.signal(rank, signal.SIGTERM)
    codes = run.wait_all(sent, EXIT_BOUND_S)
    _assert_one_final_save_after(run, before, codes, time.monotonic() - sent)


def test_sigterm_to_one_rank_only_stops_every_rank_at_one_final_save(tmp_path):
    run = Run(tmp_path, 2)
    before = run.wait_for_a_commit()
    sent = time.monotonic()
    run.signal(1, signal.SIGTERM)
    codes = run.wait_all(sent, EXIT_BOUND_S)
    _assert_one_final_save_after(run, before, codes, time.monotonic() - sent)


def test_sigterm_to_ranks_at_different_steps_commits_one_final_save(tmp_path):
    # rank 1's signal comes a few steps after rank 0's, while rank 1 is still in its (slow) end of fit
    run = Run(tmp_path, 2, "--health", "--slow-fit-end", "3")
    before = run.wait_for_a_commit()
    sent = time.monotonic()
    run.signal(0, signal.SIGTERM)
    time.sleep(0.5)  # ~5 steps of 0.1 s
    run.signal(1, signal.SIGTERM)
    codes = run.wait_all(sent, EXIT_BOUND_S)
    _assert_one_final_save_after(run, before, codes, time.monotonic() - sent)


def test_sigusr1_to_every_rank_commits_one_final_save_and_every_rank_exits_0(tmp_path):
    run = Run(tmp_path, 2)
    before = run.wait_for_a_commit()
    sent = time.monotonic()
    for rank in range(2):
        run.signal(rank, signal.SIGUSR1)
    codes = run.wait_all(sent, EXIT_BOUND_S)
    _assert_one_final_save_after(run, before, codes, time.monotonic() - sent)


def test_a_rank_that_cannot_agree_exits_143_after_the_grace_period_keeping_the_last_commit(tmp_path):
    # rank 1 is stopped (SIGSTOP: a hung node), so rank 0 waits for it in the batch-end all-reduce forever;
    # its watchdog ends it 5 s after the SIGTERM, with the status a SIGTERM kill reports; nothing half-written
    run = Run(tmp_path, 2, "--grace", "5")
    run.wait_for_a_commit()
    run.signal(1, signal.SIGSTOP)
    time.sleep(1)  # rank 0 is now blocked in a collective with rank 1
    before = max(run.committed_steps())
    sent = time.monotonic()
    run.signal(0, signal.SIGTERM)
    try:
        code = run.procs[0].wait(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        code = None
    elapsed = time.monotonic() - sent
    run.kill()
    assert code == 128 + signal.SIGTERM, f"rank 0: exit {code} after {elapsed:.0f} s\n{run.tails()}"
    assert 5 <= elapsed < 20, elapsed
    assert "exiting with status 143" in run.output(0)
    latest = catalog.find(fsio.resolve(run.root), "latest")
    assert latest.step == before
    assert verify_checkpoint(run.root, "latest").ok
