"""`latest`, retention and `parent` follow commit order within a run, not the largest step (issue 9, items 5 and 6)."""

from __future__ import annotations

import shutil
import threading

import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig, load_checkpoint
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format.names import parse_dirname
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.policies import retention
from tests.helpers.checkpoints import dirname_of
from tests.helpers.faults import FailOnce

RUN = "run-lineage"


def state(step: int) -> dict:
    return {"weights": torch.full((32,), float(step)), "progress": {"step": step}}


def save(root: str, step: int, run_id: str = RUN, fault_hook=None, **options) -> dict | None:
    """Commit `step` as run `run_id`, as a resumed (or first) process of that run would; return the manifest."""
    saver = CheckpointSaver(
        root, SaveConfig(async_save=False, write_events=False, run_id=run_id, **options), fault_hook=fault_hook
    )
    try:
        result = saver.save(state(step), step=step).result(timeout=60)
    finally:
        saver.close()
    return result.manifest if result.committed else None


def save_and_retain(root: str, step: int, keep_last: int, run_id: str = RUN, **options) -> dict:
    """What ShardedCheckpoint does after each commit: save, then apply retention for this run."""
    manifest = save(root, step, run_id, **options)
    assert manifest is not None
    retention.apply(resolve(root), keep_last, None, run_id=run_id, just_committed=dirname_of(manifest))
    return manifest


def steps(root: str, run_id: str | None = None) -> list[int]:
    entries = catalog.list_checkpoints(resolve(root))
    return [e.step for e in entries if e.committed and (run_id is None or e.run_id == run_id)]


def loaded_step(root: str) -> int:
    target = state(0)
    result = load_checkpoint(target, root, "latest")
    assert int(target["weights"][0]) == result.step
    return result.step


def test_after_a_rollback_keep_last_1_keeps_the_new_branch_and_latest_resumes_it(tmp_path):
    root = str(tmp_path / "run")
    for step in (3, 6, 9):
        save(root, step)
    # loss spike at 9: the run resumes from step 6 and commits step 8; keep_last=1 applies
    save_and_retain(root, 8, keep_last=1)
    assert steps(root) == [8], "the checkpoint just committed must survive; the abandoned step 9 goes"
    assert catalog.find(resolve(root), "latest").step == 8
    assert loaded_step(root) == 8


def test_abandoned_branch_stays_in_the_window_but_is_never_latest_then_ages_out(tmp_path):
    root = str(tmp_path / "run")
    for step in (3, 6, 9):
        save(root, step)
    save_and_retain(root, 8, keep_last=2)
    assert steps(root) == [8, 9]  # 9 is one of the run's two newest commits: kept
    assert catalog.find(resolve(root), "latest").step == 8, "the newest commit is latest, not the largest step"
    save_and_retain(root, 10, keep_last=2)
    assert steps(root) == [8, 10]  # 9 aged out of the window
    assert loaded_step(root) == 10


def test_seq_and_parent_follow_commits_across_a_rollback(tmp_path):
    root = str(tmp_path / "run")
    first = save(root, 3)
    second = save(root, 9)
    resumed = save(root, 6)  # after a rollback: a smaller step, a later commit
    assert [first["seq"], second["seq"], resumed["seq"]] == [1, 2, 3]
    assert [first["parent"], second["parent"], resumed["parent"]] == [None, first["id"], second["id"]]


def test_parent_is_the_newest_commit_even_when_the_latest_pointer_is_stale(tmp_path):
    root = str(tmp_path / "run")
    first = save(root, 1)
    # the coordinator fails right after the manifest of step 2: committed, but `latest` still names step 1
    assert save(root, 2, fault_hook=FailOnce("after_manifest")) is None
    (second,) = [e for e in catalog.list_checkpoints(resolve(root)) if e.step == 2 and e.committed]
    assert catalog.read_latest_pointer(resolve(root)) == dirname_of(first)
    third = save(root, 3)
    assert third["parent"] == second.checkpoint_id, "parent must be the run's newest commit, not the stale pointer's"
    assert third["seq"] == second.seq + 1 == 3


def test_in_a_shared_root_retention_never_deletes_another_runs_checkpoints(tmp_path):
    root = str(tmp_path / "shared")
    for step in (100, 200, 300):
        save(root, step, run_id="run-a", allow_shared_root=True)
    # run B starts later with smaller steps; its retention sees A's larger steps and must ignore them
    save_and_retain(root, 1, keep_last=1, run_id="run-b", allow_shared_root=True)
    save_and_retain(root, 2, keep_last=1, run_id="run-b", allow_shared_root=True)
    assert steps(root, "run-a") == [100, 200, 300]
    assert steps(root, "run-b") == [2]
    save_and_retain(root, 400, keep_last=2, run_id="run-a", allow_shared_root=True)
    assert steps(root, "run-a") == [300, 400] and steps(root, "run-b") == [2]
    location = resolve(root)
    assert catalog.find(location, "latest", run_id="run-b").step == 2, "a run resumes its own newest commit"
    assert catalog.find(location, "latest").step == 400, "unknown run: the run that committed last"


def test_retention_keeps_the_just_committed_checkpoint_even_outside_the_window(tmp_path):
    root = str(tmp_path / "run")
    for step in (1, 2, 3):
        save(root, step)
    entries = catalog.list_checkpoints(resolve(root))
    oldest = entries[0].name
    doomed = retention.to_delete(entries, 1, None, run_id=RUN, just_committed=oldest)
    assert [e.step for e in doomed] == [2]


def test_ls_json_shows_each_checkpoints_run_seq_and_parent(tmp_path, run_cli):
    import json

    root = str(tmp_path / "run")
    first, second = save(root, 9), save(root, 6)
    code, out, _ = run_cli("ls", root, "--json")
    assert code == 0
    listing = json.loads(out)
    rows = {row["step"]: row for row in listing["checkpoints"]}
    assert (rows[9]["seq"], rows[9]["parent"], rows[9]["run_id"]) == (1, None, RUN)
    assert (rows[6]["seq"], rows[6]["parent"]) == (2, first["id"]) and second["seq"] == 2
    assert [step for step, row in rows.items() if row["latest"]] == [6], "the newer commit, not the larger step"


def retain_at_once(root: str, start: threading.Barrier, errors: list[BaseException]) -> None:
    """keep_last=2 for the run, released together with the other thread; an exception is kept for the test."""
    start.wait()
    try:
        retention.apply(resolve(root), 2, None, run_id=RUN)
    except BaseException as err:
        errors.append(err)


def test_two_writers_applying_retention_to_one_root_at_once_never_raise_and_keep_the_newest(tmp_path):
    """A deletion racing another deletion is not an error: what the other one removed counts as gone."""
    template = str(tmp_path / "template")
    for step in range(1, 7):
        save(template, step)
    for round_ in range(50):
        root = str(tmp_path / f"round-{round_}")
        shutil.copytree(template, root)
        start = threading.Barrier(2)
        errors: list[BaseException] = []
        threads = [threading.Thread(target=retain_at_once, args=(root, start, errors)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, f"round {round_}: {errors[0]!r}"
        assert steps(root) == [5, 6], f"round {round_}"
        left = sorted(e.name for e in catalog.list_checkpoints(resolve(root)))
        assert [parse_dirname(name).step for name in left] == [5, 6], f"round {round_}: {left}"
        assert loaded_step(root) == 6
