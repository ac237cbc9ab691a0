"""Format v4 in one process: what a save writes, what a plain `dcp.load` can read (up to
`dcp_metadata_max_chunks`), and that a torn part is as invisible as a torn shard."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_shardckpt import CheckpointSaver, SaveConfig, load_checkpoint
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format.names import DCP_METADATA, MANIFEST
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.ops.verify import verify_checkpoint
from tests.helpers.checkpoints import PART, RUN_ID, SHARD, fresh_state
from tests.helpers.faults import FailOnce


def _save(root: str, step: int = 3, **options) -> object:
    saver = CheckpointSaver(root, SaveConfig(async_save=False, write_events=False, run_id=RUN_ID, **options))
    try:
        return saver.save(fresh_state(seed=step), step=step).result(timeout=60)
    finally:
        saver.close()


def test_a_save_writes_a_shard_its_part_and_a_manifest_that_lists_no_chunk(tmp_path):
    result = _save(str(tmp_path))
    assert result.committed, result.error
    manifest = result.manifest
    assert manifest["format_version"] == 4
    assert sorted(os.listdir(result.path)) == sorted([DCP_METADATA, PART, SHARD, "commit.json", MANIFEST])
    assert all("chunks" not in t and t["layout"] == {"rank": 0, "split": []} for t in manifest["tensors"])
    assert manifest["objects"] == [{"fqn": "progress.global_step", "rank": 0}]
    assert manifest["parts"]["count"] == 1 and manifest["parts"]["part_bytes"] == [
        os.path.getsize(f"{result.path}/{PART}")
    ]


def test_a_plain_dcp_load_reads_a_checkpoint_within_the_bound_and_none_is_written_above_it(tmp_path):
    small = _save(str(tmp_path / "small"))
    target = fresh_state(seed=99)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=small.path)  # DCP's own reader, without this package's
    assert torch.equal(target["model"]["0.weight"], fresh_state(seed=3)["model"]["0.weight"])

    large = _save(str(tmp_path / "large"), dcp_metadata_max_chunks=4)  # 6 chunks: over the bound
    assert DCP_METADATA not in os.listdir(large.path) and "dcp_metadata" not in large.manifest
    with pytest.raises(BaseException):  # noqa: B017 - DCP finds no metadata to plan from (its own error types)
        dcp.load(fresh_state(seed=99), checkpoint_id=large.path)
    target = fresh_state(seed=99)
    load_checkpoint(target, str(tmp_path / "large"))  # ours needs none
    assert torch.equal(target["model"]["2.bias"], fresh_state(seed=3)["model"]["2.bias"])
    assert verify_checkpoint(str(tmp_path / "large")).ok  # and a missing .metadata is no damage


def test_a_save_that_fails_before_its_manifest_leaves_no_committed_checkpoint_and_latest_unmoved(tmp_path):
    root = str(tmp_path)
    first = _save(root, step=1)
    saver = CheckpointSaver(
        root,
        SaveConfig(async_save=False, write_events=False, keep_failed_attempts=True, run_id=RUN_ID),
        fault_hook=FailOnce("before_manifest"),
    )
    failed = saver.save(fresh_state(seed=2), step=2).result(timeout=60)
    saver.close()
    assert not failed.committed and "injected storage failure at before_manifest" in str(failed.error)
    assert {PART, SHARD} <= set(os.listdir(failed.path))  # its part and shard are there: a torn part, invisible
    states = {e.name: e.state for e in catalog.list_checkpoints(resolve(root))}
    assert states[os.path.basename(failed.path)] == "uncommitted"
    assert catalog.find(resolve(root), "latest").name == os.path.basename(first.path)


def test_format_version_2_is_written_on_request(tmp_path):
    result = _save(str(tmp_path), format_version=2)
    assert result.manifest["format_version"] == 2 and "files" in result.manifest
    assert not any(name.endswith(".part.json") for name in os.listdir(result.path))
    target = fresh_state(seed=99)
    load_checkpoint(target, str(tmp_path))
    assert torch.equal(target["model"]["0.weight"], fresh_state(seed=3)["model"]["0.weight"])
