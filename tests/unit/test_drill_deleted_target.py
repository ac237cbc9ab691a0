"""A checkpoint deleted under a restore drill is not a failed restore, in the follower and in training alike
(issue 37, item 6).

A plain loop (`Checkpointer`, keep_last=1, no drills of its own) commits every 0.3 s in a thread, so each commit
deletes the one before while a drill of it runs in real drill processes: the drill follower's (`DrillFollower`,
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
from lightning_shardckpt.engine.format.layout import DRILLS_DIR
from lightning_shardckpt.policies.drills.follower import DrillFollower
from lightning_shardckpt.policies.drills.runner import DrillOptions, DrillRunner
from lightning_shardckpt.policies.health.evaluate import HealthEvaluator
from lightning_shardckpt.policies.health.rules import health_config_from

OPTIONS = DrillOptions(world_size=1, timeout_s=120)


class KeepLastOne:
    """A training loop whose retention deletes each checkpoint as the next commits (every 0.3 s)."""

    def __init__(self, root: Path) -> None:
        self.root, self.stop, self.error = root, threading.Event(), None
        self.thread = threading.Thread(target=self._train, daemon=True)

    def _train(self) -> None:
        try:
            state = {"weights": torch.zeros(1 << 18)}
            with Checkpointer(str(self.root), keep_last=1, save={"async_save": False}) as checkpointer:
                step = 0
                while not self.stop.is_set():
                    step += 1
                    state["weights"].add_(1.0)
                    checkpointer.save(step, state, blocking=True)
                    time.sleep(0.3)
        except Exception as err:  # the test reports it
            self.error = err

    def __enter__(self) -> KeepLastOne:
        self.thread.start()
        while not list(self.root.glob("step-*/manifest.json")):
            time.sleep(0.05)
        return self

    def __exit__(self, *args) -> None:
        self.stop.set()
        self.thread.join(60)
        assert self.error is None, self.error


def _drilled_while_deleted(drill) -> dict:
    """Run `drill()` until a drill of a checkpoint that retention deleted meanwhile came back (a drill that ran
    before its checkpoint went, or one asked for a checkpoint already gone, is not what is tested: try again)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        record = drill()
        gone_before = record is not None and str(record.get("cause", "")).startswith("CheckpointNotFound")
        if record is not None and record.get("verdict") != "passed" and not gone_before:
            return record
    raise AssertionError("no drill overlapped a deletion in 240 s")


@pytest.mark.slow
def test_a_checkpoint_deleted_under_a_drill_is_not_drilled_in_the_follower_and_in_training(tmp_path):
    root = tmp_path / "ckpt"
    follower = DrillFollower(str(root), OPTIONS, every_n_checkpoints=1, interval_s=0.1)
    results: list[dict] = []
    runner = DrillRunner(OPTIONS, results.append)
    follower.warm_up()  # forks before the training thread runs
    try:
        with KeepLastOne(root):

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

            from_follower = _drilled_while_deleted(follower_drill)
            in_training = _drilled_while_deleted(training_drill)
    finally:
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
