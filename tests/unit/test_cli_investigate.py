"""`shardckpt diff` and `shardckpt timeline` on real checkpoints saved in this process, with real identities."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine.format.manifest import total_bytes
from lightning_shardckpt.engine.format.names import checkpoint_dirname
from lightning_shardckpt.identity.blocks import (
    code_identity,
    config_identity,
    data_identity,
    model_identity,
    run_identity,
)
from tests.helpers.checkpoints import SHARD, dirnames_at_step
from tests.helpers.faults import FailOnce

STUCK = checkpoint_dirname(9, "deadbeefcafe")  # an uncommitted directory with no event: in-flight, or failed once old


def identity_of(model: torch.nn.Module, lr: float, step: int) -> dict:
    return {
        "config": config_identity({"lr": lr, "batch_size": 8}),
        "data": data_identity(dataset_version="v1", seed=0, epoch=0, samples_consumed=8 * step),
        "model": model_identity(model),
        "code": code_identity(os.path.dirname(__file__)),
        "run": run_identity(world_size=1, device_type="cpu", argv=["train.py", f"--step={step}"]),
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Step 1 fails mid-shard (its directory kept); 2 and 3 share an identity; 4 changes the config (lr); 5 the model."""
    path = str(tmp_path_factory.mktemp("investigate") / "run")
    config = SaveConfig(async_save=False, keep_failed_attempts=True)  # the failed attempt stays to be investigated
    saver = CheckpointSaver(path, config, fault_hook=FailOnce("mid_shard"))
    small, wide = torch.nn.Linear(3, 2), torch.nn.Linear(4, 2)
    plan = [(1, small, 0.1), (2, small, 0.1), (3, small, 0.1), (4, small, 0.2), (5, wide, 0.2)]
    try:
        for step, model, lr in plan:
            result = saver.save(
                {"model": model.state_dict()},
                step,
                epoch=0,
                samples_consumed=8 * step,
                identity=identity_of(model, lr, step),
            ).result(timeout=60)
            assert result.committed == (step != 1), result.error
    finally:
        saver.close()
    return path


def directory(root: str, step: int) -> str:
    return os.path.join(root, dirnames_at_step(os.listdir(root), step)[0])


# --- diff ---


def test_diff_of_checkpoints_with_the_same_identity_exits_0_and_shows_the_position(root, run_cli):
    code, out, _ = run_cli("diff", "--root", root, "step-2", "3")
    assert code == 0, out
    assert "\nidentical: config, data, model, code, topology match" in out
    position = out.split("position:")[1].split("\n\n")[0]
    assert "differs (shown, not compared)" in position
    assert [line.split() for line in position.splitlines() if line.split()[:1] == ["step"]] == [["step", "2", "3", "*"]]
    assert [line.split() for line in position.splitlines() if "samples_consumed" in line] == [
        ["samples_consumed", "16", "24", "*"]
    ]


def test_diff_of_a_changed_config_exits_1_with_the_unified_diff(root, run_cli):
    # a path and a bare selector: the selector resolves in the path's root
    code, out, _ = run_cli("diff", directory(root, 3), "4")
    assert code == 1
    lines = out.splitlines()
    assert "config: DIFFERS" in lines and "model: same" in lines and "data: same" in lines
    assert "  -lr: 0.1" in lines and "  +lr: 0.2" in lines
    assert f"  --- A {os.path.basename(directory(root, 3))}" in lines
    assert lines[-1] == "different: config"


def test_diff_of_a_changed_model_names_the_tensor_and_both_shapes(root, run_cli):
    code, out, _ = run_cli("diff", directory(root, 4), os.path.join(root, "latest"))
    assert code == 1
    assert "  changed  weight: [2, 3] torch.float32 -> [2, 4] torch.float32" in out.splitlines()
    assert out.splitlines()[-1] == "different: model"


def test_diff_json_parses_back_with_blocks_and_the_verdict(root, run_cli):
    code, out, _ = run_cli("diff", "--root", root, "2", "5", "--json")
    assert code == 1
    result = json.loads(out)
    assert result["identical"] is False and result["differs"] == ["config", "model"]
    assert (result["a"]["step"], result["b"]["step"]) == (2, 5)
    blocks = result["blocks"]
    assert "+lr: 0.2" in blocks["config"]["lines"]
    assert any(line.startswith("changed  weight: [2, 3]") for line in blocks["model"]["lines"])
    assert blocks["model"]["a"]["parameters"] == 8 and blocks["model"]["b"]["parameters"] == 10
    assert blocks["data"]["status"] == "same" and blocks["topology"]["status"] == "same"
    # position and the run block (its command names the step) differ, but never count
    assert blocks["position"] == {**blocks["position"], "status": "differs", "compared": False}
    assert blocks["run"]["status"] == "differs" and blocks["run"]["compared"] is False


