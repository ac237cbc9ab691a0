"""Sequences the model-based test of a root (test_one_truth_model.py) found, shrunk, as plain tests."""

from __future__ import annotations

import pytest

from lightning_shardckpt import follow_checkpoints, list_checkpoints
from lightning_shardckpt.engine.config import SaveConfig, SignConfig
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
