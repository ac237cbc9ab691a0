"""Through Lightning: resume from an older checkpoint (a rollback), keep_last=1, then "latest" (issue 9, item 5)."""

from __future__ import annotations

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.lightning_run import fit_on_rank
from tests.helpers.spawn import run_ranks


def test_after_a_rollback_keep_last_1_keeps_the_new_branch_and_latest_resumes_it(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ranks(fit_on_rank, 2, root, "ddp", 9, None, {"every": 3}, timeout_s=240)
    by_step = {e.step: e for e in catalog.list_checkpoints(fsio.resolve(root)) if e.committed}
    assert sorted(by_step) == [3, 6, 9]

    # a loss spike after step 6: resume from step 6's directory while step 9 exists, train to 8, keep_last=1
    rolled = run_ranks(fit_on_rank, 2, root, "ddp", 8, by_step[6].path, {"every": 3, "keep_last": 1}, timeout_s=240)
    assert rolled[0].value["at_start"]["global_step"] == 6 and rolled[0].value["global_step"] == 8
    after = [(e.step, e.state) for e in catalog.list_checkpoints(fsio.resolve(root))]
    assert after == [(8, "committed")], "the checkpoint just committed must survive; the abandoned step 9 goes"

    resumed = run_ranks(fit_on_rank, 2, root, "ddp", 10, "latest", {"every": 3, "keep_last": 1}, timeout_s=240)
    assert resumed[0].value["at_start"]["global_step"] == 8, "latest is the new branch, not the larger step 9"
    assert catalog.find(fsio.resolve(root), "latest").step == 10


def test_after_a_rollback_the_abandoned_branch_is_kept_in_the_window_but_never_resumed(tmp_path):
    root = str(tmp_path / "ckpt")
    run_ranks(fit_on_rank, 2, root, "ddp", 9, None, {"every": 3}, timeout_s=240)
    by_step = {e.step: e for e in catalog.list_checkpoints(fsio.resolve(root)) if e.committed}
    run_ranks(fit_on_rank, 2, root, "ddp", 8, by_step[6].path, {"every": 3, "keep_last": 2}, timeout_s=240)
    assert [e.step for e in catalog.list_checkpoints(fsio.resolve(root)) if e.committed] == [8, 9]
    resumed = run_ranks(fit_on_rank, 2, root, "ddp", 9, "latest", {"every": 100, "keep_last": 2}, timeout_s=240)
    assert resumed[0].value["at_start"]["global_step"] == 8
