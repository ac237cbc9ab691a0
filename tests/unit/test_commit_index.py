"""`latest` from the pointer and the run's commit index, without listing the root (FORMAT.md §4.1), and never a
different answer than the listing would give."""

from __future__ import annotations

import json
import os

import pytest

from lightning_shardckpt.engine import catalog, commit_index
from lightning_shardckpt.engine.format.names import LATEST, MANIFEST
from lightning_shardckpt.engine.storage.fsio import resolve
from tests.helpers.checkpoints import RUN_ID, dirname_of, save_checkpoint


@pytest.fixture
def root(tmp_path):
    """Three commits of one run (steps 1, 2, 3); `latest` names step 3."""
    path = str(tmp_path / "run")
    names = [dirname_of(save_checkpoint(path, step=step)) for step in (1, 2, 3)]
    return path, names


def _no_listing(monkeypatch) -> list[int]:
    listed: list[int] = []

    def refuse(location):
        listed.append(1)
        raise AssertionError("the root was listed")

    monkeypatch.setattr(catalog, "list_checkpoints", refuse)
    return listed


def _counting_listing(monkeypatch) -> list[int]:
    listed: list[int] = []
    real = catalog.list_checkpoints

    def count(location):
        listed.append(1)
        return real(location)

    monkeypatch.setattr(catalog, "list_checkpoints", count)
    return listed


def _point_latest_at(path: str, name: str) -> None:
    with open(os.path.join(path, LATEST), "w") as handle:
        handle.write(name + "\n")


def test_each_commit_writes_its_runs_marker(root):
    path, names = root
    for seq, name in enumerate(names, start=1):
        with open(commit_index.marker_path(path, RUN_ID, seq, name)) as handle:
            assert handle.read() == name + "\n"


def test_latest_is_found_without_listing_the_root_and_walks_past_a_stale_pointer(root, monkeypatch):
    path, names = root
    _no_listing(monkeypatch)
    location = resolve(path)
    assert catalog.find(location, "latest").name == names[2]
    _point_latest_at(path, names[0])  # a crash between manifest and pointer, twice
    assert catalog.find(location, "latest").name == names[2]


def test_an_attempt_that_never_committed_ends_the_walk(root, monkeypatch):
    path, names = root
    failed = names[2].replace("step-000000003", "step-000000004")
    os.makedirs(os.path.join(path, failed))  # an attempt that wrote its marker, then died before its manifest
    with open(commit_index.marker_path(path, RUN_ID, 4, failed), "w") as handle:
        handle.write(failed + "\n")
    _no_listing(monkeypatch)
    assert catalog.find(resolve(path), "latest").name == names[2]


def test_the_next_save_of_the_run_takes_parent_and_seq_from_the_index_without_listing(root, monkeypatch):
    path, names = root
    listed = _counting_listing(monkeypatch)
    manifest = save_checkpoint(path, step=4)
    assert (manifest["seq"], manifest["parent"]) == (4, json.load(open(os.path.join(path, names[2], MANIFEST)))["id"])
    assert listed == []


@pytest.mark.parametrize("damage", ["marker_missing", "another_run_in_the_root", "pointer_gone"])
def test_where_the_index_cannot_answer_the_root_is_listed_and_the_answer_is_the_same(root, monkeypatch, damage):
    path, names = root
    if damage == "marker_missing":  # a writer that kept no index (older versions) committed step 3
        os.remove(commit_index.marker_path(path, RUN_ID, 3, names[2]))
    elif damage == "another_run_in_the_root":  # a shared root: which run committed last takes a listing
        os.makedirs(os.path.join(path, commit_index.INDEX_DIR, "another-run"))
    else:
        os.remove(os.path.join(path, LATEST))
    listed = _counting_listing(monkeypatch)
    assert catalog.find(resolve(path), "latest").name == names[2]
    assert listed, "the root should have been listed"


def test_a_marker_naming_another_runs_checkpoint_sends_the_reader_to_the_listing(root, monkeypatch):
    path, names = root
    with open(commit_index.marker_path(path, RUN_ID, 4, names[0]), "w") as handle:
        handle.write(names[0] + "\n")  # names a committed checkpoint of seq 1: the index is inconsistent
    listed = _counting_listing(monkeypatch)
    assert catalog.find(resolve(path), "latest").name == names[2]
    assert listed


