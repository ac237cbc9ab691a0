"""Restore drills trust what the run trusts: a checkpoint whose Lightning state holds the user's own class
resumes with `trust_checkpoint=True` or with the class in `torch.serialization.add_safe_globals`, so its
drills (fresh processes, policies/drills/worker.py) must unpickle with the same trust, or no checkpoint of
that run ever becomes known-good. The drill record says which trust it used."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine.config import LoadConfig
from lightning_shardckpt.engine.format import drill_records
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.policies.drills.drills_plugin import DrillConfig, TrainingDrills
from lightning_shardckpt.policies.plan import CheckpointPlan, Placement
from tests.helpers.drill_user_state import UserState

USER_CLASS = f"{UserState.__module__}.{UserState.__qualname__}"


def _save_with_user_class(root: Path) -> str:
    """A committed checkpoint shaped like the Lightning strategy's: the model, and the rest of Lightning's
    checkpoint pickled under "lightning", holding a UserState (as `on_save_checkpoint` would put it there)."""
    lightning_rest = {"global_step": 3, "epoch": 0, "loops": {}, "my_extra": UserState(3)}
    state = {"model": {"layer.weight": torch.randn(8, 4)}, "lightning": pickle.dumps(lightning_rest)}
    saver = CheckpointSaver(str(root), SaveConfig(async_save=False))
    result = saver.save(state, step=3).result(60)
    saver.close()
    assert result.committed, result.error
    return result.path


@pytest.fixture
def safe_globals():
    """The process's torch safe globals, restored afterwards: a test's add_safe_globals must not leak."""
    before = list(torch.serialization.get_safe_globals())
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)


def _drill_as_the_run_does(checkpoint: str, *, trust_checkpoint: bool) -> dict:
    """What ShardedCheckpoint does: the plan (with the run's load config) is shaped by the drills plug-in,
    then a commit requests a drill; the drill thread runs it in fresh processes and reports the record."""
    drills = TrainingDrills(DrillConfig(every_n_checkpoints=1, world_size=1, timeout_s=120))
    plan = CheckpointPlan(root=str(Path(checkpoint).parent), load=LoadConfig(trust_checkpoint=trust_checkpoint))
    drills.shape_plan(plan, Placement())
    drills.request_now(checkpoint)
    drills.stop(180, finish_queued=True)
    (record,) = drills.tally.results
    return record


def _state(root: Path, checkpoint: str) -> str:
    names = drill_records.list_record_names(resolve(str(root))).get(Path(checkpoint).name)
    return drill_records.trust_state(names)


def test_a_drill_refuses_a_user_class_the_run_did_not_allow(tmp_path, safe_globals):
    checkpoint = _save_with_user_class(tmp_path / "root")
    record = _drill_as_the_run_does(checkpoint, trust_checkpoint=False)
    assert record["verdict"] == "failed" and "BlockedGlobal" in record["cause"] and USER_CLASS in record["cause"]
    assert record["unpickle_trust"] == "allow-list"


def test_a_drill_allows_the_safe_globals_the_run_added(tmp_path, safe_globals):
    checkpoint = _save_with_user_class(tmp_path / "root")
    torch.serialization.add_safe_globals([UserState])  # what the user did so the run resumes
    record = _drill_as_the_run_does(checkpoint, trust_checkpoint=False)
    assert record["verdict"] == "passed", json.dumps(record, indent=1, default=str)  # with the ranks' log tails
    assert record["unpickle_trust"] == "allow-list+1 globals"
    assert record["allowed_globals"] == [f"{UserState.__module__}:{UserState.__qualname__}"]
    assert _state(tmp_path / "root", checkpoint) == "drilled"


def test_a_drill_of_a_run_with_trust_checkpoint_unpickles_as_the_run_does(tmp_path, safe_globals):
    checkpoint = _save_with_user_class(tmp_path / "root")
    record = _drill_as_the_run_does(checkpoint, trust_checkpoint=True)
    assert record["verdict"] == "passed", json.dumps(record, indent=1, default=str)  # with the ranks' log tails
    assert record["unpickle_trust"] == "trusted"


def test_the_drill_command_takes_the_trust_and_the_allowed_classes(tmp_path, run_cli, safe_globals):
    import json

    root = tmp_path / "root"
    checkpoint = _save_with_user_class(root)
    code, out, _ = run_cli("drill", checkpoint, "--world-size", "1", "--json")
    assert code == 1 and json.loads(out)["unpickle_trust"] == "allow-list"
    code, out, err = run_cli("drill", checkpoint, "--world-size", "1", "--json", "--allow-global", USER_CLASS)
    assert code == 0, (out, err)
    assert json.loads(out)["unpickle_trust"] == "allow-list+1 globals"
    code, out, err = run_cli("drill", checkpoint, "--world-size", "1", "--json", "--trust")
    assert code == 0, (out, err)
    assert json.loads(out)["unpickle_trust"] == "trusted"


def test_an_allowed_class_the_drill_cannot_import_is_refused_before_drilling(tmp_path, run_cli):
    checkpoint = _save_with_user_class(tmp_path / "root")
    code, _, err = run_cli("drill", checkpoint, "--allow-global", "no_such_module.Thing")
    assert code != 0 and "no_such_module.Thing" in err and "import" in err


def test_a_safe_global_of_the_training_script_makes_the_drill_not_drilled_naming_the_fix(tmp_path, safe_globals):
    checkpoint = _save_with_user_class(tmp_path / "root")
    in_the_script = type("ScriptState", (), {"__module__": "__main__"})  # as `python train.py` defines a class
    torch.serialization.add_safe_globals([in_the_script])
    record = _drill_as_the_run_does(checkpoint, trust_checkpoint=False)
    assert record["verdict"] == "not-drilled", record  # never counted as passed, nor as the checkpoint's failure
    assert "__main__.ScriptState" in record["cause"] and "move the class to a module" in record["cause"]
    assert _state(tmp_path / "root", checkpoint) == "committed"