def test_diff_exits_2_for_an_uncommitted_checkpoint_and_for_selectors_without_a_root(root, run_cli):
    code, out, err = run_cli("diff", "--root", root, "1", "2")
    assert code == 2 and out == "" and "uncommitted" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli("diff", "step-2", "step-3")
    assert code == 2 and "--root" in err


def test_diff_help_documents_selectors_and_the_root_option(run_cli):
    code, out, _ = run_cli("diff", "--help")
    assert code == 0
    assert "--root ROOT" in out and "step-500 step-1000" in out and "not compared" in " ".join(out.split())


# --- timeline ---


@pytest.fixture
def stuck_root(root):
    """The module's root plus a fresh uncommitted directory (no manifest, no event); removed afterwards."""
    os.makedirs(os.path.join(root, STUCK))
    with open(os.path.join(root, STUCK, SHARD), "wb") as handle:
        handle.write(b"half a shard")
    yield root
    os.remove(os.path.join(root, STUCK, SHARD))
    os.rmdir(os.path.join(root, STUCK))


def test_timeline_lists_failed_attempt_with_its_cause_and_marks_identity_changes(root, run_cli):
    code, out, _ = run_cli("timeline", root)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "STEP",
        "ID",
        "PARENT",
        "CREATED",
        "(UTC)",
        "SIZE",
        "STATE",
        "TRUST",
        "VERIFIED",
        "IDENTITY",
        "CHANGED",
    ]
    rows = {int(line.split()[1] if line.startswith("*") else line.split()[0]): line for line in lines[1:6]}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert " failed " in rows[1] and all(" committed " in rows[s] for s in (2, 3, 4, 5))
    assert [s for s, line in rows.items() if line.startswith("*")] == [4, 5]
    assert rows[4].endswith("config") and rows[5].endswith("model")
    assert "sample 1/" in rows[2]
    cause = next(line for line in lines if line.startswith("step 1 "))
    assert "failed" in cause and "injected storage failure at mid_shard" in cause
    hint = next(line for line in lines if line.startswith("* step 4 "))
    assert f"shardckpt diff {directory(root, 3)} {directory(root, 4)}" in hint


def test_timeline_json_parses_back_with_states_causes_and_identity_changed(root, run_cli):
    code, out, _ = run_cli("timeline", root, "--json")
    assert code == 0
    result = json.loads(out)
    rows = result["checkpoints"]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert [row["state"] for row in rows] == ["failed", "committed", "committed", "committed", "committed"]
    assert "injected storage failure at mid_shard" in rows[0]["cause"] and rows[0]["event"]["outcome"] == "failed"
    assert [row["identity_changed"] for row in rows] == [[], [], [], ["config"], ["model"]]
    assert "+lr: 0.2" in rows[3]["identity_changes"]["config"]
    assert rows[3]["compared_with"] == os.path.basename(directory(root, 3))
    assert rows[2]["parent"] == rows[1]["id"]
    manifest = json.load(open(os.path.join(directory(root, 2), "manifest.json")))
    assert rows[1]["verification"] == manifest["verification"] and rows[1]["bytes"] == total_bytes(manifest)
    assert result["events"] == 5 and result["events_problem"] is None


def test_timeline_calls_a_young_uncommitted_directory_in_flight_and_an_old_one_failed(stuck_root, run_cli):
    code, out, _ = run_cli("timeline", stuck_root, "--json")
    assert code == 0
    stuck = next(row for row in json.loads(out)["checkpoints"] if row["name"] == STUCK)
    assert (stuck["state"], stuck["cause"], stuck["bytes"]) == ("in-flight", None, len(b"half a shard"))
    code, out, _ = run_cli("timeline", stuck_root, "--json", "--grace", "0")
    stuck = next(row for row in json.loads(out)["checkpoints"] if row["name"] == STUCK)
    assert stuck["state"] == "failed" and "no event recorded" in stuck["cause"]


def test_timeline_of_a_checkpoint_directory_or_a_missing_root_exits_2(root, tmp_path, run_cli):
    code, _, err = run_cli("timeline", directory(root, 2))
    assert code == 2 and "checkpoint directory" in err
    code, _, err = run_cli("timeline", str(tmp_path / "nope"))
    assert code == 2 and "does not exist" in err
