"""`shardckpt compare` and `shardckpt export` on real checkpoints (local disk and the loopback S3 server),
and the outcomes (`extra.metrics`) a manifest carries."""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from lightning_shardckpt import CheckpointSaver, CorruptCheckpoint, SaveConfig
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format.manifest import parse, to_bytes
from lightning_shardckpt.engine.format.outcomes import decode_metrics, encode_metrics
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.errors import ConfigError
from lightning_shardckpt.ops.export import ExportOptions, export_checkpoint
from tests.helpers import quota_fs
from tests.helpers.checkpoints import SHARD, save_checkpoint


def full_state(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "encoder.weight": torch.randn(33, 17, generator=generator),
            "encoder.bias": torch.randn(33, generator=generator).to(torch.bfloat16),
            "steps": torch.tensor(12),
            "mask": torch.tensor([True, False, True]),
            "empty": torch.empty(0, 4),
        },
        "optimizers": {"0": {"state": {"encoder.weight": {"exp_avg": torch.randn(33, 17, generator=generator)}}}},
    }


def flat(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def assert_bit_exact(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(actual)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and actual[name].shape == tensor.shape, name
        assert torch.equal(
            actual[name].view(torch.uint8) if tensor.is_floating_point() else actual[name],
            tensor.view(torch.uint8) if tensor.is_floating_point() else tensor,
        ), name


@pytest.fixture
def saved(tmp_path) -> tuple[str, dict]:
    root = str(tmp_path / "root")
    state = full_state()
    save_checkpoint(root, 5, state)
    return root, flat(state)


# --- export ---


def test_torch_export_loads_with_weights_only_and_equals_the_saved_tensors_bit_exactly(saved, tmp_path):
    root, expected = saved
    out = str(tmp_path / "full.pt")
    result = export_checkpoint(root, out, ExportOptions(format="torch"))
    assert result.files == [out] and result.tensors == len(expected)
    assert_bit_exact(expected, torch.load(out, weights_only=True))
    # a plain zip with real CRCs: it left our format, other tools check them
    assert "No errors detected" in subprocess.run(["unzip", "-t", out], capture_output=True, text=True).stdout
    assert not [name for name in os.listdir(tmp_path) if ".partial-" in name]
    # ROOT/latest names the same checkpoint, as for the other commands
    again = export_checkpoint(os.path.join(root, "latest"), str(tmp_path / "again.pt"), ExportOptions(format="torch"))
    assert again.checkpoint == result.checkpoint


def test_safetensors_export_of_the_model_with_the_prefix_stripped(saved, tmp_path):
    root, expected = saved
    out = str(tmp_path / "model.safetensors")
    export_checkpoint(root, out, ExportOptions(model_only=True, prefix="model."))
    model = {name.removeprefix("model."): tensor for name, tensor in expected.items() if name.startswith("model.")}
    assert_bit_exact(model, load_file(out))


def test_sharded_safetensors_export_writes_a_hugging_face_index(saved, tmp_path, run_cli):
    root, expected = saved
    out = tmp_path / "shards"
    code, _, _ = run_cli("export", root, str(out), "--max-shard-size", "1KiB", "--dtype", "fp16")
    assert code == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 4 and shards[0] == "model-00001-of-00004.safetensors"
    loaded = {}
    for shard in shards:
        part = load_file(str(out / shard))
        # a shard stays within the size unless one tensor alone is larger (1122-byte fp16 matrices here)
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 1024, shard
        loaded.update(part)
    assert sorted(loaded) == sorted(index["weight_map"]) == sorted(expected)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in loaded.values())
    for name, tensor in expected.items():  # floats cast, the rest as saved
        assert loaded[name].dtype == (torch.float16 if tensor.is_floating_point() else tensor.dtype)
        assert torch.equal(loaded[name], tensor.to(loaded[name].dtype)), name


def test_export_reads_from_s3_with_checksums(s3_root, tmp_path):
    state = full_state(seed=3)
    saver = CheckpointSaver(
        s3_root.url, SaveConfig(async_save=False, write_events=False, storage_options=s3_root.storage_options)
    )
    try:
        assert saver.save(state, step=2).result(timeout=60).committed
    finally:
        saver.close()
    out = str(tmp_path / "from-s3.safetensors")
    result = export_checkpoint(s3_root.url, out, ExportOptions(storage_options=s3_root.storage_options))
    assert_bit_exact(flat(state), load_file(out))
    assert result.bytes_read > result.bytes_written  # every chunk was read (records carry headers) and checked


def test_export_of_a_corrupt_chunk_fails_naming_the_file_and_leaves_no_output(saved, tmp_path):
    root, _ = saved
    directory = next(os.path.join(root, name) for name in os.listdir(root) if name.startswith("step-"))
    with open(os.path.join(directory, SHARD), "r+b") as handle:
        handle.seek(-100, os.SEEK_END)
        handle.write(b"\x00\x01\x02")
    out = tmp_path / "bad.pt"
    with pytest.raises(CorruptCheckpoint, match=r"checksum mismatch in .*__0_0\.distcp"):
        export_checkpoint(root, str(out), ExportOptions(format="torch"))
    assert not out.exists() and not [name for name in os.listdir(tmp_path) if ".partial-" in name]


def test_a_prefix_that_merges_two_names_is_refused(tmp_path):
    root = str(tmp_path / "root")
    save_checkpoint(root, 1, {"a": {"w": torch.ones(2)}, "w": torch.zeros(2)})
    with pytest.raises(ValueError, match="maps 'a.w' and 'w' to one name 'w'"):
        export_checkpoint(root, str(tmp_path / "x.pt"), ExportOptions(prefix="a.", format="torch"))


# --- compare ---


def test_compare_ranks_changed_tensors_by_relative_change_and_counts_non_finite(tmp_path, run_cli):
    state_a = full_state()
    state_b = full_state()
    state_b["model"]["encoder.weight"] = state_b["model"]["encoder.weight"] + 0.5
    state_b["optimizers"]["0"]["state"]["encoder.weight"]["exp_avg"][1, 1] = float("nan")
    root = str(tmp_path / "root")
    save_checkpoint(root, 1, state_a)
    save_checkpoint(root, 2, state_b)
    code, out, _ = run_cli("compare", "--root", root, "1", "2", "--json")
    document = json.loads(out)
    assert code == 1
    rows = document["tensors"]
    assert [row["fqn"] for row in rows[:2]] == ["optimizers.0.state.encoder.weight.exp_avg", "model.encoder.weight"]
    assert rows[0]["nonfinite_b"] == 1 and rows[0]["max_abs"] == 0.0  # the rest of it is unchanged
    assert rows[1]["max_abs"] == pytest.approx(0.5, abs=1e-6) and rows[1]["relative"] > 0.1
    assert document["summary"] == {
        "equal": 4,
        "changed": 2,
        "shape_differs": 0,
        "only_a": 0,
        "only_b": 0,
        "became_nonfinite": 1,
    }
    assert run_cli("compare", "--root", root, "1", "1")[0] == 0


# --- outcomes ---


def test_metrics_round_trip_with_non_finite_values_as_strings(tmp_path):
    encoded = encode_metrics(
        {"loss": torch.tensor(float("nan")), "lr": 0.1, "grad": float("-inf"), "vec": torch.ones(3), "flag": True}
    )
    assert encoded == {"grad": "-inf", "loss": "nan", "lr": 0.1}
    root = str(tmp_path / "root")
    saver = CheckpointSaver(root, SaveConfig(async_save=False, write_events=False))
    saver.save({"model": {"w": torch.ones(1)}}, step=1, extra={"metrics": encoded}).result(timeout=60)
    saver.close()
    entry = catalog.find(fsio.resolve(root))
    json.loads(
        open(os.path.join(entry.path, "manifest.json")).read(), parse_constant=lambda c: pytest.fail(f"{c} in JSON")
    )
    metrics = decode_metrics(entry.manifest)
    assert metrics["lr"] == 0.1 and metrics["grad"] == float("-inf") and metrics["loss"] != metrics["loss"]


def test_a_manifest_with_a_non_numeric_metric_is_corrupt_and_one_without_metrics_reads(saved):
    root, _ = saved
    entry = catalog.find(fsio.resolve(root))
    manifest = dict(entry.manifest)
    assert decode_metrics(manifest) == {}  # written without metrics (old, or not Lightning): still readable
    manifest["extra"] = {"metrics": {"loss": [1.0]}}
    with pytest.raises(CorruptCheckpoint, match=r"extra.metrics\['loss'\] is \[1.0\], not a number"):
        parse(to_bytes(manifest), entry.path)


# --- export: where it may write (issue 25, item 9) ---


def load_sharded(out: str) -> dict[str, torch.Tensor]:
    """A sharded export as a Hugging Face reader sees it: the shards its index names, nothing else."""
    with open(os.path.join(out, "model.safetensors.index.json")) as handle:
        weight_map = json.load(handle)["weight_map"]
    loaded = {}
    for shard in sorted(set(weight_map.values())):
        loaded.update(load_file(os.path.join(out, shard)))
    assert sorted(loaded) == sorted(weight_map)
    return loaded


def tree(directory: str) -> dict[str, bytes]:
    found = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(parent, name), "rb") as handle:
                found[os.path.relpath(os.path.join(parent, name), directory)] = handle.read()
    return found


