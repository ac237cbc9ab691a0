"""The LightningCLI recipe end to end: `recipes/lightning_cli.py fit` on 2 CPU ranks, then resumed on 1.

Both phases run the script over recipes/lightning_cli.yaml (ShardedStrategy by class_path, ShardedCheckpoint with
nested save options): the fit as a fresh subprocess whose Lightning launcher starts rank 1 on gloo, the 1-rank
resume (nothing to launch) forked from the tests' forkserver. The resume
(`--ckpt_path latest --trainer.devices 1`) must continue the committed checkpoint of step 6: its first save
is step 9 of the same run, on world size 1, parented on step 6, with the samples of both phases counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.spawn import fork_launched_ranks, free_port, wait_for_ranks

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "recipes" / "lightning_cli.py"
CONFIG = REPO / "recipes" / "lightning_cli.yaml"
TINY = (  # seconds, not minutes: a one-block model on a 4,000-character corpus
    "--data.num_chars=4000",
    "--data.seq_len=16",
    "--data.batch_size=4",
    "--model.d_model=16",
    "--model.n_layers=1",
    "--checkpoint.every_n_train_steps=3",
    "--checkpoint.save.verify.mode=full",
    "--trainer.enable_progress_bar=false",
)
BATCH = 4

pytestmark = pytest.mark.timeout(300)


def fit(workdir: Path, *args: str) -> None:
    """`recipes/lightning_cli.py fit` as a user runs it: a fresh interpreter, Lightning's launcher for rank 1."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    command = [sys.executable, str(SCRIPT), "fit", "--config", str(CONFIG), *TINY, *args]
    proc = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def fit_on_one_rank(workdir: Path, *args: str) -> None:
    """The same on 1 rank (Lightning launches nothing), forked from the tests' forkserver with torchrun's environment
    instead of a fresh interpreter: torch and Lightning are imported already."""
    log = workdir / "one_rank.log"
    argv = [str(SCRIPT), "fit", "--config", str(CONFIG), *TINY, "--trainer.devices=1", *args]
    (code,) = wait_for_ranks(fork_launched_ranks(argv, 1, workdir, [log]), 240)
    if code != 0:
        pytest.fail(f"{' '.join(args)} on 1 rank exited {code}\n{log.read_text()[-8000:]}")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """Train 6 steps on 2 ranks (saves at 3 and 6), then resume on 1 rank up to step 9."""
    workdir = tmp_path_factory.mktemp("lightning_cli")
    fit(workdir, "--trainer.devices=2", "--trainer.max_steps=6")
    fit_on_one_rank(workdir, "--trainer.max_steps=9", "--ckpt_path=latest")
    return workdir


def manifests(workdir: Path) -> dict[int, dict]:
    """step -> manifest of every committed checkpoint under the recipe's checkpoint root."""
    root = workdir / "checkpoints" / "lightning_cli"
    return {m["step"]: m for m in (json.loads(p.read_text()) for p in root.glob("step-*/manifest.json"))}


def test_the_two_rank_fit_commits_its_scheduled_checkpoints(run):
    by_step = manifests(run)
    assert {step: m["topology"]["world_size"] for step, m in by_step.items() if step <= 6} == {3: 2, 6: 2}
    assert by_step[6]["topology"]["parallelism"] == "ddp"


def test_the_one_rank_resume_continues_the_committed_step(run):
    by_step = manifests(run)
    resumed = [m for m in by_step.values() if m["topology"]["world_size"] == 1]
    assert [m["step"] for m in resumed] == [9], "the resume started elsewhere than step 6"
    assert resumed[0]["parent"] == by_step[6]["id"] and resumed[0]["run_id"] == by_step[6]["run_id"]
    assert resumed[0]["samples_consumed"] == 6 * 2 * BATCH + 3 * 1 * BATCH  # the data position carried over


def test_lightning_cli_wrote_the_resolved_config_with_the_typed_options(run):
    config = yaml.safe_load((run / "outputs" / "lightning_cli" / "config.yaml").read_text())
    assert config["trainer"]["strategy"]["class_path"] == "lightning_shardckpt.ShardedStrategy"
    assert config["checkpoint"]["save"]["verify"]["mode"] == "full"
    assert config["ckpt_path"] == "latest" and str(config["trainer"]["devices"]) == "1"
