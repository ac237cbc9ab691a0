"""Restore drills: fresh processes restore a checkpoint on another world size and check what they got.

A sound checkpoint ends `drilled`; a flipped byte, a truncated file, a NaN where the writer saw none,
a probe value that moved and a drill process that dies or hangs each end `drill-failed` with the cause.
The tampering tests rewrite the manifest's checksums to match (a lying manifest), so only the drill's
own checks can catch them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine.format import drill_records
from lightning_shardckpt.engine.format.checksum import checksum, checksum_of_checksums
from lightning_shardckpt.engine.format.manifest import to_bytes
from lightning_shardckpt.engine.format.names import COMMIT_RECORD, MANIFEST
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.policies.drills.runner import DrillOptions, run_drill
from tests.helpers import drill_probes
from tests.helpers.forgery import forge_manifest, forge_part
from tests.helpers.spawn import run_ranks

PROBE = "tests.helpers.drill_probes:weighted_sum"


def _model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(64, 32, generator=generator),
        "layer.bias": torch.randn(64, generator=generator),
        "head.weight": torch.randn(7, 64, generator=generator),
        "steps": torch.tensor(12),
    }


def _save(root: Path, *, step: int = 10, with_probe: bool = True) -> str:
    """One committed checkpoint written by this (single, non-distributed) process; returns its path."""
    model = _model_state()
    extra = {"probe": {"name": PROBE, "value": drill_probes.weighted_sum(model)}} if with_probe else None
    saver = CheckpointSaver(str(root), SaveConfig(async_save=False))
    result = saver.save({"model": model, "optim": {"lr": torch.tensor(0.1)}}, step=step, extra=extra).result(60)
    saver.close()
    assert result.committed, result.error
    return result.path


def _rewrite_tensor(checkpoint: str, fqn: str, replace) -> None:
    """Change one tensor's stored bytes in place and make the checksums agree (a lying manifest, or part)."""
    path = Path(checkpoint)
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest["format_version"] >= 4:
        _rewrite_tensor_of_part(path, fqn, replace)
        return
    entry = next(t for t in manifest["tensors"] if t["fqn"] == fqn)
    chunk = entry["chunks"][0]
    shard = path / chunk["file"]
    blob = bytearray(shard.read_bytes())
    record = bytes(blob[chunk["offset"] : chunk["offset"] + chunk["length"]])
    old = _model_state()[fqn.removeprefix("model.")]
    old_bytes = _raw_bytes(old)
    new_bytes = _raw_bytes(replace(old.clone()))
    at = record.index(old_bytes)
    record = record[:at] + new_bytes + record[at + len(new_bytes) :]
    blob[chunk["offset"] : chunk["offset"] + chunk["length"]] = record
    shard.write_bytes(bytes(blob))
    chunk["checksum"] = checksum(record)
    for file in manifest["files"]:
        if file["path"] == chunk["file"]:
            file["checksum"] = checksum_of_checksums(
                [c["checksum"] for _, c in sorted(_chunks_of(manifest, chunk["file"]), key=lambda item: item[0])]
            )
    manifest_bytes = to_bytes(manifest)
    (path / MANIFEST).write_bytes(manifest_bytes)
    record = json.loads((path / COMMIT_RECORD).read_text())  # the commit record vouches for the manifest: lie there too
    record["manifest_checksum"] = checksum(manifest_bytes)
    (path / COMMIT_RECORD).write_bytes(to_bytes(record))


def _rewrite_tensor_of_part(path: Path, fqn: str, replace) -> None:
    """Format v4: the chunk's record is in rank 0's part; the part, and the manifest's record of it, lie."""
    shard = path / "__0_0.distcp"

    def lie(part: dict) -> None:
        chunk = next(c for c in part["chunks"] if c["fqn"] == fqn)
        blob = bytearray(shard.read_bytes())
        record = bytes(blob[chunk["offset"] : chunk["offset"] + chunk["length"]])
        old = _model_state()[fqn.removeprefix("model.")]
        at = record.index(_raw_bytes(old))
        new_bytes = _raw_bytes(replace(old.clone()))
        record = record[:at] + new_bytes + record[at + len(new_bytes) :]
        blob[chunk["offset"] : chunk["offset"] + chunk["length"]] = record
        shard.write_bytes(bytes(blob))
        chunk["checksum"] = checksum(record)
        in_order = sorted(part["chunks"] + part["objects"], key=lambda c: c["offset"])
        part["file_checksum"] = checksum_of_checksums([c["checksum"] for c in in_order])

    part = forge_part(str(path), 0, lie)
    forge_manifest(str(path), lambda m: m["parts"].update(file_checksums=part["file_checksum"]))  # one rank


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())


