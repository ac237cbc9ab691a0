"""Two runs, one root: the first saver claims the root (ROOT/.owner.json); another run is refused."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, ConfigError, SaveConfig, ShardedCheckpoint
from lightning_shardckpt.engine.catalog import list_checkpoints
from lightning_shardckpt.engine.format.names import OWNER
from lightning_shardckpt.engine.load.loader import LoadResult
from lightning_shardckpt.engine.ownership import new_run_id
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.policies.plan import CheckpointPlan


def small_state(value: float = 1.0) -> dict:
    return {"weights": torch.full((64,), value), "progress": {"step": int(value)}}


def save_once(root: str, step: int, **options) -> CheckpointSaver:
    saver = CheckpointSaver(root, SaveConfig(async_save=False, write_events=False, **options))
    result = saver.save(small_state(step), step=step).result(timeout=60)
    saver.close()
    assert result.committed, result.error
    return saver


def owner_of(root: str) -> dict:
    with open(os.path.join(root, OWNER)) as handle:
        return json.load(handle)


def test_a_second_run_on_the_same_root_is_refused_naming_the_owner_and_the_fixes(tmp_path):
    root = str(tmp_path / "run")
    first = save_once(root, 1, run_id="run-a")
    owner = owner_of(root)
    assert owner["run_id"] == "run-a" == first.run_id
    assert owner["host"] and owner["pid"] == os.getpid() and owner["created_at"]

    with pytest.raises(ConfigError) as refused:
        CheckpointSaver(root, SaveConfig(run_id="run-b"))
    message = str(refused.value)
    assert root in message and "'run-a'" in message and "'run-b'" in message
    assert owner["host"] in message and owner["created_at"] in message
    # a bare engine saver: the engine's advice (ShardedCheckpoint's, with ckpt_path and Hydra, is in test_checkpointer)
    assert "its own root" in message and "SaveConfig(run_id=result.manifest['run_id'])" in message
    assert "SaveConfig(allow_shared_root=True)" in message
    assert [e.step for e in list_checkpoints(resolve(root))] == [1]  # the refused run wrote nothing
    assert owner_of(root) == owner


def test_a_run_without_a_run_id_gets_a_fresh_one_and_is_refused_too(tmp_path):
    root = str(tmp_path / "run")
    save_once(root, 1)  # generated id
    with pytest.raises(ConfigError, match="belongs to another run"):
        CheckpointSaver(root, SaveConfig())


def test_allow_shared_root_lets_a_second_run_write_and_keeps_the_first_owner(tmp_path):
    root = str(tmp_path / "run")
    save_once(root, 1, run_id="run-a")
    shared = save_once(root, 2, run_id="run-b", allow_shared_root=True)
    assert shared.run_id == "run-b"
    assert owner_of(root)["run_id"] == "run-a"  # the marker is written once, never replaced
    runs = {e.step: e.manifest["run_id"] for e in list_checkpoints(resolve(root))}
    assert runs == {1: "run-a", 2: "run-b"}


def test_the_same_run_id_is_accepted_as_a_resumed_run(tmp_path):
    root = str(tmp_path / "run")
    save_once(root, 1, run_id="run-a")
    save_once(root, 2, run_id="run-a")  # a new saver, a new process in real life: the same run
    assert [(e.step, e.state) for e in list_checkpoints(resolve(root))] == [(1, "committed"), (2, "committed")]


def test_every_manifest_records_the_run_id_generated_once_per_saver(tmp_path):
    root = str(tmp_path / "run")
    saver = CheckpointSaver(root, SaveConfig(write_events=False))
    for step in (1, 2):
        assert saver.save(small_state(step), step=step).result(timeout=60).committed
    saver.close()
    manifests = [e.manifest for e in list_checkpoints(resolve(root))]
    assert {m["run_id"] for m in manifests} == {saver.run_id} == {owner_of(root)["run_id"]}
    assert saver.config.run_id == saver.run_id


def test_an_unreadable_owner_marker_is_refused_unless_sharing_is_allowed(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / OWNER).write_text("not json")
    with pytest.raises(ConfigError, match=r"\.owner\.json is not an owner marker"):
        CheckpointSaver(str(root), SaveConfig())
    save_once(str(root), 1, allow_shared_root=True)


def test_an_empty_run_id_is_rejected():
    with pytest.raises(ConfigError, match="run_id=''"):
        SaveConfig(run_id="")


# --- the callback: which run id a fit uses ---


def loaded_from(root: str, run_id: str) -> LoadResult:
    return LoadResult(f"{root}/step-000000005-0123456789ab", "0123456789ab", 5, {"run_id": run_id}, 0.1, 1)


def adopt(callback: ShardedCheckpoint, loaded: LoadResult | None = None) -> str:
    """The run id a fit of `callback` uses (what on_train_start gives the strategy's adopt_run_id)."""
    plan = CheckpointPlan(root=callback.dirpath)  # what setup() builds
    return callback.run_ids.choose(loaded, plan.owns, new_run_id)  # one process: the broadcast is the identity


def make_callback(root: str, **kwargs) -> ShardedCheckpoint:
    return ShardedCheckpoint(root, **kwargs)


def test_the_callback_adopts_the_run_id_of_a_checkpoint_resumed_from_its_own_root(tmp_path):
    root = str(tmp_path / "run")
    assert adopt(make_callback(root), loaded_from(root, "run-a")) == "run-a"


def test_the_callback_continues_the_run_that_owns_its_root_when_resuming_from_that_runs_other_path(tmp_path):
    # Lightning's last.ckpt (or a top-k path) beside the callback's root: the strategy wrote it as the same run
    callback, loaded = make_callback(str(tmp_path / "run")), loaded_from(str(tmp_path / "last.ckpt"), "run-a")
    plan = CheckpointPlan(root=callback.dirpath)
    assert callback.run_ids.choose(loaded, plan.owns, new_run_id, root_owner=lambda: "run-a") == "run-a"
    other = make_callback(str(tmp_path / "run-b"))  # owned by another run: a new run, as from any other root
    assert other.run_ids.choose(loaded, plan.owns, new_run_id, root_owner=lambda: "run-b") not in ("run-a", "run-b")


def test_the_callback_starts_a_new_run_id_when_resuming_from_another_root(tmp_path):
    # a warm start or fine-tune from someone else's checkpoint is a new run: two of them into one
    # new root must still be told apart
    run_id = adopt(make_callback(str(tmp_path / "finetune")), loaded_from(str(tmp_path / "base"), "run-a"))
    assert run_id and run_id != "run-a"


def test_a_fresh_fit_generates_one_run_id_and_keeps_it_for_the_next_fit(tmp_path):
    callback = make_callback(str(tmp_path / "run"))
    first = adopt(callback)
    assert first and adopt(callback) == first


def test_a_run_id_set_in_the_save_options_wins(tmp_path):
    root = str(tmp_path / "run")
    callback = make_callback(root, save={"run_id": "mine"})
    assert adopt(callback, loaded_from(root, "run-a")) == "mine"


def test_on_s3_the_owner_marker_is_a_conditional_create_and_a_second_run_is_refused(s3_server, s3_root):
    options = s3_root.storage_options
    first = CheckpointSaver(s3_root.url, SaveConfig(storage_options=options, run_id="run-a"))
    first.close()
    marker = json.loads(s3_server.fs.cat_file(f"{s3_root.bucket}/{s3_root.prefix}/{OWNER}"))
    assert marker["run_id"] == "run-a"
    with pytest.raises(ConfigError, match="belongs to another run"):
        CheckpointSaver(s3_root.url, SaveConfig(storage_options=options, run_id="run-b"))
    CheckpointSaver(s3_root.url, SaveConfig(storage_options=options, run_id="run-a")).close()  # resumed: accepted


def test_the_strategy_saves_with_the_run_id_it_adopts(tmp_path):
    from lightning_shardckpt import ShardedStrategy

    strategy = ShardedStrategy(parallelism="ddp")
    strategy.use_plan(CheckpointPlan(root=str(tmp_path / "run")))
    strategy.adopt_run_id("run-a")
    assert strategy.save_config.run_id == "run-a" and strategy.root == str(tmp_path / "run")
