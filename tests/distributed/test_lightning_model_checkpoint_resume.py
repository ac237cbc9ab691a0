"""A run checkpointed by Lightning's own ModelCheckpoint continues under ShardedStrategy + ShardedCheckpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.storage import fsio
from tests.helpers import training_state as ts
from tests.helpers.lightning_run import from_model_checkpoint_on_rank, untrusted_lightning_ckpt_on_rank
from tests.helpers.spawn import run_ranks

pytestmark = pytest.mark.slow


def _assert_continued(saved: dict, run: dict, root: str) -> None:
    continued, again = run["continued"], run["from_latest"]
    start = continued["at_start"]
    ts.assert_bit_exact(saved["final"], start["full"])  # model + AdamW as ModelCheckpoint saved them
    assert start["global_step"] == 3 and start["scheduler_last_epoch"] == 3
    assert start["callback_batches"] == 3  # a callback's state, as Lightning's own resume restores it
    assert start["extra"] == {"saved_at_step": 3}  # the module's on_load_checkpoint saw Lightning's dict
    assert continued["global_step"] == 6
    # our root's first checkpoint is step 6 (the step counter went on), `latest` resumed it, and training went on
    committed = [e.step for e in catalog.list_checkpoints(fsio.resolve(root)) if e.committed]
    assert committed == [6, 8], committed
    assert again["at_start"]["global_step"] == 6
    ts.assert_bit_exact(continued["final"], again["at_start"]["full"])
    assert again["global_step"] == 8


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_model_checkpoint_of_lightnings_own_strategy_resumes_and_saving_continues_in_our_root(tmp_path, parallelism):
    outcomes = run_ranks(from_model_checkpoint_on_rank, 2, str(tmp_path), parallelism, None, timeout_s=240)
    run = outcomes[0].value
    # DDPStrategy: a file; ModelParallelStrategy: a DCP directory so named
    assert run["saved"].endswith(".ckpt") and Path(run["saved"]).is_dir() == (parallelism == "fsdp")
    _assert_continued(run, run, str(tmp_path / "root"))


def test_a_model_checkpoint_ckpt_file_of_a_ddp_run_resumes_onto_another_world_size(tmp_path):
    saved = run_ranks(from_model_checkpoint_on_rank, 2, str(tmp_path / "two"), "ddp", None, False)[0].value
    run = run_ranks(from_model_checkpoint_on_rank, 1, str(tmp_path / "one"), "ddp", saved["saved"])[0].value
    _assert_continued(saved, run, str(tmp_path / "one" / "root"))


def test_a_lightning_ckpt_pickling_a_user_class_is_refused_unless_trusted_naming_the_fix(tmp_path):
    outcome = run_ranks(untrusted_lightning_ckpt_on_rank, 1, str(tmp_path))[0].value
    refused = outcome["False"]
    assert refused.startswith("UntrustedCheckpoint") and "trust_checkpoint=True" in refused, refused
    assert "Recipe" in refused, refused  # torch's refusal names the class
    assert outcome["True"] == 3  # trusted: resumed at step 2 and trained on
