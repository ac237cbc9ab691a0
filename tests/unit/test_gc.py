"""Garbage collection: only uncommitted checkpoint directories older than the grace ever go."""

from __future__ import annotations

import json
import os
import time

import pytest

from lightning_shardckpt.engine.catalog import list_checkpoints
from lightning_shardckpt.engine.format.names import MANIFEST, checkpoint_dirname
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.ops import gc
from tests.helpers.checkpoints import SHARD, dirnames_at_step, save_checkpoint

HOUR = 3600.0
OLD = checkpoint_dirname(7, "0000000000a1")  # failed two hours ago: shard half written, a manifest temp file left
OLD_EMPTY = checkpoint_dirname(8, "0000000000a2")  # failed before writing anything, two hours ago
YOUNG = checkpoint_dirname(9, "0000000000a3")  # being written right now
CORRUPT = checkpoint_dirname(10, "0000000000a4")  # a manifest that does not parse


def _age(path: str, seconds: float) -> None:
    stamp = time.time() - seconds
    os.utime(path, (stamp, stamp))


@pytest.fixture
def root(tmp_path):
    """Committed steps 3 and 5, plus every kind of directory gc must tell apart, plus non-checkpoint names."""
    path = str(tmp_path / "run")
    save_checkpoint(path, step=3)
    save_checkpoint(path, step=5)
    for name in (OLD, OLD_EMPTY, YOUNG, CORRUPT, "step-12-notachecpoint", "scratch"):
        os.makedirs(os.path.join(path, name))
    for name, filename, data in [
        (OLD, SHARD, b"half a shard"),
        (OLD, f".{MANIFEST}.deadbeef.tmp", b'{"id"'),
        (YOUNG, SHARD, b"being written"),
        (CORRUPT, MANIFEST, b"not json"),
        (CORRUPT, SHARD, b"bytes"),
        ("scratch", "notes.txt", b"mine"),
    ]:
        with open(os.path.join(path, name, filename), "wb") as handle:
            handle.write(data)
    for name in (OLD, CORRUPT, "step-12-notachecpoint", "scratch"):
        for entry in os.scandir(os.path.join(path, name)):
            _age(entry.path, 2 * HOUR)
    _age(os.path.join(path, OLD_EMPTY), 2 * HOUR)
    committed = dirnames_at_step(os.listdir(path), 3) + dirnames_at_step(os.listdir(path), 5)
    for name in committed:  # old committed checkpoints are still never touched
        for entry in os.scandir(os.path.join(path, name)):
            _age(entry.path, 5 * HOUR)
    with open(os.path.join(path, "latest.0123abcd.tmp"), "wb") as handle:  # a crashed pointer update
        handle.write(b"x")
    _age(os.path.join(path, "latest.0123abcd.tmp"), 5 * HOUR)
    return path


def test_dry_run_is_the_default_and_deletes_nothing(root, run_cli):
    before = sorted(os.listdir(root))
    code, out, _ = run_cli("gc", root)
    assert code == 0
    assert sorted(os.listdir(root)) == before
    assert "dry run" in out and "--yes" in out
    removable = [line for line in out.splitlines() if line.startswith("REMOVE ")]
    assert (
        len(removable) == 2
        and any(OLD[-12:] in line for line in removable)
        and any(OLD_EMPTY[-12:] in line for line in removable)
    )


def test_yes_removes_old_uncommitted_directories_only(root, run_cli):
    code, out, _ = run_cli("gc", root, "--yes")
    assert code == 0 and "removed 2 uncommitted directories" in out
    left = set(os.listdir(root))
    assert OLD not in left and OLD_EMPTY not in left
    assert {YOUNG, CORRUPT, "step-12-notachecpoint", "scratch", "latest", "latest.0123abcd.tmp", ".owner.json"} <= left
    assert os.path.exists(os.path.join(root, CORRUPT, MANIFEST))  # corrupt: reported, never touched
    states = {entry.step: entry.state for entry in list_checkpoints(resolve(root))}
    assert states == {3: "committed", 5: "committed", 9: "uncommitted", 10: "corrupt"}