def test_an_export_onto_an_existing_directory_is_refused_and_writes_nothing(saved, tmp_path, run_cli):
    root, _ = saved
    out = tmp_path / "exports"
    out.mkdir()
    code, _, err = run_cli("export", root, str(out))
    assert code == 2 and "is a directory" in err and "name the file" in err, err
    assert os.listdir(out) == []


def test_an_export_into_the_checkpoints_own_directory_is_refused(saved, run_cli):
    root, _ = saved
    directory = next(os.path.join(root, name) for name in os.listdir(root) if name.startswith("step-"))
    before = tree(root)
    for out in (directory, os.path.join(directory, "model.safetensors"), os.path.join(root, "model.safetensors")):
        code, _, err = run_cli("export", directory, out, "--replace")
        assert code == 2 and "checkpoint" in err and "outside the checkpoint root" in err, (out, err)
        code, _, err = run_cli("export", directory, out, "--max-shard-size", "1KiB", "--replace")
        assert code == 2 and "outside the checkpoint root" in err, (out, err)
    assert tree(root) == before
    assert run_cli("verify", directory)[0] == 0


def test_an_export_over_one_of_the_checkpoints_shards_is_refused_and_verify_still_passes(saved, run_cli):
    root, _ = saved
    directory = next(os.path.join(root, name) for name in os.listdir(root) if name.startswith("step-"))
    before = tree(root)
    code, _, err = run_cli("export", directory, os.path.join(directory, SHARD), "--format", "torch", "--replace")
    assert code == 2 and f"inside the committed checkpoint {directory}" in err, err
    assert tree(root) == before
    assert run_cli("verify", directory)[0] == 0