def _chunks_of(manifest, file):
    for tensor in manifest["tensors"]:
        for chunk in tensor["chunks"]:
            if chunk["file"] == file:
                yield chunk["offset"], chunk
    for obj in manifest["objects"]:
        if obj["file"] == file:
            yield obj["offset"], obj


def _trust(root: Path, checkpoint: str) -> str:
    location = resolve(str(root))
    return drill_records.trust_state(drill_records.list_record_names(location).get(Path(checkpoint).name))


def test_a_sound_checkpoint_is_drilled_on_another_world_size_with_its_probe(tmp_path):
    checkpoint = _save(tmp_path / "root")
    assert _trust(tmp_path / "root", checkpoint) == "committed"
    record = run_drill(checkpoint, DrillOptions(probe=PROBE, timeout_s=120))
    assert record["verdict"] == "passed", json.dumps(record, indent=1, default=str)  # with the ranks' log tails
    assert record["world_size"] == 2 and record["writer_world_size"] == 1  # resharded 1 -> 2 by default
    assert record["checks"]["probe"]["value"] == pytest.approx(record["checks"]["probe"]["saved"])
    assert record["time_to_resume_s"] > 0 and record["bytes_read"] > 0
    assert set(record["timings"]) >= {
        "process_start_s",
        "listing_s",
        "load_s",
        "metadata_s",
        "read_s",
        "reshard_s",
        "time_to_resume_s",
    }
    assert _trust(tmp_path / "root", checkpoint) == "drilled"


@pytest.mark.parametrize(
    "damage,cause",
    [
        ("flip", "checksum mismatch"),
        ("truncate", "CorruptCheckpoint"),
        ("nan", "NaN/Inf"),
        ("perturb", "probe"),
    ],
)
def test_a_damaged_checkpoint_ends_drill_failed_with_the_cause(tmp_path, damage, cause, drill_pool):
    root = tmp_path / "root"
    checkpoint = _save(root)
    shard = next(Path(checkpoint).glob("*.distcp"))
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    elif damage == "nan":
        _rewrite_tensor(checkpoint, "model.layer.bias", lambda t: t.index_fill_(0, torch.tensor([3]), float("nan")))
    else:
        _rewrite_tensor(checkpoint, "model.layer.weight", lambda t: t.mul_(1.01))
    record = run_drill(checkpoint, DrillOptions(probe=PROBE, world_size=1, timeout_s=120), pool=drill_pool)
    assert record["verdict"] == "failed", record
    assert cause in record["cause"], record["cause"]
    assert _trust(root, checkpoint) == "drill-failed"


@pytest.mark.parametrize(
    "probe,timeout_s,cause", [("dies", 120, "killed by signal 9"), ("hangs", 10, "did not finish within timeout_s")]
)
def test_a_drill_process_that_dies_or_hangs_is_a_failed_drill_not_a_pass(tmp_path, probe, timeout_s, cause, drill_pool):
    root = tmp_path / "root"
    checkpoint = _save(root)
    record = run_drill(
        checkpoint,
        DrillOptions(probe=f"tests.helpers.drill_probes:{probe}", world_size=1, timeout_s=timeout_s),
        pool=drill_pool,
    )
    assert record["verdict"] == "failed" and cause in record["cause"], record
    assert _trust(root, checkpoint) == "drill-failed"


def _save_on_ranks(rank, world_size, root):
    import torch.distributed as dist

    model = _model_state()
    model["rank_local"] = torch.full((4,), float(rank))  # replicated by declaration, differs in fact
    saver = CheckpointSaver(root, SaveConfig())
    result = saver.save({"model": model}, step=5).result(60)
    saver.close()
    dist.barrier()
    return result.path