# --- one truth: every reader's `latest` is the listing's, whatever state the hints are in ---
def _every_second_commit_replicated(tmp_path) -> tuple[str, list[str]]:
    """A durable tier holding every second commit of a run (steps and seqs 2, 4, 6: gaps, as replication leaves)."""
    import torch

    from lightning_shardckpt import CheckpointSaver, SaveConfig
    from lightning_shardckpt.engine.tiers.config import TierConfig, TiersConfig
    from lightning_shardckpt.engine.tiers.replicate import Replicator

    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    saver = CheckpointSaver(fast, SaveConfig(async_save=False, write_events=False, run_id=RUN_ID))
    names = []
    for step in range(1, 7):
        result = saver.save({"w": torch.full((64,), float(step))}, step=step).result(timeout=60)
        assert result.committed, result.error
        names.append(result.path.rsplit("/", 1)[-1])
    saver.close()
    config = TiersConfig(fast=TierConfig(dirpath=fast), durable=TierConfig(dirpath=durable))
    replicator = Replicator(config, resolve(fast), resolve(durable), group=None)
    for name in names[1::2]:
        replicator.submit(name)
        assert replicator.flush(30)
    replicator.close(5)
    return durable, names[1::2]


DAMAGE = ["markers_with_gaps", "latest_stale", "latest_older", "latest_deleted", "marker_deleted"]


@pytest.mark.parametrize("damage", DAMAGE)
def test_every_reader_resumes_the_step_ls_stars_whatever_the_pointer_and_markers_say(tmp_path, run_cli, damage):
    import torch

    from lightning_shardckpt import Checkpointer, list_checkpoints, load_checkpoint, resolve_checkpoint

    root, names = _every_second_commit_replicated(tmp_path)
    assert [e.seq for e in catalog.list_checkpoints(resolve(root)) if e.committed] == [2, 4, 6]
    if damage == "latest_stale":  # the copy of step 6 committed, its `latest` update lost
        _point_latest_at(root, names[1])
    elif damage == "latest_older":
        _point_latest_at(root, names[0])
    elif damage == "latest_deleted":
        os.remove(os.path.join(root, LATEST))
    elif damage == "marker_deleted":  # `latest` rewritten and the newest commit's marker gone
        _point_latest_at(root, names[1])
        os.remove(commit_index.marker_path(root, RUN_ID, 6, names[2]))
    code, out, _ = run_cli("ls", root)
    assert code == 0
    starred = [line.split()[0] for line in out.splitlines() if line[:1].isdigit() and "*" in line.split()]
    loaded = {"w": torch.zeros(64)}
    at_resume = {"w": torch.zeros(64)}
    with Checkpointer(root) as checkpointer:
        resumed = checkpointer.load(at_resume)
    assert {
        "listing": list_checkpoints(root).latest.step,
        "resolve": resolve_checkpoint(root, "latest").step,
        "load_checkpoint": load_checkpoint(loaded, root).step,
        "Checkpointer.load": resumed,
        "ls star": int(starred[0]),
    } == dict.fromkeys(["listing", "resolve", "load_checkpoint", "Checkpointer.load", "ls star"], 6)
    assert loaded["w"][0].item() == at_resume["w"][0].item() == 6.0


def test_a_rollbacks_newer_commit_of_a_smaller_step_stays_latest_with_its_marker_gone(tmp_path):
    """Steps 1-4, then a resume from step 2 commits step 3 again (seq 5): with `latest` naming the abandoned step 4
    and marker 5 deleted, the index has no marker of the newest commit, and no newer step tells of it either."""
    from lightning_shardckpt import resolve_checkpoint

    path = str(tmp_path / "run")
    names = [dirname_of(save_checkpoint(path, step=step)) for step in (1, 2, 3, 4)]
    branch = save_checkpoint(path, step=3)
    assert branch["seq"] == 5
    _point_latest_at(path, names[3])
    os.remove(commit_index.marker_path(path, RUN_ID, 5, dirname_of(branch)))
    assert catalog.find(resolve(path), "latest").name == dirname_of(branch)
    assert resolve_checkpoint(path).checkpoint_id == branch["id"]


