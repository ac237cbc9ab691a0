"""Fit through Lightning on N ranks, resume on M: every piece of checkpointed state comes back."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format.names import COMMIT_RECORD, MANIFEST, checkpoint_dirname, new_checkpoint_id
from lightning_shardckpt.engine.storage import fsio
from tests.helpers import training_state as ts
from tests.helpers.lightning_run import fit_on_rank
from tests.helpers.spawn import run_ranks


@pytest.mark.parametrize(
    "parallelism,first,second",
    [("fsdp", 4, 2), ("fsdp", 4, 3), ("fsdp", 2, 4), ("ddp", 4, 2), ("ddp", 4, 3), ("ddp", 2, 4)],
)
def test_fit_resumes_on_a_different_world_size_with_all_state_bit_exact(tmp_path, parallelism, first, second):
    root = str(tmp_path / "ckpt")
    saved = run_ranks(fit_on_rank, first, root, parallelism, 6, None, {"every": 3}, timeout_s=240)
    assert saved[0].value["global_step"] == 6
    states = [(e.step, e.state) for e in catalog.list_checkpoints(fsio.resolve(root))]
    assert states == [(3, "committed"), (6, "committed")]

    resumed = run_ranks(fit_on_rank, second, root, parallelism, 8, "latest", {"every": 3}, timeout_s=240)
    start = resumed[0].value["at_start"]
    ts.assert_bit_exact(saved[0].value["final"], start["full"])  # model + AdamW, resharded
    assert start["global_step"] == 6
    assert start["scheduler_last_epoch"] == 6 and start["lr"] == pytest.approx(0.05 * 0.5**3)
    assert start["extra"] == {"saved_at_step": 6}
    assert start["callback_batches"] == 6
    assert start["datamodule_batches"] == 6
    assert resumed[0].value["global_step"] == 8
    assert catalog.find(fsio.resolve(root), "latest").step == 8  # training went on and saved at fit end
    # the resumed fit adopted the run id of the checkpoint it resumed from: one run, one owner of the root
    run_ids = {e.manifest["run_id"] for e in catalog.list_checkpoints(fsio.resolve(root)) if e.committed}
    assert len(run_ids) == 1 and None not in run_ids, run_ids


def test_latest_on_an_empty_root_starts_fresh_or_fails_when_resume_is_required(tmp_path):
    root = str(tmp_path / "empty")
    fresh = run_ranks(fit_on_rank, 2, root, "ddp", 2, "latest", {"every": 100})
    assert fresh[0].value["at_start"]["global_step"] == 0
    assert fresh[0].value["global_step"] == 2
    required = run_ranks(
        fit_on_rank,
        2,
        str(tmp_path / "empty2"),
        "ddp",
        2,
        "latest",
        {"every": 100, "resume_required": True},
        allow_failures=True,
    )
    assert all(not o.ok and "resume_required=true" in o.error for o in required)


def _uncommitted_attempts(path: Path) -> None:
    for step in (2, 4):  # saves that died before their manifest was written
        (path / checkpoint_dirname(step, new_checkpoint_id())).mkdir(parents=True)


def _corrupt_checkpoints(path: Path) -> None:
    directory = path / checkpoint_dirname(2, new_checkpoint_id())
    directory.mkdir(parents=True)
    (directory / MANIFEST).write_text("{}")
    (directory / COMMIT_RECORD).write_text("{not json")  # a commit record torn by hand: listed as corrupt


@pytest.mark.parametrize(
    "prepare, found",
    [
        (None, "found nothing (the path does not exist)"),
        (lambda path: path.write_text("a Lightning .ckpt, say"), "found a file"),
        (_uncommitted_attempts, "found a checkpoint root with 2 uncommitted attempt(s)"),
        (_corrupt_checkpoints, "found a checkpoint root with 1 corrupt checkpoint(s)"),
    ],
    ids=["missing", "file", "uncommitted", "corrupt"],
)
def test_an_explicit_ckpt_path_without_a_committed_checkpoint_fails_before_training_naming_what_is_there(
    tmp_path, prepare, found
):
    source = tmp_path / "given"
    if prepare is not None:
        prepare(source)
    outcomes = run_ranks(
        fit_on_rank, 2, str(tmp_path / "root"), "ddp", 2, str(source), {"every": 100}, allow_failures=True
    )
    for outcome in outcomes:
        assert not outcome.ok, "started fresh from a path that holds no checkpoint"
        assert "CheckpointNotFound" in outcome.error and f"ckpt_path={str(source)!r}" in outcome.error
        assert found in outcome.error, outcome.error
    assert not (tmp_path / "root").exists() or not catalog.list_checkpoints(fsio.resolve(str(tmp_path / "root")))
