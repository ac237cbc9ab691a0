"""`shardckpt bisect`: the earliest known-bad checkpoint of a run, found with few checks, on real checkpoints.

Runs are saved in this process with CheckpointSaver (one rank); the Lightning-recorded metrics case is
in tests/distributed/test_lightning_outcomes.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine.format.outcomes import encode_metrics
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.errors import ConfigError
from lightning_shardckpt.identity.blocks import config_identity, data_identity
from lightning_shardckpt.ops.bisect import bisect, max_checks
from lightning_shardckpt.ops.checks import parse_check
from tests.helpers.checkpoints import RUN_ID

STEPS = list(range(1, 13))  # 12 checkpoints
NAN_FROM = 7  # weights turn NaN from this step on
POISONED = ("model.layer.weight", "optimizers.0.state.layer.weight.exp_avg")


def state_at(step: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    model = {
        "layer.weight": torch.randn(16, 8, generator=generator),
        "layer.bias": torch.randn(16, generator=generator),
        "head.weight": torch.randn(4, 16, generator=generator) * (1000.0 if step >= NAN_FROM else 1.0),
    }
    optimizer = {
        "0": {
            "state": {
                "layer.weight": {"exp_avg": torch.randn(16, 8, generator=generator), "step": torch.tensor(float(step))}
            }
        }
    }
    if step >= NAN_FROM:
        model["layer.weight"][3, 2] = float("nan")
        optimizer["0"]["state"]["layer.weight"]["exp_avg"][0, 0] = float("inf")
    return {"model": model, "optimizers": optimizer}


def save_run(root: str, identity_at, metrics_at=lambda step: None) -> None:
    saver = CheckpointSaver(root, SaveConfig(async_save=False, write_events=False, run_id=RUN_ID))
    try:
        for step in STEPS:
            metrics = metrics_at(step)
            result = saver.save(
                state_at(step),
                step,
                identity=identity_at(step),
                extra=None if metrics is None else {"metrics": encode_metrics(metrics)},
            ).result(timeout=60)
            assert result.committed, result.error
    finally:
        saver.close()


def nan_identity(step: int) -> dict:
    # the data changed where the weights went bad: the identity diff must name it
    return {
        "config": config_identity({"lr": 0.1}),
        "data": data_identity(dataset_version="v1" if step < NAN_FROM else "v2-bad-shard", seed=0),
    }


def loss_at(step: int) -> dict:
    return {"train/loss": 0.5 / step if step < NAN_FROM else 40.0 + step, "lr": 0.1 if step < NAN_FROM else 3.0}


def lr_identity(step: int) -> dict:
    return {"config": config_identity({"lr": 0.1 if step < NAN_FROM else 3.0, "batch_size": 8})}


@pytest.fixture(scope="module")
def nan_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("bisect") / "nan-run")
    save_run(root, nan_identity, loss_at)
    return root


def test_nonfinite_bisect_names_the_first_nan_checkpoint_and_the_one_before_in_log_n_checks(nan_root):
    check, kind = parse_check("nonfinite")
    report = bisect(resolve(nan_root), check, kind=kind, check_name="nonfinite")
    assert report["first_bad"]["step"] == NAN_FROM and report["last_good"]["step"] == NAN_FROM - 1
    assert report["checks_run"] <= max_checks(len(STEPS)) == 5  # 1 + ceil(log2(13)), against 12 for a scan
    assert report["earliest_known_bad_at"] == report["first_bad"]["created_at"]
    affected = report["affected"]
    assert sorted(item["fqn"] for item in affected["tensors"]) == sorted(POISONED)
    assert affected["files"] == ["__0_0.distcp"] and affected["ranks"] == [0]
    # ranked against the known-good: the tensors that became non-finite come first
    assert {change["fqn"] for change in affected["changes"][:2]} == set(POISONED)
    assert all(change["nonfinite_b"] > change["nonfinite_a"] for change in affected["changes"][:2])
    assert report["identity"]["differs"] == ["data"]
    good = report["last_good"]["path"]
    assert report["resume"] == {
        "ckpt_path": good,
        "python": f'trainer.fit(model, datamodule, ckpt_path="{good}")',
        "hydra": f"python recipes/train.py checkpoint.dirpath={nan_root} resume={good}",
    }


def test_linear_bisect_checks_oldest_first_and_stops_at_the_first_bad(nan_root):
    check, kind = parse_check("nonfinite:recorded")  # the writer's finite flags: no tensor is read
    report = bisect(resolve(nan_root), check, kind=kind, linear=True)
    assert report["first_bad"]["step"] == NAN_FROM and report["checks_run"] == NAN_FROM
    assert [row["step"] for row in report["checked"]] == STEPS[:NAN_FROM]


def test_metric_bisect_finds_the_loss_jump_and_the_config_diff_names_the_changed_key(tmp_path):
    root = str(tmp_path / "lr-run")
    save_run(root, lr_identity, loss_at)
    check, kind = parse_check("metric:train/loss>10")
    report = bisect(resolve(root), check, kind=kind)
    assert (report["last_good"]["step"], report["first_bad"]["step"]) == (NAN_FROM - 1, NAN_FROM)
    assert "train/loss = 47.0" in report["first_bad"]["summary"]
    config = report["identity"]["blocks"]["config"]
    assert report["identity"]["differs"] == ["config"]
    assert "-lr: 0.1" in config["lines"] and "+lr: 3.0" in config["lines"]


def test_a_metric_the_checkpoints_never_recorded_is_refused_naming_what_was(nan_root):
    check, kind = parse_check("metric:val/acc<0.5")
    with pytest.raises(ConfigError, match=r"no metric 'val/acc' \(recorded: \['lr', 'train/loss'\]\)"):
        bisect(resolve(nan_root), check, kind=kind)


def test_user_check_receives_a_handle_and_reads_tensors(nan_root):
    check, kind = parse_check("tests.helpers.bisect_checks:head_blew_up")
    report = bisect(resolve(nan_root), check, kind=kind)
    assert report["first_bad"]["step"] == NAN_FROM
    assert report["first_bad"]["summary"].startswith("max |model.head.weight| = ")


def test_user_check_returning_something_else_is_refused(nan_root):
    check, kind = parse_check("tests.helpers.bisect_checks:returns_a_string")
    with pytest.raises(ConfigError, match="returned str"):
        bisect(resolve(nan_root), check, kind=kind)


def test_unknown_checks_and_malformed_metrics_are_refused_with_the_syntax():
    for spec in ("nan", "metric:train/loss", "metric:loss>abc", "no_such_module_xyz:check"):
        with pytest.raises(ConfigError, match=r"--bad"):
            parse_check(spec)


def test_verify_bisect_finds_a_corrupt_file_and_names_it(tmp_path):
    root = str(tmp_path / "run")
    save_run(root, lambda step: None)
    names = sorted(name for name in os.listdir(root) if name.startswith("step-"))
    shard = os.path.join(root, names[9], "__0_0.distcp")  # step 10 rots on disk: a flipped byte near the end
    with open(shard, "r+b") as handle:
        handle.seek(-200, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-200, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0xFF]))
    check, kind = parse_check("verify")
    report = bisect(resolve(root), check, kind=kind, linear=True)  # damage is not monotone: scan
    assert report["first_bad"]["step"] == 10 and report["last_good"]["step"] == 9
    assert report["affected"]["files"] == ["__0_0.distcp"] and report["affected"]["tensors"]
    assert report["affected"]["changes"] is None  # not a check about values: no numeric ranking


def test_bisect_cli_prints_the_scaffold_and_exits_1_when_a_bad_checkpoint_exists(nan_root, run_cli):
    code, out, _ = run_cli("bisect", nan_root, "--bad", "nonfinite")
    assert code == 1, out
    assert f"1. earliest known-bad: step {NAN_FROM} " in out
    assert "2. identity across the boundary (good -> bad):" in out and "   data: differs" in out
    assert "3. smallest affected slice: 2 tensor(s) hold NaN/Inf" in out
    assert "   model.layer.weight (1 of 128 elements non-finite) in __0_0.distcp" in out
    assert "4. mitigation (not a root cause): resume the last known-good" in out
    assert "   Hydra recipe: python recipes/train.py checkpoint.dirpath=" in out
    code, out, _ = run_cli("bisect", nan_root, "--bad", "nonfinite", "--json")
    document = json.loads(out)
    assert code == 1 and document["first_bad"]["step"] == NAN_FROM


def test_bisect_of_a_run_that_never_went_bad_exits_0_after_one_check(tmp_path, run_cli):
    root = str(tmp_path / "healthy")
    save_run(root, lambda step: None)
    code, out, _ = run_cli("bisect", root, "--bad", "verify", "--json")
    document = json.loads(out)
    assert code == 0 and document["first_bad"] is None and document["checks_run"] == 1


def test_timeline_shows_recorded_metrics_as_columns(nan_root, run_cli):
    code, out, _ = run_cli("timeline", nan_root, "--metric", "train/loss", "--metric", "lr")
    assert code == 0
    lines = out.splitlines()
    header = lines[0].split()
    assert header[header.index("VERIFIED") + 1 : header.index("VERIFIED") + 3] == ["TRAIN/LOSS", "LR"]
    rows = [line.lstrip("* ").split() for line in lines[1:]]
    by_step = {row[0]: row for row in rows if row and row[0].isdigit()}
    assert by_step["6"][-2:] == ["0.0833333", "0.1"] and by_step["7"][-3:] == ["47", "3", "data"]


def test_drill_bisect_uses_recorded_verdicts_without_starting_a_drill(nan_root):
    from lightning_shardckpt.engine import catalog
    from lightning_shardckpt.engine.format import drill_records

    location = resolve(nan_root)
    for entry in catalog.list_checkpoints(location):  # as drills would have filed them: fail from the NaN on
        verdict = drill_records.FAILED if entry.step >= NAN_FROM else drill_records.PASSED
        drill_records.write_record(
            location,
            {
                "checkpoint": entry.name,
                "drill_id": drill_records.new_drill_id(),
                "verdict": verdict,
                "cause": "restored tensors hold NaN" if entry.step >= NAN_FROM else None,
            },
        )
    check, kind = parse_check("drill")
    report = bisect(location, check, kind=kind)
    assert (report["last_good"]["step"], report["first_bad"]["step"]) == (NAN_FROM - 1, NAN_FROM)
    assert (
        report["first_bad"]["summary"].startswith("recorded drill ")
        and "failed (restored tensors hold NaN)" in report["first_bad"]["summary"]
    )
    assert report["affected"]["changes"] is None
