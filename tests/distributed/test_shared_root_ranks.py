"""Two runs, one root, on real ranks: the refusal reaches every rank, and a resumed fit is not refused."""

from __future__ import annotations

from lightning_shardckpt import CheckpointSaver, ConfigError, SaveConfig
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.lightning_run import fit_on_rank
from tests.helpers.spawn import run_ranks


def _second_run_on_rank(rank: int, world_size: int, root: str) -> str:
    try:
        CheckpointSaver(root, SaveConfig(run_id="run-b", collective_timeout_s=20))
    except ConfigError as err:
        return str(err)
    return "not refused"


def test_a_refused_root_raises_on_every_rank_not_only_the_coordinator(tmp_path):
    root = str(tmp_path / "run")
    saver = CheckpointSaver(root, SaveConfig(run_id="run-a"))
    saver.close()
    outcomes = run_ranks(_second_run_on_rank, 2, root, timeout_s=60)
    for outcome in outcomes:
        assert "belongs to another run" in outcome.value and "'run-a'" in outcome.value, outcome.value


def test_a_fresh_fit_into_another_runs_root_fails_before_training_and_a_resumed_one_goes_on(tmp_path):
    root = str(tmp_path / "ckpt")
    first = run_ranks(fit_on_rank, 2, root, "ddp", 2, None, {"every": 100}, timeout_s=120)
    assert first[0].value["global_step"] == 2  # saved at fit end

    fresh = run_ranks(fit_on_rank, 2, root, "ddp", 4, None, {"every": 100}, timeout_s=120, allow_failures=True)
    for outcome in fresh:  # every rank raised; none waited for the others
        assert not outcome.ok and "belongs to another run" in outcome.error and "resume=latest" in outcome.error, (
            outcome.error
        )
    assert [e.step for e in catalog.list_checkpoints(fsio.resolve(root))] == [2]

    resumed = run_ranks(fit_on_rank, 2, root, "ddp", 4, "latest", {"every": 100}, timeout_s=120)
    assert resumed[0].value["global_step"] == 4
    entries = catalog.list_checkpoints(fsio.resolve(root))
    assert [e.step for e in entries] == [2, 4]
    assert entries[0].manifest["run_id"] == entries[1].manifest["run_id"]