def test_a_checkpoint_written_on_two_ranks_is_drilled_on_one_and_on_two(tmp_path, drill_pool):
    root = str(tmp_path / "root")
    checkpoint = run_ranks(_save_on_ranks, 2, root)[0].value
    resharded = run_drill(checkpoint, DrillOptions(timeout_s=120), pool=drill_pool)
    same_size = run_drill(checkpoint, DrillOptions(world_size=2, timeout_s=120), pool=drill_pool)
    assert (resharded["verdict"], resharded["world_size"]) == ("passed", 1), resharded
    assert (same_size["verdict"], same_size["world_size"]) == ("passed", 2), same_size
    names = drill_records.list_record_names(resolve(root))[Path(checkpoint).name]
    assert [n.verdict for n in names] == ["passed", "passed"]


def test_retention_keeps_the_last_drilled_checkpoint_when_keep_last_would_drop_it(tmp_path, drill_pool):
    from lightning_shardckpt.engine import catalog
    from lightning_shardckpt.policies import retention

    root = tmp_path / "root"
    saver = CheckpointSaver(str(root), SaveConfig(async_save=False))
    paths = [saver.save({"model": _model_state(seed=step)}, step=step).result(60).path for step in (1, 2, 3)]
    saver.close()
    assert run_drill(paths[0], DrillOptions(world_size=1, timeout_s=120), pool=drill_pool)["verdict"] == "passed"
    location = resolve(str(root))
    deleted = retention.apply(location, keep_last=1, keep_every_n_steps=None)
    assert deleted == [Path(paths[1]).name]  # step 2 goes; step 1 is the last known-good, step 3 the newest
    remaining = [entry.step for entry in catalog.list_checkpoints(location) if entry.committed]
    assert remaining == [1, 3]
    assert catalog.find(location, catalog.LAST_GOOD).step == 1
    # a later pass that deletes a drilled checkpoint (keep_last_drilled=0) takes its records with it
    assert retention.apply(location, keep_last=1, keep_every_n_steps=None, keep_last_drilled=0) == [Path(paths[0]).name]
    assert drill_records.list_record_names(location) == {}


def test_finite_flags_are_recorded_at_save_and_nan_that_was_saved_does_not_fail_a_drill(tmp_path, drill_pool):
    model = _model_state()
    model["layer.bias"][5] = float("nan")  # training really produced it: the checkpoint holds what was there
    saver = CheckpointSaver(str(tmp_path / "root"), SaveConfig(async_save=False))
    path = saver.save({"model": model}, step=1).result(60).path
    saver.close()
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    flags = {t["fqn"]: t.get("finite") for t in manifest["tensors"]}
    assert flags == {
        "model.head.weight": True,
        "model.layer.bias": False,
        "model.layer.weight": True,
        "model.steps": None,
    }
    record = run_drill(path, DrillOptions(world_size=1, timeout_s=120), pool=drill_pool)
    assert record["verdict"] == "passed", json.dumps(record, indent=1, default=str)  # with the ranks' log tails
    assert record["checks"]["nonfinite"] == ["model.layer.bias"]


def test_retention_spares_a_checkpoint_while_a_drill_of_it_is_queued_or_running(tmp_path):
    import time

    from lightning_shardckpt.policies import retention
    from lightning_shardckpt.policies.drills.runner import DrillRunner

    root = tmp_path / "root"
    saver = CheckpointSaver(str(root), SaveConfig(async_save=False))
    first = saver.save({"model": _model_state()}, step=1).result(60).path
    results: list[dict] = []
    runner = DrillRunner(
        DrillOptions(world_size=1, timeout_s=8, probe="tests.helpers.drill_probes:hangs"), results.append
    )
    runner.request(first)
    time.sleep(0.5)  # the drill thread has picked it up
    assert runner.pending() == {Path(first).name}
    saver.save({"model": _model_state(seed=2)}, step=2).result(60)
    saver.close()
    location = resolve(str(root))
    assert retention.apply(location, keep_last=1, keep_every_n_steps=None, spare=runner.pending()) == []
    # the drill's own bound is its pool's start (a fresh interpreter importing torch: 30 s and more on a loaded
    # host) + timeout_s + the stop grace; close waits longer than all of that, or it abandons the running drill
    runner.close(180)
    assert runner.pending() == set() and [r["verdict"] for r in results] == ["failed"]  # the probe hung: killed at 8 s
    assert retention.apply(location, keep_last=1, keep_every_n_steps=None, spare=runner.pending()) == [Path(first).name]
