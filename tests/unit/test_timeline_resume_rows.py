"""`shardckpt timeline` shows a resume as a resume (from which checkpoint, world size before -> after),
and failures as failures with their cause (issue 9, item 11).

The resume events here carry exactly what ShardedCheckpoint writes (lightning/trainer/callback.py); a real
Lightning resume on 2 -> 3 ranks is tests/distributed/test_timeline_resume.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine import metrics
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.ops import timeline
from tests.helpers.faults import FailOnce


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Step 2 commits, step 4 fails mid-shard; then a run resumes from step 2 twice: an event written
    before events carried world sizes, and one that carries them; and a drill event about step 2."""
    path = str(tmp_path_factory.mktemp("timeline") / "run")
    saver = CheckpointSaver(path, SaveConfig(async_save=False), fault_hook=FailOnce("mid_shard", times=1))
    try:
        assert (
            not saver.save({"w": torch.ones(3), "b": torch.zeros(2)}, 4).result(timeout=60).committed
        )  # the injected failure
        committed = saver.save({"w": torch.ones(3), "b": torch.zeros(2)}, 2).result(timeout=60)
        assert committed.committed, committed.error
    finally:
        saver.close()
    location = fsio.resolve(path)
    source = committed.path
    name = source.rstrip("/").rsplit("/", 1)[-1]
    legacy = {"event": "resume", "from": source, "step": 2, "seconds": 0.5, "differences": {}, "unrecorded": []}
    metrics.write_json_event(location, "resume-step-000000002", legacy)
    current = {
        **legacy,
        "seconds": 0.75,
        "from_id": name.rsplit("-", 1)[-1],
        "world_size": 3,
        "from_world_size": 2,
        "differences": {"run": ["world_size 2 -> 3"]},
    }
    metrics.write_json_event(location, "resume-step-000000002", current)
    metrics.write_json_event(
        location,
        "drill-step-000000002",
        {"event": "drill", "checkpoint_id": name.rsplit("-", 1)[-1], "step": 2, "verdict": "passed"},
    )
    return path, name


def test_timeline_rows_a_resume_as_resumed_from_its_checkpoint_with_world_sizes(root):
    path, name = root
    rows = timeline.timeline(fsio.resolve(path))["checkpoints"]
    resumes = [row for row in rows if row["state"] == timeline.RESUMED]
    assert len(resumes) == 2
    legacy, current = resumes
    # an event without world sizes: "before" comes from the checkpoint's own topology, "after" is unknown
    assert legacy["resume"]["from"] == name and legacy["resume"]["world_size_before"] == 1
    assert legacy["resume"]["world_size_after"] is None
    assert current["resume"]["from"] == name
    assert (current["resume"]["world_size_before"], current["resume"]["world_size_after"]) == (2, 3)
    assert current["resume"]["identity_differences"] == ["run"]
    assert all(row["cause"] is None and row["step"] == 2 for row in resumes)
    # the drill event about step 2 is not an attempt: step 2 stays one committed row with no cause
    committed = [row for row in rows if row["step"] == 2 and row["state"] == "committed"]
    assert len(committed) == 1 and committed[0]["cause"] is None
    assert not [row for row in rows if row["state"] == "failed" and row["step"] == 2]


def test_timeline_prints_resumes_as_resumes_and_failures_with_their_cause(root, run_cli):
    path, name = root
    code, out, _ = run_cli("timeline", path)
    assert code == 0
    table = [
        line.split() for line in out.splitlines()[1:] if line[:1] != "*" and line.split() and line.split()[0].isdigit()
    ]
    assert [row[0] for row in table if "failed" in row] == ["4"], out  # the real failure, and nothing else
    assert sum("resumed" in row for row in table) == 2
    assert any("2->3" in row for row in table if "resumed" in row), out
    lines = out.splitlines()
    assert f"step 2: resumed from {name} on 2 -> 3 ranks in 0.75s; identity differs: run" in lines
    assert f"step 2: resumed from {name} on 1 -> ? ranks in 0.50s" in lines
    failure = next(line for line in lines if line.startswith("step 4 "))
    assert "failed" in failure and "injected storage failure at mid_shard" in failure
    assert " - failed" not in out and "step 2 (no id): failed" not in out


def test_timeline_json_carries_the_resume_record(root, run_cli):
    path, name = root
    code, out, _ = run_cli("timeline", "--json", path)
    assert code == 0
    rows = json.loads(out)["checkpoints"]
    resume = [row["resume"] for row in rows if row["state"] == "resumed"][-1]
    assert resume["from"] == name and resume["world_size_before"] == 2 and resume["world_size_after"] == 3
