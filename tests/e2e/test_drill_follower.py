"""Drills `external`: a run on 2 ranks drills nothing itself while drill followers (`shardckpt drill --follow`)
drill its checkpoints; one follower is killed in the middle of a drill and restarted, another runs beside it.

One run, several checks: last-good advances while training runs; a killed follower's drill dies with it and
its restart picks up from the records; two followers never drill one checkpoint at once (nor twice); the
run's health rule on the follower's lag fires while no follower runs and resolves once they catch up.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_shardckpt import ShardedCheckpoint
from lightning_shardckpt.engine import catalog, metrics
from lightning_shardckpt.engine.format.names import DRILLS_DIR
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.policies.drills import scratch
from tests.helpers.health_rules import static_rule
from tests.helpers.lightning_run import TinyData, TinyModule, ddp_trainer, lightning_env
from tests.helpers.process_tree import wait_until_none_holds
from tests.helpers.spawn import run_ranks

REPO = Path(__file__).resolve().parents[2]
PROBE = "tests.helpers.drill_probes:slow_weighted_sum"  # sleeps in the followers only: a drill lasts ~1 s
# tighter than conf/health/default.yaml's drill_follower, so a test run sees it fire
FOLLOWER_RULE = static_rule("follower_lag", "drill_lag_s", high=2.0, fire_after=1, resolve_after=1, owner="tests")


class Pace(pl.Callback):
    """A slow enough run for followers to start, drill, be killed and restart while it trains; at the end it
    waits for the last checkpoint's drill, so the run sees its follower catch up."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(0.4)

    def on_train_end(self, *args: Any) -> None:
        deadline = time.monotonic() + 60
        while not list((self.root / DRILLS_DIR).glob("step-000000044-*--passed.json")):
            if time.monotonic() > deadline:
                return  # the test's assertions say what is missing
            time.sleep(0.1)
        time.sleep(3.0)  # the run's next looks at the records (poll_s 0.3 s) see it, on a loaded machine too


def external_fit(rank: int, world_size: int, root: str) -> int:
    lightning_env(rank, world_size)
    checkpoint = ShardedCheckpoint(
        root,
        every_n_train_steps=2,
        keep_last=None,
        log_artifact=False,
        drill={"mode": "external", "poll_s": 0.3, "probe": PROBE},
        health={"rules": [FOLLOWER_RULE], "alert_every_s": 0},
    )
    trainer = ddp_trainer(world_size, 44, [checkpoint, Pace(root)])
    trainer.fit(TinyModule(parallelism="ddp"), datamodule=TinyData())
    return trainer.global_step