def test_json_lists_removed_and_kept_with_reasons(root, run_cli):
    code, out, _ = run_cli("gc", root, "--yes", "--json")
    report = json.loads(out)
    assert code == 0 and report["dry_run"] is False and report["grace_s"] == HOUR
    removed = {item["name"]: item for item in report["removed"]}
    kept = {item["name"]: item for item in report["kept"]}
    assert set(removed) == {OLD, OLD_EMPTY} and all(item["removed"] for item in removed.values())
    assert removed[OLD]["reason"] == gc.REMOVE_OLD and removed[OLD]["temp_files"] == 1 and removed[OLD]["files"] == 2
    assert removed[OLD]["age_s"] >= 2 * HOUR - 60
    assert removed[OLD_EMPTY]["files"] == 0  # aged by the directory's own mtime
    assert kept[YOUNG]["reason"] == gc.KEEP_YOUNG
    assert kept[CORRUPT]["reason"] == gc.KEEP_CORRUPT and "not valid JSON" in kept[CORRUPT]["problem"]
    assert sorted(item["step"] for item in kept.values() if item["reason"] == gc.KEEP_COMMITTED) == [3, 5]
    assert report["bytes_reclaimed"] == len(b"half a shard") + len(b'{"id"')


def test_grace_zero_removes_every_uncommitted_directory_and_still_no_committed_or_corrupt_one(root):
    report = gc.collect(resolve(root), grace_s=0.0, dry_run=False)
    assert sorted(item.step for item in report.to_remove if item.removed) == [7, 8, 9]
    states = {entry.step: entry.state for entry in list_checkpoints(resolve(root))}
    assert states == {3: "committed", 5: "committed", 10: "corrupt"}


def test_an_empty_directory_younger_than_the_grace_is_a_save_that_just_started(tmp_path):
    os.makedirs(tmp_path / "run" / checkpoint_dirname(1, "0000000000b1"))
    (item,) = gc.collect(resolve(str(tmp_path / "run")), grace_s=60.0, dry_run=False).items
    assert item.action == "keep" and item.reason == gc.KEEP_YOUNG and item.files == 0
    assert os.path.isdir(tmp_path / "run" / checkpoint_dirname(1, "0000000000b1"))


def test_a_directory_that_committed_after_the_plan_is_kept(root):
    location = resolve(root)
    items = gc.plan(location, grace_s=HOUR)
    old = next(item for item in items if item.name == OLD)
    with open(os.path.join(root, OLD, MANIFEST), "wb") as handle:  # a very slow save commits meanwhile
        handle.write(b"{}")
    gc._remove(location, old, HOUR)
    assert not old.removed and old.action == "keep" and old.reason.startswith(gc.KEEP_CHANGED)
    assert os.path.exists(os.path.join(root, OLD, SHARD))


def test_negative_grace_is_refused(root, run_cli):
    code, _, err = run_cli("gc", root, "--grace-minutes", "-5")
    assert code == 2 and "negative" in err


def test_on_s3_an_old_failed_save_goes_and_the_committed_one_and_other_objects_stay(s3_server, s3_root):
    import torch

    from lightning_shardckpt import CheckpointSaver, SaveConfig
    from tests.helpers.faults import FailOnce

    options = s3_root.storage_options
    # keep_failed_attempts: the saver would remove the failed attempt itself; gc is the backstop checked here
    config = SaveConfig(storage_options=options, keep_failed_attempts=True)
    saver = CheckpointSaver(s3_root.url, config, fault_hook=FailOnce("after_write"))
    assert not saver.save({"w": torch.ones(100)}, step=1).result(timeout=60).committed  # its shard object stays
    assert saver.save({"w": torch.ones(100)}, step=2).result(timeout=60).committed
    saver.close()
    location = resolve(s3_root.url, options)

    graced = gc.collect(location, grace_s=HOUR, dry_run=False)  # the failure is seconds old: may be in flight
    assert [(item.step, item.reason) for item in graced.items] == [(1, gc.KEEP_YOUNG), (2, gc.KEEP_COMMITTED)]
    swept = gc.collect(location, grace_s=0.0, dry_run=False)
    assert [(item.step, item.removed) for item in swept.items] == [(1, True), (2, False)]
    assert [(e.step, e.state) for e in list_checkpoints(location)] == [(2, "committed")]
    left = {path.split("/", 2)[2] for path in s3_server.fs.find(f"{s3_root.bucket}/{s3_root.prefix}")}
    assert {".owner.json", "latest"} <= left and any(name.startswith("events/") for name in left)
