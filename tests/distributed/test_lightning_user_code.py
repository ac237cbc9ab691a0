"""What a new Lightning user writes, run on 2 gloo ranks (issue 48, "What users meet").

One spawn (tests/helpers/user_doors_ranks.py); each test reads its results.
"""

from __future__ import annotations

import os

import pytest

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.spawn import run_ranks
from tests.helpers.user_doors_ranks import user_code_on_rank

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("user_code"))
    return workdir, [outcome.value for outcome in run_ranks(user_code_on_rank, 2, workdir, timeout_s=300)]


def test_validate_test_and_predict_after_fit_load_the_newest_commit_through_best_and_last(ranks):
    workdir, results = ranks
    newest = [e for e in catalog.list_checkpoints(fsio.resolve(f"{workdir}/run")) if e.committed][-1]
    assert newest.step == 3
    for rank in results:
        evaluate = rank["evaluate"]
        assert evaluate["checkpoint_callback_is_ours"]
        for name in ("validate", "test", "predict"):
            assert evaluate[name] == {"path": newest.path, "step": 3, "ran": True}, (name, evaluate[name])
    assert os.path.isdir(newest.path)


def test_the_readmes_configure_model_runs_again_for_validate_test_and_predict(ranks):
    # the README's snippet, exactly as printed: without its guard the second fully_shard is refused
    _, results = ranks
    for rank in results:
        assert all(rank["evaluate"][name]["ran"] for name in ("validate", "test", "predict"))


def test_a_fit_from_a_checkpointers_checkpoint_continues_at_its_step_and_data_position(ranks):
    _, results = ranks
    for rank in results:
        fit = rank["from_checkpointer"]
        # saved after 3 steps, 24 of the epoch's 32 samples consumed: the fit goes on from there, to max_steps=5
        assert fit["at_start"] == {"step": 3, "position": 24, "epoch": 0}
        assert fit["global_step"] == 5
        assert fit["validated"]  # validate(ckpt_path=the Checkpointer's checkpoint) too
        # the warning names only what the Checkpointer's checkpoint does not hold
        assert fit["not_restored"] == [
            "the LR schedulers, the batch within the epoch, other callbacks' and the datamodule's state"
        ]
