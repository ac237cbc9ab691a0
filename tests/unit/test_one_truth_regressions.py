"""Sequences the model-based test of a root (test_one_truth_model.py) found, shrunk, as plain tests."""

from __future__ import annotations

import os

import pytest

from lightning_shardckpt import follow_checkpoints, list_checkpoints
from lightning_shardckpt.engine.commit_index import INDEX_DIR
from lightning_shardckpt.engine.config import SaveConfig, SignConfig
from lightning_shardckpt.engine.format.names import LATEST
from lightning_shardckpt.engine.save.saver import CheckpointSaver
from tests.helpers.checkpoints import fresh_state
from tests.helpers.signing_keys import Keys


def _commit(root: str, step: int, sign: SignConfig) -> str:
    saver = CheckpointSaver(root, SaveConfig(async_save=False, run_id="run-1", sign=sign))
    try:
        result = saver.save(fresh_state(seed=step), step=step).result(timeout=60)
    finally:
        saver.close()
    assert result.committed, result.error
    return result.path.rstrip("/").rsplit("/", 1)[-1]


@pytest.mark.timeout(120)
def test_a_follower_under_a_signature_policy_never_yields_an_unsigned_or_foreign_key_commit(tmp_path):
    """Shrunk: save (signed); a writer without the key commits (unsigned), another signs with a key the readers
    do not accept; save (signed). The follower yielded the unsigned commit that no resume would load."""
    keys = Keys.make(tmp_path)
    root = str(tmp_path / "root")
    signed_1 = _commit(root, 1, SignConfig(key_path=keys.private))
    _commit(root, 2, SignConfig())
    _commit(root, 3, SignConfig(key_path=keys.other_private))
    signed_4 = _commit(root, 4, SignConfig(key_path=keys.private))
    followed = [
        info.name
        for info in follow_checkpoints(root, include_existing=True, timeout_s=0.5, poll_s=0.05, public_keys=keys.public)
    ]
    assert followed == [signed_1, signed_4]
    assert list_checkpoints(root, public_keys=keys.public).latest.name == signed_4  # the pick it must agree with


def _rollback_root(root: str) -> dict[int, str]:
    """Through the door: steps 10 and 50, then twice a rollback to step 10 (by its path) that commits 30, then 20:
    seqs 1-4 by step 10, 50, 30, 20. Returns step -> directory name."""
    import torch

    from lightning_shardckpt import Checkpointer

    names: dict[int, str] = {}
    state = {"w": torch.zeros(8)}

    def save(checkpointer: Checkpointer, step: int) -> None:
        state["w"].fill_(float(step))
        result = checkpointer.save(step, state, blocking=True).result()
        assert result.committed, result.error
        names[step] = result.path.rstrip("/").rsplit("/", 1)[-1]

    with Checkpointer(root, save={"async_save": False, "run_id": "run-1"}) as checkpointer:
        save(checkpointer, 10)
        save(checkpointer, 50)
        for step in (30, 20):
            assert checkpointer.load(state, f"{root}/{names[10]}") == 10
            save(checkpointer, step)
    return names


def _markers_of(root: str) -> str:
    return os.path.join(root, INDEX_DIR, "run-1")


def _in_the_first_marker_format(root: str, seqs: set[int]) -> None:
    """Rewrite the markers of `seqs` as a writer before markers carried names left them: `<seq:09d>`, holding the
    directory name."""
    for marker in os.listdir(_markers_of(root)):
        seq, _, dirname = marker.partition(".")  # today's `<seq:09d>.<directory name>`
        if dirname and int(seq) in seqs:
            os.rename(os.path.join(_markers_of(root), marker), os.path.join(_markers_of(root), seq))


@pytest.mark.parametrize("markers", ["named", "first_format", "mixed"])
def test_a_rollbacks_newest_commit_with_its_marker_deleted_is_latest_for_ls_resolve_and_resume(tmp_path, markers):
    """Shrunk from the walk's counting check: with marker 4 (step 20) deleted and `latest` naming step 30 (seq 3),
    the abandoned step 50 made the counts of directories and markers below step 30 balance, so `resolve_checkpoint`
    and a resume took step 30 while `ls` starred step 20. Every directory no marker names is now read."""
    import torch

    from lightning_shardckpt import Checkpointer, resolve_checkpoint

    root = str(tmp_path / "root")
    names = _rollback_root(root)
    seqs = {entry.name: entry.seq for entry in list_checkpoints(root).checkpoints}
    assert [seqs[names[step]] for step in (10, 50, 30, 20)] == [1, 2, 3, 4]
    marker_4 = next(m for m in os.listdir(_markers_of(root)) if m.startswith("000000004"))
    os.remove(os.path.join(_markers_of(root), marker_4))
    with open(os.path.join(root, LATEST), "w") as handle:
        handle.write(names[30] + "\n")
    if markers != "named":  # an old run's root, or one an old run wrote and this writer resumed
        _in_the_first_marker_format(root, {1, 2, 3} if markers == "first_format" else {1, 2})
    state = {"w": torch.zeros(8)}
    with Checkpointer(root) as checkpointer:
        resumed = checkpointer.load(state)
    assert {
        "ls": list_checkpoints(root).latest.name,
        "resolve_checkpoint": resolve_checkpoint(root, "latest").name,
        "resume": names[resumed],
    } == dict.fromkeys(["ls", "resolve_checkpoint", "resume"], names[20])
    assert state["w"][0].item() == 20.0


@pytest.mark.timeout(120)
def test_an_incremental_checkpoint_retired_while_reachability_is_unknown_is_not_sound_for_the_model(tmp_path):
    """Shrunk from the deep profile (incremental variants, "list_checkpoints stars None ... the newest sound commit
    is step-1"): save 1-3; edit step 2's manifest; save 4. Retention retires step 1 (RETIRED written, manifest
    removed) but, a kept manifest being unreadable, removes nothing more: its commit record stays. The model counted
    a commit record as committed, so it believed step 1 sound and let the machine edit steps 3 and 4 too, the last
    sound one, then expected step 1 where every reader rightly picks nothing. The manifest is the commit point
    (FORMAT.md §4, §9): the model now sees step 4 as the only sound commit left."""
    from lightning_shardckpt.engine.format.names import COMMIT_RECORD, MANIFEST
    from lightning_shardckpt.engine.format.references import RETIRED
    from tests.unit.test_one_truth_model import KEEP_LAST, _machine

    assert KEEP_LAST == 3  # the sequence below retires step 1 at the 4th save
    machine = _machine(str(tmp_path / "root"), {}, (), incremental=True)()

    def then(act) -> None:  # a rule, then the invariants, as the state machine runs them
        act()
        machine.every_entry_point_picks_the_same_checkpoint()
        machine.no_commit_lost_except_by_retention()

    then(machine.start)
    for _ in range(3):
        then(machine.save)
    step = {commit["step"]: commit for commit in machine.commits}
    then(lambda: machine.edit_manifest_of(step[2]))
    then(machine.save)
    retired = str(tmp_path / "root" / step[1]["name"])
    assert sorted(os.listdir(retired)) == sorted(
        [".metadata", "__0_0.distcp", "__0_0.part.json", COMMIT_RECORD, RETIRED]
    )
    assert MANIFEST not in os.listdir(retired)  # uncommitted, its commit record notwithstanding
    assert [c["step"] for c in machine._sound_present()] == [3, 4]
    then(lambda: machine.edit_manifest_of(step[3]))
    # one sound commit left: the machine's rules that damage a checkpoint (precondition: two sound) stop here
    assert [c["step"] for c in machine._sound_present()] == [4]
    machine.teardown()
