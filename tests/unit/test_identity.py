"""Identity capture (config, data, model, code, run) and comparison under each policy."""

from __future__ import annotations

import json
import logging
import subprocess

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from lightning_shardckpt.errors import ConfigError, IncompatibleCheckpoint
from lightning_shardckpt.identity.blocks import (
    code_identity,
    config_identity,
    data_identity,
    model_identity,
    run_identity,
)
from lightning_shardckpt.identity.diff import IdentityPolicy, compare

CONFIG = {"model": {"width": 64, "depth": "${trainer.depth}"}, "trainer": {"depth": 2, "lr": 0.1}}


class Net(torch.nn.Module):
    def __init__(self, width: int = 8, extra: bool = False, head_dtype=torch.float32) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, width)
        self.norm = torch.nn.BatchNorm1d(width)
        self.head = torch.nn.Linear(width, 2, dtype=head_dtype)
        if extra:
            self.adapter = torch.nn.Linear(width, width, bias=False)
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


class Squares(Dataset):
    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i + self.offset)] * 3), "y": (i + self.offset) ** 2}


def identity(**overrides):
    blocks = {
        "config": config_identity(OmegaConf.create(CONFIG), hyperparameters={"lr": 0.1}),
        "data": data_identity(Squares(100), seed=3, epoch=0, samples_consumed=0),
        "model": model_identity(Net()),
        "code": code_identity(),
        "run": run_identity(world_size=4, argv=["train.py"]),
    }
    blocks.update(overrides)
    return blocks


# --- capture ---
def test_every_block_is_json_serialisable():
    blocks = identity()
    assert json.loads(json.dumps(blocks)) == blocks


def test_config_identity_is_resolved_sorted_yaml_with_a_digest_shared_by_dict_and_dictconfig():
    from_dictconfig = config_identity(OmegaConf.create(CONFIG))
    assert "depth: 2" in from_dictconfig["yaml"]  # the interpolation is resolved
    assert from_dictconfig["yaml"].index("model:") < from_dictconfig["yaml"].index("trainer:")
    resolved = {"trainer": {"lr": 0.1, "depth": 2}, "model": {"depth": 2, "width": 64}}
    assert config_identity(resolved) == from_dictconfig
    changed = OmegaConf.create(CONFIG)
    changed.trainer.lr = 0.2
    assert config_identity(changed)["digest"] != from_dictconfig["digest"]


def test_config_with_an_unresolvable_interpolation_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="missing_key"):
        config_identity(OmegaConf.create({"a": "${missing_key}"}))


def test_hyperparameters_that_json_cannot_hold_are_stringified():
    block = config_identity(None, hyperparameters={"act": torch.nn.ReLU, "dtype": torch.bfloat16, "nan": float("nan")})
    assert block["hyperparameters"] == {"act": str(torch.nn.ReLU), "dtype": "torch.bfloat16", "nan": "nan"}
    assert config_identity(None) is None


def test_model_identity_counts_parameters_and_lists_saved_tensors():
    block = model_identity(Net(width=8))
    assert block["class"].endswith("test_identity.Net")
    assert block["parameters"] == (4 * 8 + 8) + (8 + 8) + (8 * 2 + 2)
    assert block["tensors"]["body.weight"] == [[8, 4], "torch.float32"]
    assert "norm.running_mean" in block["tensors"] and "scratch" not in block["tensors"]  # non-persistent skipped


def test_model_digest_is_stable_and_sensitive_to_shape_dtype_and_names():
    digest = model_identity(Net())["digest"]
    assert model_identity(Net())["digest"] == digest  # another init, same layout
    for other in (Net(width=16), Net(head_dtype=torch.float64), Net(extra=True)):
        assert model_identity(other)["digest"] != digest


def test_data_identity_of_an_in_memory_dataset_samples_items():
    block = data_identity(Squares(100), seed=3, epoch=1, samples_consumed=40)
    assert block["kind"] == "items" and block["length"] == 100
    assert (block["seed"], block["epoch"], block["samples_consumed"]) == (3, 1, 40)
    assert data_identity(Squares(100))["fingerprint"] == block["fingerprint"]
    assert data_identity(Squares(100, offset=1))["fingerprint"] != block["fingerprint"]
    assert data_identity(Squares(101))["fingerprint"] != block["fingerprint"]


def test_declared_dataset_version_wins_over_sampling():
    block = data_identity(Squares(100), dataset_version="imagenet-v2")
    assert block["kind"] == "declared" and block["version"] == "imagenet-v2"
    assert data_identity(Squares(7), dataset_version="imagenet-v2")["fingerprint"] == block["fingerprint"]


def test_file_backed_dataset_is_identified_by_names_sizes_and_sampled_bytes(tmp_path):
    paths = []
    for i in range(5):
        path = tmp_path / f"shard-{i}.bin"
        path.write_bytes(bytes([i]) * 10_000)
        paths.append(str(path))

    class Files:
        files = paths

    block = data_identity(Files())
    assert block["kind"] == "files" and block["file_count"] == 5
    assert block["files"][0] == {"path": paths[0], "bytes": 10_000}
    assert data_identity(files=paths)["fingerprint"] == block["fingerprint"]
    with open(paths[0], "r+b") as handle:  # same size, different head bytes
        handle.write(b"\xff")
    assert data_identity(files=paths)["fingerprint"] != block["fingerprint"]


def test_code_identity_reads_the_git_commit_and_dirty_flag(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("a")
    git("add", "a.txt")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "first")
    clean = code_identity(tmp_path)
    assert len(clean["commit"]) == 40 and clean["dirty"] is False
    (tmp_path / "a.txt").write_text("b")
    assert code_identity(tmp_path)["dirty"] is True
    assert clean["versions"]["torch"] == torch.__version__