def start_follower(root: str, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "lightning_shardckpt.cli.main", "drill", root, "--follow", "--json"]
    command += ["--interval", "0.2", "--world-size", "1", "--probe", PROBE, "--timeout", "60"]
    env = {**os.environ, "DRILL_PROBE_SLEEP_S": "1.0"}
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for(condition, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def lease_held_by(root: Path, pid: int) -> str | None:
    """The checkpoint a follower process holds a drill lease on, if any."""
    for lease in (root / DRILLS_DIR).glob(".lease--*.json"):
        try:
            body = json.loads(lease.read_text())
        except (OSError, ValueError):
            continue
        if body.get("pid") == pid:
            return body["checkpoint"]
    return None


def scratch_of(pid: int) -> list[str]:
    """The drill scratch directories of the follower with this pid (policies/drills/scratch.py names them so)."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"{scratch.PREFIX}{pid}-*"))


def day_old(directory: Path) -> None:
    """Set back the times of the directory and its files by two days: as if the host had run on since the kill."""
    then = time.time() - 2 * 24 * 3600
    for entry in (*directory.iterdir(), directory):
        os.utime(entry, (then, then))


def following(log: Path) -> bool:
    return "drill workers warm" in log.read_text()


@pytest.fixture(scope="module")
def followed_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("follow")
    root = workdir / "ckpt"
    first = start_follower(str(root), workdir / "a.log")
    second = start_follower(str(root), workdir / "b.log")
    wait_for(lambda: following(workdir / "a.log") and following(workdir / "b.log"), 120, "both followers warm")
    trained: dict[str, Any] = {}

    def train() -> None:
        try:
            trained["steps"] = [outcome.value for outcome in run_ranks(external_fit, 2, str(root), timeout_s=240)]
        except Exception as err:  # the first test reports it
            trained["error"] = err

    training = threading.Thread(target=train)
    training.start()
    # in the middle of a drill: holding a lease, with the drill's scratch directory made
    killed_in = wait_for(
        lambda: scratch_of(first.pid) and lease_held_by(root, first.pid), 120, "follower A in the middle of a drill"
    )
    first.send_signal(signal.SIGKILL)  # mid-drill: its warm pool and drill rank die with it
    second.send_signal(signal.SIGSTOP)  # and B stalls: no follower drills, the run's lag rule fires
    first.wait(10)
    orphaned = scratch_of(first.pid)  # A could not remove it; a day later, the next drill on the host does
    for path in orphaned:
        # A's pool and drill rank die after A is reaped, one generation at a time: a write of the rank's log or
        # outcome in that moment would make the directory fresh again after it is set back
        wait_until_none_holds(path, 10)
        day_old(Path(path))
    restarted = start_follower(str(root), workdir / "a2.log")
    # B resumes once the restarted follower holds a lease of its own, not after a fixed 4 s: on a loaded machine
    # (a parallel suite) A's restart needed longer than that to warm up, B then drilled everything and the
    # restart's pick-up was never exercised. No follower drills meanwhile, so the run's lag rule still fires.
    wait_for(lambda: lease_held_by(root, restarted.pid), 120, "the restarted follower A in a drill")
    second.send_signal(signal.SIGCONT)
    training.join(240)  # it ends once its last checkpoint is drilled (Pace)
    for follower in (second, restarted):
        follower.send_signal(signal.SIGTERM)  # how Kubernetes stops one: it ends cleanly
    stopped = [follower.wait(60) for follower in (second, restarted)]
    logs = {name: (workdir / f"{name}.log").read_text() for name in ("a", "b", "a2")}
    left = [path for path in orphaned if os.path.exists(path)]
    ages = {  # what kept one fresh, for the assertion's message: the age in seconds of it and of each file in it
        entry: round(time.time() - os.stat(entry).st_mtime)
        for path in left
        for entry in [path, *(item.path for item in os.scandir(path))]
    }
    return {
        "root": root,
        "killed": first,
        "killed_in": killed_in,
        "logs": logs,
        "trained": trained,
        "stopped": stopped,
        "orphaned": orphaned,
        "orphans_left": left,
        "orphan_ages_s": ages,
    }


def _records(root: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted((root / DRILLS_DIR).glob("step-*.json"))]


def test_followers_drill_the_run_and_last_good_advances_to_its_final_checkpoint(followed_run):
    root = followed_run["root"]
    assert followed_run["trained"].get("steps") == [44, 44], (followed_run["trained"], followed_run["logs"])
    assert followed_run["stopped"] == [0, 0], followed_run["logs"]
    location = fsio.resolve(str(root))
    entries = catalog.list_checkpoints(location)
    good = catalog.last_good(location, entries)
    assert good and good[-1].name == entries[-1].name, (followed_run["logs"], [r["checkpoint"] for r in _records(root)])
    # the run saw the follower's verdicts as its own drills: passed drills of later and later checkpoints
    drill_events = [e for e in metrics.read_events(location) if e.get("event") == "drill"]
    passed_steps = [e["step"] for e in sorted(drill_events, key=lambda e: e["created_at"]) if e["verdict"] == "passed"]
    # how many checkpoints the followers drill while the run trains depends on the machine's load (on a loaded
    # one, only the last), and two followers file out of step order: each verdict the run reports is a record a
    # follower filed, the final checkpoint the run waited for among them
    filed = {record.get("step") for record in _records(root) if record["verdict"] == "passed"}
    assert passed_steps and max(passed_steps) == 44, passed_steps
    assert set(passed_steps) <= filed, (passed_steps, filed)
    assert all(record["verdict"] == "passed" for record in _records(root)), _records(root)


def test_a_killed_followers_drill_dies_with_it_and_its_restart_picks_up_from_the_records(followed_run):
    records = _records(followed_run["root"])
    killed = f":{followed_run['killed'].pid}:"
    assert not [r for r in records if killed in r["drilled_by"] and r["checkpoint"] == followed_run["killed_in"]]
    restarted_drills = [json.loads(line) for line in followed_run["logs"]["a2"].splitlines() if line.startswith("{")]
    assert restarted_drills, followed_run["logs"]["a2"]
    assert not {r["checkpoint"] for r in restarted_drills} & {
        r["checkpoint"] for r in records if r["finished_at"] < restarted_drills[0]["started_at"]
    }  # nothing drilled before it started is drilled again


def test_the_scratch_a_killed_follower_left_is_removed_by_a_later_drill_once_a_day_old(followed_run):
    assert len(followed_run["orphaned"]) == 1, followed_run["orphaned"]  # SIGKILL: no clean-up ran
    # the restarted follower's drills removed it
    assert followed_run["orphans_left"] == [], (followed_run["orphan_ages_s"], followed_run["logs"]["a2"])


def test_two_followers_on_one_root_never_drill_one_checkpoint_twice(followed_run):
    records = _records(followed_run["root"])
    by_checkpoint: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_checkpoint.setdefault(record["checkpoint"], []).append(record)
    assert all(len(drills) == 1 for drills in by_checkpoint.values()), by_checkpoint
    assert len({record["drilled_by"] for record in records}) >= 2  # both followers did drill


def test_the_runs_follower_lag_rule_fires_without_a_follower_and_resolves_when_it_catches_up(followed_run):
    location = fsio.resolve(str(followed_run["root"]))
    health = [e for e in metrics.read_events(location) if e.get("event") == "health" and e["rule"] == "follower_lag"]
    transitions = [e["transition"] for e in sorted(health, key=lambda e: e["time"])]
    assert "fired" in transitions and transitions[-1] == "resolved", transitions


def test_malformed_leases_never_stop_the_follower_which_drills_on_and_removes_them(tmp_path):
    """Lease files no follower wrote (a time that is a word or a list, a pid that is a word, 400 KB of nested
    brackets, a lease of a checkpoint deleted long ago): each run of the follower, a restart too, drills what is
    due, logs each file once, and removes them once their checkpoints are settled."""
    from tests.helpers.checkpoints import commit_checkpoint

    root = tmp_path / "ckpt"
    names = [Path(commit_checkpoint(str(root), step=step).directory).name for step in (1, 2, 3)]
    drills = root / DRILLS_DIR
    drills.mkdir()
    planted = {
        f".lease--{names[2]}--000000.json": json.dumps({"checkpoint": names[2], "expires_at": "soon", "pid": 1}),
        f".lease--{names[1]}--000000.json": json.dumps({"checkpoint": names[1], "expires_at": 1e12, "pid": "abc"}),
        f".lease--{names[1]}--000001.json": "[" * 200_000 + "]" * 200_000,
        f".lease--{names[0]}--000000.json": json.dumps({"checkpoint": names[0], "expires_at": [1], "pid": 1}),
        ".lease--step-000000000-0123456789ab--000000.json": json.dumps({"checkpoint": "gone", "expires_at": "x"}),
    }
    for name, body in planted.items():
        (drills / name).write_text(body)
    command = [sys.executable, "-m", "lightning_shardckpt.cli.main", "drill", str(root), "--follow", "--once"]
    command += ["--world-size", "1", "--timeout", "60"]
    runs = [subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert f"{names[2]}: passed" in runs[0].stdout, runs[0].stdout + runs[0].stderr[-3000:]
    # each checkpoint's newest lease is the one read (an older generation goes with it, unread)
    assert "ignored 4 malformed drill lease file(s)" in runs[0].stderr, runs[0].stderr[-3000:]
    for name in list(planted)[:1] + list(planted)[2:]:
        assert name in runs[0].stderr
    assert [path.name for path in drills.glob(".lease--*")] == []
    assert [r["verdict"] for r in _records(root)] == ["passed"]
