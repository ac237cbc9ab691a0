"""A drill's scratch directory carries its starter's pid, and a later drill removes the ones whose starter was killed
(it could not clean up) once they are a day old; a live starter's, a fresh one's and a stranger's stay."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from lightning_shardckpt.policies.drills import scratch

DAY_S = 24 * 3600


@pytest.fixture
def temp_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what tempfile.gettempdir() answers
    return tmp_path


def killed_pid() -> int:
    """The pid of a real process that was SIGKILLed (and reaped): a starter that could not clean up."""
    process = subprocess.Popen(["sleep", "60"])
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    return process.pid


def left_scratch(temp_dir: Path, pid: int | str, *, age_s: float) -> Path:
    path = temp_dir / f"{scratch.PREFIX}{pid}-x1y2z3"
    path.mkdir()
    (path / "rank0.log").write_text("loading\n")
    then = time.time() - age_s
    for entry in (path / "rank0.log", path):
        os.utime(entry, (then, then))
    return path


def test_a_drill_scratch_directory_names_its_starter_and_is_removed_after_the_drill(temp_dir):
    with scratch.scratch_directory() as path:
        assert Path(path).parent == temp_dir and Path(path).name.startswith(f"{scratch.PREFIX}{os.getpid()}-")
    assert not Path(path).exists()


def test_a_killed_starters_day_old_scratch_is_removed_and_everything_else_stays(temp_dir):
    dead = killed_pid()
    orphan = left_scratch(temp_dir, dead, age_s=2 * DAY_S)
    recent = left_scratch(temp_dir, killed_pid(), age_s=60)  # its starter may be of another pid namespace: wait
    live = left_scratch(temp_dir, os.getpid(), age_s=2 * DAY_S)  # a drill of a live starter, however old
    stranger = left_scratch(temp_dir, "notapid", age_s=2 * DAY_S)
    with scratch.scratch_directory():
        pass
    assert not orphan.exists()
    assert recent.exists() and live.exists() and stranger.exists()


def test_a_log_written_within_the_day_keeps_an_old_directory(temp_dir):
    kept = left_scratch(temp_dir, killed_pid(), age_s=2 * DAY_S)
    (kept / "rank0.log").write_text("still loading\n")  # the newest file counts, not the directory's own time
    assert scratch.remove_orphans() == [] and kept.exists()


def test_a_link_planted_under_a_scratch_name_is_never_followed_into_what_it_points_at(temp_dir, tmp_path_factory):
    precious = tmp_path_factory.mktemp("precious")
    (precious / "weights.bin").write_bytes(b"keep me")
    planted = temp_dir / f"{scratch.PREFIX}{killed_pid()}-planted"
    planted.symlink_to(precious, target_is_directory=True)
    then = time.time() - 2 * DAY_S
    os.utime(precious / "weights.bin", (then, then))
    os.utime(precious, (then, then))  # through the link: the name looks like a day-old orphan of a dead starter
    scratch.remove_orphans()
    assert (precious / "weights.bin").read_bytes() == b"keep me"
