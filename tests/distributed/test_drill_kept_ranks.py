"""Drill ranks that outlive one drill (policies/drills/pool.py `_KeptRanks`, worker.py `DrillRank`): real pool,
real forked gloo ranks, real checkpoints on disk.

The ranks of a drill whose destination fits `keep_memory_gib` stay alive and run the next drill in the same
processes (the record's `rank_pids`), restoring each checkpoint's own values into the reused tensors; a failed
drill, a world-size change and `keep_memory_gib=0` (or a destination over the bound) give fresh processes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.policies.drills.runner import DrillOptions, run_drill, warm_pool
from tests.helpers import drill_probes
from tests.helpers.forgery import forge_tensor_values

PROBE = "tests.helpers.drill_probes:weighted_sum"


def _save(root: Path, count: int) -> list[str]:
    """`count` committed checkpoints (steps 10, 20, ...) of the same tensor shapes, different values each, their
    probe values recorded; their paths."""
    saver = CheckpointSaver(str(root), SaveConfig(async_save=False))
    paths = []
    try:
        for index in range(count):
            generator = torch.Generator().manual_seed(index)
            model = {"layer.weight": torch.randn(64, 32, generator=generator), "layer.bias": torch.randn(64)}
            extra = {"probe": {"name": PROBE, "value": drill_probes.weighted_sum(model)}}
            result = saver.save({"model": model}, step=10 * (index + 1), extra=extra).result(60)
            assert result.committed, result.error
            paths.append(result.path)
    finally:
        saver.close()
    return paths


def _drills(options: DrillOptions):
    """run_drill through one warm pool kept for the test, as a run's drill runner or a follower keeps one."""
    pool = warm_pool(options)

    def drill(checkpoint: str, **changes) -> dict:
        return run_drill(checkpoint, DrillOptions(**{**options.__dict__, **changes}), pool=pool)

    return pool, drill


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _gone(pids: list[int], within_s: float = 15.0) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline:
        if not any(_alive(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def options() -> DrillOptions:
    return DrillOptions(world_size=2, probe=PROBE, timeout_s=120, nice=0)


def test_two_drills_in_a_row_run_in_the_same_processes_and_each_restores_its_own_values(tmp_path, options):
    first, second = _save(tmp_path, 2)
    pool, drill = _drills(options)
    try:
        one, two = drill(first), drill(second)
        assert one["verdict"] == "passed" and two["verdict"] == "passed", json.dumps([one, two], default=str)
        assert one["rank_process"] == two["rank_process"] == "kept"
        assert len(one["rank_pids"]) == 2 and two["rank_pids"] == one["rank_pids"]
        assert (one["destination_reused"], two["destination_reused"]) == (False, True)
        assert all(_alive(pid) for pid in two["rank_pids"])  # they outlived both drills
        # the reused tensors held the second checkpoint's values, not the first's: its own probe value matched
        probe_one, probe_two = one["checks"]["probe"], two["checks"]["probe"]
        assert probe_two["value"] == pytest.approx(probe_two["saved"]) and probe_two["saved"] != probe_one["saved"]
    finally:
        pool.close()
    assert _gone(two["rank_pids"])  # they end with their pool


def test_a_failed_drill_ends_its_kept_ranks_and_the_next_good_checkpoint_passes_in_fresh_ones(tmp_path, options):
    good, corrupt, later = _save(tmp_path, 3)
    shard = next(Path(corrupt).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit in a chunk
    os.remove(shard)
    shard.write_bytes(bytes(data))
    pool, drill = _drills(options)
    try:
        passed = drill(good)
        failed = drill(corrupt)
        assert failed["verdict"] == "failed" and "checksum mismatch" in failed["cause"], failed
        assert failed["rank_process"] == "kept" and failed["rank_pids"] == passed["rank_pids"]  # it ran in them
        assert _gone(passed["rank_pids"])  # and ended them: nothing of a failed drill serves the next
        after = drill(later)
        assert after["verdict"] == "passed", after
        assert (after["rank_process"], after["destination_reused"]) == ("kept", False)
        assert not set(after["rank_pids"]) & set(passed["rank_pids"])
    finally:
        pool.close()


def test_a_checkpoint_with_the_same_shapes_and_a_nan_chunk_fails_after_a_pass_in_the_kept_ranks(tmp_path, options):
    good, forged = _save(tmp_path, 2)
    forge_tensor_values(resolve(str(tmp_path)), forged, "model.layer.bias", float("nan"))  # every checksum agrees
    pool, drill = _drills(options)
    try:
        assert drill(good)["verdict"] == "passed"
        record = drill(forged)
        assert record["verdict"] == "failed" and "NaN/Inf" in record["cause"], record
        assert record["destination_reused"] is True  # the verdict came from the reused tensors, refilled by this load
    finally:
        pool.close()


def test_a_world_size_change_replaces_the_kept_ranks(tmp_path, options):
    (checkpoint,) = _save(tmp_path, 1)
    pool, drill = _drills(options)
    try:
        on_two = drill(checkpoint)
        on_one = drill(checkpoint, world_size=1)
        on_one_again = drill(checkpoint, world_size=1)
        assert [r["verdict"] for r in (on_two, on_one, on_one_again)] == ["passed"] * 3
        assert len(on_two["rank_pids"]) == 2 and len(on_one["rank_pids"]) == 1
        assert not set(on_one["rank_pids"]) & set(on_two["rank_pids"])
        assert _gone(on_two["rank_pids"])  # the 2-rank group and its memory went back
        assert on_one_again["rank_pids"] == on_one["rank_pids"] and on_one_again["rank_process"] == "kept"
    finally:
        pool.close()


@pytest.mark.parametrize("keep_memory_gib", [0, 1e-6], ids=["keep-nothing", "destination-over-the-bound"])
def test_without_room_to_keep_them_every_drill_forks_its_ranks(tmp_path, options, keep_memory_gib):
    (checkpoint,) = _save(tmp_path, 1)
    pool, drill = _drills(DrillOptions(**{**options.__dict__, "keep_memory_gib": keep_memory_gib}))
    try:
        one, two = drill(checkpoint), drill(checkpoint)
        assert one["verdict"] == two["verdict"] == "passed", [one, two]
        assert one["rank_process"] == two["rank_process"] == "forked"
        assert not set(one["rank_pids"]) & set(two["rank_pids"])
        assert _gone(one["rank_pids"] + two["rank_pids"])  # nothing outlived its drill
        assert (one["destination_reused"], two["destination_reused"]) == (False, False)
    finally:
        pool.close()
