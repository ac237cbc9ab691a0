"""`ckpt_path` as Lightning spells it, and Lightning's ModelCheckpoint beside ShardedCheckpoint, on 2 real ranks.

One spawned run of four fits (tests/helpers/ckpt_paths_ranks.py), several tests reading its results.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pytest

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.ckpt_paths_ranks import ckpt_paths_on_rank
from tests.helpers.spawn import run_ranks


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("ckpt_paths"))
    outcomes = run_ranks(ckpt_paths_on_rank, 2, workdir, timeout_s=300)
    stderr = [Path(f"{workdir}/stderr-{rank}.txt").read_text() for rank in range(2)]
    return workdir, [o.value for o in outcomes], stderr


def _committed(root: str) -> list[catalog.CheckpointEntry]:
    return [e for e in catalog.list_checkpoints(fsio.resolve(root)) if e.committed]


def test_last_with_model_checkpoint_save_last_loads_last_ckpt_and_continues_the_run(fits):
    workdir, ranks, _ = fits
    fit = ranks[0]["last_with_model_checkpoint"]
    assert fit["resumed_path"].startswith(f"{workdir}/lightning/last.ckpt/"), fit["resumed_path"]
    assert fit["start_step"] == 6 and fit["global_step"] == 10  # trained on, not refused as another run
    run_ids = {e.run_id for e in _committed(f"{workdir}/run")} | {e.run_id for e in _committed(fit["last_model_path"])}
    assert len(run_ids) == 1 and None not in run_ids, run_ids  # one run across the callback's root and last.ckpt


def test_last_ckpt_keeps_only_its_newest_checkpoint(fits):
    workdir, ranks, _ = fits
    # saved at steps 2, 4, 6 (fresh fit) and 8, 10 (resumed): the newest only, as Lightning overwrites its file
    assert [e.step for e in _committed(f"{workdir}/lightning/last.ckpt")] == [10]
    assert [e.step for e in catalog.list_checkpoints(fsio.resolve(f"{workdir}/lightning/last.ckpt"))] == [10]


def test_last_with_sharded_checkpoint_alone_resumes_its_roots_newest_in_the_same_run(fits):
    workdir, ranks, _ = fits
    fit = ranks[0]["last_alone"]
    assert fit["start_step"] == 10 and fit["global_step"] == 11
    assert os.path.dirname(fit["resumed_path"]) == f"{workdir}/run"
    entries = _committed(f"{workdir}/run")
    assert [e.step for e in entries] == [6, 10, 11]
    assert len({e.run_id for e in entries}) == 1
    assert entries[-1].manifest["parent"] == entries[-2].checkpoint_id  # the run's lineage goes on


def test_an_explicit_path_into_a_new_root_forks_a_run_that_names_its_parent(fits):
    workdir, ranks, _ = fits
    fit = ranks[0]["fork"]
    source = _committed(f"{workdir}/run")[-1]
    assert fit["resumed_path"] == source.path and fit["start_step"] == 11 and fit["global_step"] == 13
    forked = _committed(f"{workdir}/fork")
    assert [e.step for e in forked] == [13]
    assert forked[0].run_id and forked[0].run_id != source.run_id  # a new run in its own root
    events = [json.loads(Path(p).read_text()) for p in glob.glob(f"{workdir}/fork/events/resume-*.json")]
    assert [(e["from_id"], e["run_id"]) for e in events] == [(source.checkpoint_id, source.run_id)]


def test_a_per_rank_value_in_model_checkpoints_filename_writes_every_rank_into_rank_0s_directory(fits):
    workdir, ranks, _ = fits
    assert ranks[0]["fresh"]["best_k"] != ranks[1]["fresh"]["best_k"]  # the premise: the ranks' names differ
    best = ranks[0]["last_with_model_checkpoint"]["best_k"]
    assert len(best) == 2
    roots = sorted(p for p in glob.glob(f"{workdir}/lightning/*.ckpt") if not p.endswith("last.ckpt"))
    assert roots == best  # the top 2 by rank 0's names; older top-k roots were removed, no stray ones left
    for root in roots:
        (entry,) = _committed(root)
        shards = sorted(os.path.basename(p) for p in glob.glob(f"{entry.path}/*.distcp"))
        assert shards == ["__0_0.distcp", "__1_0.distcp"], shards


def test_a_resume_prints_one_line_and_lightning_does_not_call_our_loader_not_resumable(fits):
    workdir, ranks, stderr = fits
    for name in ("last_with_model_checkpoint", "last_alone", "fork"):
        fit = ranks[0][name]
        assert fit["start_step"] % fit["batches_per_epoch"] != 0  # the premise: every resume is mid-epoch
        line = (
            f"lightning_shardckpt: resumed from {fit['resumed_path']} (step {fit['start_step']}) on 2 -> 2 ranks, in "
        )
        assert stderr[0].count(line) == 1, stderr[0]
    assert "lightning_shardckpt: resumed from" not in stderr[1]  # rank 0 only
    assert "Restoring states from the checkpoint path at latest" in stderr[0]  # Lightning's own line is there too
    for text in stderr:  # the fork too: its data position came from the state saved under the source's dirpath
        assert "not resumable" not in text, text
        assert "no last checkpoint available" not in text
