"""Format v5 on real gloo ranks in groups of 2 (FORMAT.md §10.5): each group's leader writes its group table,
rank 0 commits a manifest listing groups, not ranks; the checkpoint resumes bit-exact on another world size,
a plain DCP load still reads it, and a missing, altered or torn group table makes it corrupt, naming the table."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_shardckpt import (
    CheckpointSaver,
    CorruptCheckpoint,
    SaveConfig,
    VerifyConfig,
    load_checkpoint,
)
from lightning_shardckpt.engine.catalog import list_checkpoints
from lightning_shardckpt.engine.format import groups, parts_manifest
from lightning_shardckpt.engine.format.names import DCP_METADATA
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.ops.verify import verify_checkpoint
from tests.helpers import training_state as ts
from tests.helpers.spawn import run_ranks

GROUP_SIZE = "2"  # 3 or 4 ranks make two groups; a group's highest rank leads it (rank 0 leads none)


def save_worker(rank, world_size, root):
    os.environ[groups.GROUP_SIZE_ENV] = GROUP_SIZE  # this rank process only (a tests-only variable)
    model, optimizer = ts.build("fsdp", seed=1, world_size=world_size)
    ts.train_steps(model, optimizer, steps=2, seed=2)
    state = ts.sharded_state(model, optimizer)
    state["progress"] = {"global_step": 2, "note": f"saved-on-{world_size}"}
    config = SaveConfig(async_save=False, write_events=False, format_version=5, verify=VerifyConfig(mode="full"))
    saver = CheckpointSaver(root, config)
    result = saver.save(state, step=2).result(timeout=60)
    saver.close()
    assert result.committed, result.error
    full = ts.full_state(model, optimizer)  # a collective: every rank takes part
    return {"full": full, "manifest": result.manifest} if rank == 0 else None


def load_worker(rank, world_size, root):
    model, optimizer = ts.build("fsdp", seed=99, world_size=world_size)  # different init on purpose
    state = ts.sharded_state(model, optimizer)
    state["progress"] = {"global_step": 0, "note": ""}
    result = load_checkpoint(state, root)
    ts.apply_state(model, optimizer, state)
    return {"full": ts.full_state(model, optimizer), "progress": state["progress"], "step": result.step}


@pytest.mark.parametrize("saved_on,loaded_on", [(4, 3), (3, 4)])
def test_a_v5_save_in_groups_of_2_commits_group_tables_and_resumes_bit_exact_on_another_world(
    tmp_path, saved_on, loaded_on
):
    root = str(tmp_path / "ckpt")
    saved = run_ranks(save_worker, saved_on, root)[0].value
    manifest = saved["manifest"]
    assert manifest["format_version"] == 5 and parts_manifest.PARTS_FIELD not in manifest
    table = manifest[groups.GROUPS_FIELD]
    assert (table["count"], table["size"], len(table["table_bytes"])) == (saved_on, 2, 2)
    assert table["writers"] == [2, saved_on - 2]  # the model's rows are spread over every rank
    [entry] = list_checkpoints(resolve(root))
    directory = Path(entry.path)
    for group in (0, 1):
        written = json.loads((directory / groups.group_filename(group)).read_bytes())
        assert written["first_rank"] == 2 * group and written["count"] == min(2, saved_on - 2 * group)
    # the manifest read back, with its group tables, lists every rank's files
    expanded = groups.expanded(resolve(root).fs, entry.path, entry.manifest)
    assert parts_manifest.writing_ranks(expanded) == list(range(saved_on))

    loaded = run_ranks(load_worker, loaded_on, root)
    ts.assert_bit_exact(saved["full"], loaded[0].value["full"])
    for outcome in loaded:
        assert outcome.value["progress"] == {"global_step": 2, "note": f"saved-on-{saved_on}"}
        assert outcome.value["step"] == 2

    # DCP's own reader, without this package's: .metadata is as in v4
    assert (directory / DCP_METADATA).exists()
    model = {
        t["fqn"][len("model.") :]: torch.zeros(t["shape"]) for t in manifest["tensors"] if t["fqn"].startswith("model.")
    }
    target = {"model": model, "progress": {"global_step": 0, "note": ""}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(directory), no_dist=True)
    assert target["progress"] == {"global_step": 2, "note": f"saved-on-{saved_on}"}
    assert model and all(torch.equal(value, saved["full"][f"model.{name}"]) for name, value in model.items())
    report = verify_checkpoint(root)
    assert report.ok and report.files == 2 * saved_on, report.problems


@pytest.fixture(scope="module")
def saved_v5(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("v5") / "ckpt")
    run_ranks(save_worker, 4, root)
    [entry] = list_checkpoints(resolve(root))
    return Path(root), entry.name


@pytest.mark.parametrize("damage", ["missing", "altered", "torn"])
def test_a_missing_altered_or_torn_group_table_makes_the_checkpoint_corrupt_naming_it(tmp_path, saved_v5, damage):
    source, name = saved_v5
    root = tmp_path / "ckpt"
    shutil.copytree(source, root)
    table = root / name / groups.group_filename(0)  # ranks 0 and 1: the objects' rank among them
    if damage == "missing":
        table.unlink()
    elif damage == "altered":
        table.write_bytes(table.read_bytes().replace(b'"first_rank":0', b'"first_rank":2'))
    else:
        table.write_bytes(table.read_bytes()[:40])
    report = verify_checkpoint(str(root))
    assert not report.ok and report.problems[0]["file"] == "__g0.parts.json", report.problems
    with pytest.raises(CorruptCheckpoint, match=r"__g0\.parts\.json"):
        load_checkpoint({"progress": {"global_step": 0, "note": ""}}, str(root), strict=False)


def test_group_tables_without_a_manifest_commit_nothing(tmp_path, saved_v5):
    source, name = saved_v5
    root = tmp_path / "ckpt"
    shutil.copytree(source, root)
    (root / name / "manifest.json").unlink()
    [entry] = list_checkpoints(resolve(str(root)))
    assert not entry.committed
    with pytest.raises(Exception, match="no committed checkpoint|nothing|No checkpoint|not found"):
        load_checkpoint({"progress": {"global_step": 0}}, str(root))


def test_ls_verify_and_a_restore_drill_read_a_v5_checkpoint(saved_v5, run_cli):
    from lightning_shardckpt.policies.drills.runner import DrillOptions, run_drill

    root, name = saved_v5
    code, out, _ = run_cli("ls", root, "--json")
    assert code == 0
    [row] = json.loads(out)["checkpoints"]
    on_disk = [p for p in (root / name).iterdir() if p.name.startswith("__")]  # shards, parts, group tables
    assert row["state"] == "committed" and row["bytes"] == sum(p.stat().st_size for p in on_disk)
    code, out, _ = run_cli("verify", root)
    assert code == 0 and out.startswith("OK "), out
    record = run_drill(str(root / name), DrillOptions(timeout_s=120))
    assert record["verdict"] == "passed", record


def failing_member_worker(rank, world_size, root):
    os.environ[groups.GROUP_SIZE_ENV] = GROUP_SIZE

    def hook(point):
        if point == "before_receipt" and rank == 2:  # a member of group 1 (leader: rank 3), not of rank 0's group
            raise OSError("injected: rank 2 lost its disk")

    model, optimizer = ts.build("fsdp", seed=1, world_size=world_size)
    config = SaveConfig(async_save=False, write_events=False, format_version=5, collective_timeout_s=30)
    saver = CheckpointSaver(root, config, fault_hook=hook)
    result = saver.save(ts.sharded_state(model, optimizer), step=1).result(timeout=60)
    saver.close()
    return {"committed": result.committed, "error": str(result.error)}


def test_a_members_failure_reaches_rank_0_through_its_leader_and_no_rank_commits(tmp_path):
    root = str(tmp_path / "ckpt")
    outcomes = [o.value for o in run_ranks(failing_member_worker, 4, root)]
    assert not any(o["committed"] for o in outcomes)
    assert all("rank 2: OSError: injected: rank 2 lost its disk" in o["error"] for o in outcomes), outcomes
    assert not [e for e in list_checkpoints(resolve(root)) if e.committed]