def _markers(root: str) -> list[str]:
    return sorted(os.listdir(os.path.join(root, commit_index.INDEX_DIR, RUN_ID)))


def test_retention_prunes_the_markers_of_the_checkpoints_it_deletes_and_latest_still_comes_from_the_index(
    tmp_path, monkeypatch
):
    import torch

    from lightning_shardckpt import Checkpointer

    root = str(tmp_path / "run")
    with Checkpointer(root, keep_last=2, save={"async_save": False, "run_id": RUN_ID}) as checkpointer:
        for step in range(1, 31):
            checkpointer.save(step, {"w": torch.full((8,), float(step))}, blocking=True)
    committed = [e for e in catalog.list_checkpoints(resolve(root)) if e.committed]
    assert [e.step for e in committed] == [29, 30]
    assert _markers(root) == [commit_index.marker_name(e.seq, e.name) for e in committed]  # 2 markers, not 30
    _point_latest_at(root, committed[0].name)  # stale: the walk goes from seq 29 to 30 over the pruned index
    _no_listing(monkeypatch)
    assert catalog.find(resolve(root), "latest").name == committed[1].name


def test_gc_prunes_the_markers_of_checkpoints_deleted_before_retention_pruned_them(tmp_path, run_cli):
    import shutil

    path = str(tmp_path / "run")
    names = [dirname_of(save_checkpoint(path, step=step)) for step in range(1, 11)]
    for name in names[:8]:  # deleted by an older version's retention, or by hand: 10 markers, 2 checkpoints
        shutil.rmtree(os.path.join(path, name))
    assert len(_markers(path)) == 10
    code, out, _ = run_cli("gc", path, "--yes", "--json")
    assert code == 0
    assert _markers(path) == [commit_index.marker_name(9, names[8]), commit_index.marker_name(10, names[9])]
    assert json.loads(out)["markers_removed"] == 8
    assert catalog.find(resolve(path), "latest").name == names[9]


def test_a_pointer_more_commits_behind_than_the_walk_reads_still_resolves_from_the_index(root, monkeypatch):
    """The walk reads markers from the newest down, so how far behind the pointer is costs nothing."""
    path, names = root
    monkeypatch.setattr(commit_index, "MAX_WALK", 1)  # stands for 64 markers: two commits past the pointer
    _point_latest_at(path, names[0])
    _no_listing(monkeypatch)
    assert catalog.find(resolve(path), "latest").name == names[2]


def test_latest_after_a_rollback_reads_no_marker_and_only_the_pointers_and_the_answers_directories(tmp_path):
    """Steps 1-12, then a rollback commits step 3 again (seq 13), `latest` left at step 1: one LIST of the index
    gives every marker's directory, so neither a marker nor the abandoned branch's nine directories of higher steps
    is read (the counting check read each of those commit records, and the walk read markers one by one)."""
    import uuid

    from tests.helpers import counting_fs
    from tests.helpers.counting_fs import counting_url

    path = str(tmp_path / "run")
    names = [dirname_of(save_checkpoint(path, step=step)) for step in range(1, 13)]
    branch = dirname_of(save_checkpoint(path, step=3))
    _point_latest_at(path, names[0])
    log_id = uuid.uuid4().hex
    location = resolve(counting_url(path), {"log_id": log_id})
    assert catalog.find(location, "latest").name == branch
    log = counting_fs.LOGS[log_id]
    read = {os.path.relpath(p, path).split(os.sep)[0] for p, _, _ in log.reads}
    assert read == {LATEST, names[0], branch}  # nothing under index/, no other checkpoint directory
    index = os.path.join(path, commit_index.INDEX_DIR)
    assert sorted(log.lists) == sorted([index, os.path.join(index, RUN_ID), path])


def _markers_of_seq(root: str, seq: int) -> list[str]:
    return [name for name in _markers(root) if name.split(".", 1)[0] == f"{seq:09d}"]