def test_an_existing_out_is_replaced_only_when_asked(saved, tmp_path, run_cli):
    root, expected = saved
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"someone else's file")
    code, _, err = run_cli("export", root, str(out))
    assert code == 2 and "exists; pass --replace" in err, err
    assert out.read_bytes() == b"someone else's file"
    assert run_cli("export", root, str(out), "--replace")[0] == 0
    assert_bit_exact(expected, load_file(str(out)))


def test_a_sharded_replace_swaps_the_whole_export_and_removes_the_old_shards(saved, tmp_path):
    root, expected = saved
    out = str(tmp_path / "shards")
    export_checkpoint(root, out, ExportOptions(max_shard_size=1024, dtype="fp16"))
    old_files = set(os.listdir(out))
    with pytest.raises(ConfigError, match="exists; pass --replace"):
        export_checkpoint(root, out, ExportOptions(max_shard_size=4096))
    result = export_checkpoint(root, out, ExportOptions(max_shard_size=4096, replace=True))
    assert set(os.listdir(out)) == {os.path.basename(path) for path in result.files}
    assert not old_files - {"model.safetensors.index.json"} & set(os.listdir(out)), "old shards removed"
    assert_bit_exact(expected, load_sharded(out))


def big_state() -> dict:
    generator = torch.Generator().manual_seed(7)
    return {"model": {name: torch.randn(64, 1024, generator=generator) for name in "abcd"}}  # 256 KiB each


def test_a_sharded_re_export_that_runs_out_of_space_leaves_the_previous_export_whole(tmp_path):
    """A real full disk (quota://) midway through the new shards: OUT is still the old export, alone."""
    root = str(tmp_path / "root")
    state = big_state()
    save_checkpoint(root, 1, state)
    disk = tmp_path / "disk"
    out = disk / "out"
    # the old export: fp16, two shards of 256 KiB; the new one: fp32, two shards of 512 KiB
    budget = 1_100_000  # the old export and one new shard fit, the second new shard does not
    storage = quota_fs.quota_options(disk, budget)
    export_checkpoint(
        root, quota_fs.quota_url(out), ExportOptions(max_shard_size=300_000, dtype="fp16", storage_options=storage)
    )
    old_export = tree(str(out))
    with pytest.raises(OSError) as raised:
        export_checkpoint(
            root, quota_fs.quota_url(out), ExportOptions(max_shard_size=600_000, replace=True, storage_options=storage)
        )
    assert raised.value.errno == errno.ENOSPC
    assert tree(str(out)) == old_export, "the old export, whole, and no new shard beside it"
    loaded = load_sharded(str(out))
    assert all(tensor.dtype == torch.float16 for tensor in loaded.values())
    assert_bit_exact({f"model.{n}": t.to(torch.float16) for n, t in state["model"].items()}, loaded)