def test_code_identity_outside_a_repository_has_no_commit(tmp_path):
    block = code_identity(tmp_path)
    assert block["commit"] is None and block["dirty"] is None


def test_run_identity_records_the_launch():
    block = run_identity(
        world_size=8,
        device_type="cuda",
        mesh_shape=[2, 4],
        num_hosts=2,
        argv=["train.py", "lr=0.1"],
        wandb_run_id="abc",
        wandb_url="https://wandb.ai/x/abc",
    )
    assert block["command"] == "train.py lr=0.1" and block["mesh_shape"] == [2, 4]
    assert block["wandb"] == {"run_id": "abc", "url": "https://wandb.ai/x/abc"}
    assert run_identity()["world_size"] == 1


# --- comparison ---
def test_identical_identity_matches():
    report = compare(identity(), identity())
    assert report.matches and report.render() == "identity matches"


def test_changed_model_refuses_the_load_naming_the_tensors_and_the_fix():
    with pytest.raises(IncompatibleCheckpoint) as caught:
        compare(identity(), identity(model=model_identity(Net(width=16, extra=True))))
    message = str(caught.value)
    assert "changed  body.weight: [8, 4] torch.float32 -> [16, 4] torch.float32" in message
    assert "appeared adapter.weight: [16, 16] torch.float32" in message
    assert "set identity_policy.model=warn" in message


def test_vanished_tensor_and_dtype_change_are_named():
    report = compare(
        identity(model=model_identity(Net(extra=True))),
        identity(model=model_identity(Net(head_dtype=torch.float64))),
        IdentityPolicy(model="ignore"),
    )
    lines = report.differences["model"]
    assert "vanished adapter.weight: [8, 8] torch.float32" in lines
    assert "changed  head.weight: [2, 8] torch.float32 -> [2, 8] torch.float64" in lines


def test_changed_config_warns_with_the_changed_line(caplog):
    changed = OmegaConf.create(CONFIG)
    changed.trainer.lr = 0.2
    current = identity(config=config_identity(changed, hyperparameters={"lr": 0.2}))
    with caplog.at_level(logging.WARNING, logger="lightning_shardckpt.identity.diff"):
        report = compare(identity(), current)
    lines = report.differences["config"]
    assert "-  lr: 0.1" in lines and "+  lr: 0.2" in lines
    assert "hyperparameter lr: 0.1 -> 0.2" in lines
    assert "identity_policy.config=warn" in caplog.text and "+  lr: 0.2" in caplog.text


def test_changed_data_warns_with_version_change(caplog):
    saved = identity(data=data_identity(Squares(100), dataset_version="v1"))
    current = identity(data=data_identity(Squares(100), dataset_version="v2"))
    with caplog.at_level(logging.WARNING, logger="lightning_shardckpt.identity.diff"):
        report = compare(saved, current)
    assert "version 'v1' -> 'v2'" in report.differences["data"]
    assert "version 'v1' -> 'v2'" in caplog.text


def test_position_fields_are_not_data_differences():
    moved = identity(data=data_identity(Squares(100), seed=3, epoch=4, samples_consumed=900))
    assert compare(identity(), moved).matches


def test_ignored_blocks_are_silent_but_reported(caplog):
    current = identity(run=run_identity(world_size=2, argv=["train.py"]))
    with caplog.at_level(logging.DEBUG, logger="lightning_shardckpt.identity.diff"):
        report = compare(identity(), current)
    assert caplog.records == []
    assert report.differences == {"run": ["world_size 4 -> 2"]}


def test_error_policy_on_data_refuses_the_load():
    current = identity(data=data_identity(Squares(100, offset=5)))
    with pytest.raises(IncompatibleCheckpoint, match=r"\[data\][\s\S]*fingerprint"):
        compare(identity(), current, IdentityPolicy(data="error"))


def test_blocks_missing_on_either_side_are_not_compared():
    report = compare(identity(code=None), identity(model=None))
    assert report.matches and set(report.unrecorded) == {"code", "model"}


def test_unknown_policy_value_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"identity_policy.model='strict' is unknown; use 'error'"):
        IdentityPolicy(model="strict")
    with pytest.raises(TypeError):
        IdentityPolicy("error")  # keyword-only


def test_same_files_under_another_mount_are_the_same_data(tmp_path):
    for mount in ("a", "b"):
        (tmp_path / mount).mkdir()
        for i in range(3):
            (tmp_path / mount / f"part-{i}.bin").write_bytes(bytes([i]) * 100)
    first = data_identity(files=[str(tmp_path / "a" / f"part-{i}.bin") for i in range(3)])
    moved = data_identity(files=[str(tmp_path / "b" / f"part-{i}.bin") for i in range(3)])
    assert first["fingerprint"] == moved["fingerprint"]
    (tmp_path / "b" / "part-1.bin").write_bytes(b"x" * 101)
    changed = data_identity(files=[str(tmp_path / "b" / f"part-{i}.bin") for i in range(3)])
    lines = compare(identity(data=moved), identity(data=changed)).differences["data"]
    assert f"file {tmp_path / 'b' / 'part-1.bin'}: 100 -> 101 bytes" in lines


def test_a_long_model_diff_is_capped_and_counted():
    wide = torch.nn.ModuleDict({f"layer{i}": torch.nn.Linear(2, 2) for i in range(30)})
    wider = torch.nn.ModuleDict({f"layer{i}": torch.nn.Linear(2, 3) for i in range(30)})
    report = compare(
        identity(model=model_identity(wide)), identity(model=model_identity(wider)), IdentityPolicy(model="warn")
    )
    lines = report.differences["model"]
    assert len(lines) == 21 and lines[-1] == "... and 40 more like these"