def test_a_retry_of_a_seq_leaves_one_marker_naming_its_commit_and_a_leftover_attempts_marker_is_passed_over(
    root, monkeypatch
):
    import torch

    from lightning_shardckpt import CheckpointSaver, SaveConfig
    from tests.helpers.faults import FailOnce

    path, names = root
    config = SaveConfig(async_save=False, write_events=False, run_id=RUN_ID, keep_failed_attempts=True)
    failing = CheckpointSaver(path, config, fault_hook=FailOnce("before_manifest"))  # after its marker
    try:
        failed = failing.save({"w": torch.zeros(4)}, step=4).result(timeout=60)
    finally:
        failing.close()
    assert not failed.committed
    failed_name = failed.path.rstrip("/").rsplit("/", 1)[-1]
    assert _markers_of_seq(path, 4) == [commit_index.marker_name(4, failed_name)]
    retry = dirname_of(save_checkpoint(path, step=4))
    assert _markers_of_seq(path, 4) == [commit_index.marker_name(4, retry)]  # the failed attempt's went
    # had that removal failed, both markers of seq 4 would be there: the one naming a commit of seq 4 wins
    with open(commit_index.marker_path(path, RUN_ID, 4, failed_name), "w") as handle:
        handle.write(failed_name + "\n")
    _point_latest_at(path, names[0])
    _no_listing(monkeypatch)
    assert catalog.find(resolve(path), "latest").name == retry


def test_the_index_never_vouches_for_a_peer_assembled_checkpoint_when_a_newer_commit_lost_its_marker(tmp_path):
    """Steps 10, 20, 30; step 10's directory deleted with its marker left (a crash in retention); step 25 commits
    (seq 4) and its marker is lost: the highest marker names step 30 and the counts below it balance (dirs 20, 25;
    markers 1, 2), so counting vouched for step 30. Step 25's directory is named by no marker: nothing is vouched."""
    import shutil

    path = str(tmp_path / "run")
    names = {step: dirname_of(save_checkpoint(path, step=step)) for step in (10, 20, 30)}
    location = resolve(path)
    assert commit_index.vouches_newest(location, names[30])
    shutil.rmtree(os.path.join(path, names[10]))
    names[25] = dirname_of(save_checkpoint(path, step=25))
    assert not commit_index.vouches_newest(location, names[30])
    for marker in _markers_of_seq(path, 4):
        os.remove(os.path.join(path, commit_index.INDEX_DIR, RUN_ID, marker))
    assert not commit_index.vouches_newest(location, names[30])


def test_the_index_vouches_for_a_rollbacks_newest_commit_past_the_abandoned_branchs_higher_steps(tmp_path):
    """Steps 10, 20, 30, then step 25 (seq 4, a rollback's new branch): step 30's directory is named by marker 3, an
    older commit, so the index vouches for step 25 without a read inside any directory."""
    path = str(tmp_path / "run")
    names = {step: dirname_of(save_checkpoint(path, step=step)) for step in (10, 20, 30, 25)}
    location = resolve(path)
    assert commit_index.vouches_newest(location, names[25])
    assert not commit_index.vouches_newest(location, names[30])


def test_gc_prunes_markers_of_both_formats_in_a_root_an_old_run_began(tmp_path, run_cli):
    """Markers 1-5 as a writer before markers carried names left them (`<seq:09d>`), 6-10 as this one writes them:
    with checkpoints 1-8 deleted, gc removes the markers of both formats that name them."""
    import shutil

    path = str(tmp_path / "run")
    names = [dirname_of(save_checkpoint(path, step=step)) for step in range(1, 11)]
    index = os.path.join(path, commit_index.INDEX_DIR, RUN_ID)
    for seq in range(1, 6):
        os.rename(os.path.join(index, commit_index.marker_name(seq, names[seq - 1])), os.path.join(index, f"{seq:09d}"))
    for name in names[:8]:
        shutil.rmtree(os.path.join(path, name))
    code, out, _ = run_cli("gc", path, "--yes", "--json")
    assert code == 0
    assert _markers(path) == [commit_index.marker_name(9, names[8]), commit_index.marker_name(10, names[9])]
    assert json.loads(out)["markers_removed"] == 8
