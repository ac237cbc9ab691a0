"""Retention, Lightning's own ModelCheckpoint and save_checkpoint, preemption, metrics through loggers."""

from __future__ import annotations

import csv
import glob

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format.names import checkpoint_dirname
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.policies.retention import to_delete
from tests.helpers.lightning_run import features_on_rank
from tests.helpers.spawn import run_ranks


def test_lightning_features_work_together_on_two_ranks(tmp_path):
    workdir = str(tmp_path)
    outcome = run_ranks(features_on_rank, 2, workdir, timeout_s=300)[0].value

    # retention: keep_last=2 plus multiples of 4 -> steps 4, 8, 10 (fit end) stay; 2 and 6 are gone
    kept = [(e.step, e.state) for e in catalog.list_checkpoints(fsio.resolve(f"{workdir}/run"))]
    assert kept == [(4, "committed"), (8, "committed"), (10, "committed")]

    # Lightning's ModelCheckpoint wrote through our strategy: its best path is a committed root, the older one removed
    roots = sorted(glob.glob(f"{workdir}/lightning/*.ckpt"))
    assert roots == [outcome["model_checkpoint_best"]]
    assert catalog.find(fsio.resolve(roots[0]), "latest").step == 9

    # metrics reached the logger
    with open(f"{outcome['log_dir']}/metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    logged = [row for row in rows if row.get("checkpoint/pause_s")]
    assert len(logged) >= 5, "one row per checkpoint"
    assert all(float(row["checkpoint/total_s"]) >= float(row["checkpoint/pause_s"]) for row in logged)
    assert max(float(row["checkpoint/committed"]) for row in logged) == 5.0

    # preemption: a final blocking save at step 3, then the run stopped
    assert outcome["stopped_at"] == 3
    assert catalog.find(fsio.resolve(f"{workdir}/preempt"), "latest").step == 3

    # trainer.save_checkpoint wrote a root that fit(ckpt_path=...) resumes from
    assert outcome["manual_resume_step"] == 10


def _entry(step: int, state: str = "committed") -> catalog.CheckpointEntry:
    name = checkpoint_dirname(step, "aaaaaaaaaaaa")
    return catalog.CheckpointEntry(name, f"/r/{name}", step, "aaaaaaaaaaaa", state)


def test_retention_keeps_the_newest_and_multiples_and_never_touches_uncommitted():
    entries = [_entry(s) for s in (2, 4, 6, 8, 10)] + [_entry(12, "uncommitted")]
    assert [e.step for e in to_delete(entries, keep_last=2, keep_every_n_steps=4)] == [2, 6]
    assert [e.step for e in to_delete(entries, keep_last=1, keep_every_n_steps=None)] == [2, 4, 6, 8]


def test_registered_strategy_name_and_time_and_epoch_triggers(tmp_path):
    from tests.helpers.lightning_run import triggers_on_rank

    outcome = run_ranks(triggers_on_rank, 1, str(tmp_path), timeout_s=240)[0].value
    assert outcome["strategy"] == "ShardedDDPStrategy"
    by_time = [e.step for e in catalog.list_checkpoints(fsio.resolve(f"{tmp_path}/by-time")) if e.committed]
    assert by_time and set(by_time) <= {1, 2, 3, 4} and len(by_time) >= 2, by_time  # 0.1 s interval, 0.05 s+ steps
    by_epoch = [e.step for e in catalog.list_checkpoints(fsio.resolve(f"{tmp_path}/by-epoch")) if e.committed]
    assert by_epoch == [outcome["epoch_steps"], 2 * outcome["epoch_steps"]]
