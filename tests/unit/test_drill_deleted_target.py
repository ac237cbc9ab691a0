"""A checkpoint deleted under a restore drill is not a failed restore, in the follower and in training alike
(issue 37, item 6).

A plain loop (`Checkpointer`, no drills of its own) commits a checkpoint, a drill of it starts and retention's
deletion (`delete_checkpoint`) removes it under the drill in real drill processes: the drill follower's (`DrillFollower`,
what `shardckpt drill --follow` runs) and the in-training runner's (`DrillRunner`, what `ShardedCheckpoint`'s
drills run). Both report `not-drilled` with the cause, file no `failed` record, and the restore rule (drill_ok,
critical) sees nothing; a real failed drill still fires it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_shardckpt import Checkpointer
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format.names import DRILLS_DIR
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.policies import retention
from lightning_shardckpt.policies.drills.follower import DrillFollower
from lightning_shardckpt.policies.drills.runner import DrillOptions, DrillRunner
from lightning_shardckpt.policies.health.evaluate import HealthEvaluator
from lightning_shardckpt.policies.health.rules import health_config_from

OPTIONS = DrillOptions(world_size=1, timeout_s=120)


class KeepLastOne:
    """A training loop whose retention (keep_last=1) deletes each checkpoint as the next one commits; the test says
    when the next one commits, so a drill of the newest can be made to overlap its deletion."""

    def __init__(self, root: Path) -> None:
        self.root, self.step = root, 0
        self.state = {"weights": torch.zeros(16 << 20)}  # 64 MiB: a drill reads it for a while
        self.checkpointer = Checkpointer(str(root), keep_last=1, save={"async_save": False})

    def commit_next(self) -> None:
        self.step += 1
        self.state["weights"].add_(1.0)
        self.checkpointer.save(self.step, self.state, blocking=True)

    def delete_newest(self) -> None:
        """What retention does to it when the next one commits (a commit takes longer than most drills here)."""
        location = fsio.resolve(str(self.root))
        newest = [entry for entry in catalog.list_checkpoints(location) if entry.committed][-1]
        retention.delete_checkpoint(location, newest)

    def close(self) -> None:
        self.checkpointer.close()


def _drilled_while_deleted(run: KeepLastOne, drill) -> dict:
    """Commit a checkpoint, start `drill()` of it and delete it as retention does `delay` s later until a drill
    overlapped the deletion. A drill that passed (it finished first) shortens the delay, one
    that found its checkpoint already gone (CheckpointNotFound, or None: gone between the look and the open)
    lengthens it: the delay settles inside the drill on a fast machine and on a loaded one alike."""
    delay, seen = 0.5, []
    for _ in range(40):
        run.commit_next()
        outcome: list[dict | None] = []
        drilling = threading.Thread(target=lambda into=outcome: into.append(drill()), daemon=True)
        drilling.start()
        time.sleep(delay)
        run.delete_newest()
        drilling.join(180)
        assert outcome, "a drill did not return in 180 s"
        record = outcome[0]
        seen.append(None if record is None else (record.get("verdict"), str(record.get("cause", ""))[:60]))
        gone_before = record is None or str(record.get("cause", "")).startswith("CheckpointNotFound")
        if gone_before:
            delay = delay * 2 + 0.1
        elif record.get("verdict") == "passed":
            delay /= 2
        else:
            return record
    raise AssertionError(f"no drill overlapped a deletion in 40 tries: {seen}")


@pytest.mark.slow
def test_a_checkpoint_deleted_under_a_drill_is_not_drilled_in_the_follower_and_in_training(tmp_path):
    root = tmp_path / "ckpt"
    follower = DrillFollower(str(root), OPTIONS, every_n_checkpoints=1, interval_s=0.1)
    results: list[dict] = []
    runner = DrillRunner(OPTIONS, results.append)
    follower.warm_up()  # forks before the training thread runs
    run = KeepLastOne(root)
    try:

        def follower_drill() -> dict | None:
            try:
                return follower.step()
            except Exception:  # deleted between the look and the open: nothing was drilled
                return None

        def training_drill() -> dict:
            newest = sorted(path.parent for path in root.glob("step-*/manifest.json"))[-1]
            results.clear()
            runner.request(str(newest))
            while not results:
                time.sleep(0.05)
            return results[0]

        from_follower = _drilled_while_deleted(run, follower_drill)
        in_training = _drilled_while_deleted(run, training_drill)
    finally:
        run.close()
        runner.close(60)
        follower._pool.close()
    for record in (from_follower, in_training):
        assert record["verdict"] == "not-drilled", record
        assert "was deleted" in record["cause"] and "not a failed restore" in record["cause"], record
        assert not (root / record["checkpoint"] / "manifest.json").exists()  # uncommitted; its files may go later
    assert [path.name for path in (root / DRILLS_DIR).glob("*failed*")] == []


def test_a_not_drilled_drill_never_fires_the_restore_rule_and_a_failed_one_does():
    rule = {
        "name": "restore_drills",
        "metric": "drill_ok",
        "owner": "infra",
        "severity": "critical",
        "range": {"kind": "static", "min": 1},
        "persistence": {"fire_after": 1, "resolve_after": 1},
    }
    evaluator = HealthEvaluator(health_config_from([rule]))
    event = {"event": "drill", "step": 1, "created_at": 1.0, "run_id": "r"}
    assert evaluator.observe_event({**event, "verdict": "not-drilled", "cause": "step-1 was deleted ..."}) == []
    assert [t.rule.name for t in evaluator.observe_event({**event, "verdict": "failed"})] == ["restore_drills"]
