"""A drill process whose parent died before it asked to die with its parent runs nothing (policies/drills/pool.py).

PR_SET_PDEATHSIG only sees a parent's death after the call: a pool killed (its follower SIGKILLed mid-drill) between
forking a rank and the rank's call ran on as an orphan, a whole drill of writes into a scratch directory no living
process owned (seen as tests/e2e/test_drill_follower.py's orphaned scratch directory made fresh again after it
was set back a day). A real fork, a parent that really exits first.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

# The parent forks the would-be rank and exits at once; the rank waits until it has been re-parented, then asks
# to die with the parent it was forked by, then (were it still alive) writes the mark an orphaned drill would.
ORPHAN = """
import os, sys, time
from lightning_shardckpt.policies.drills.pool import die_with_parent

parent = os.getpid()
child = os.fork()
if child == 0:
    while os.getppid() == parent:
        time.sleep(0.005)
    die_with_parent(parent)
    with open(sys.argv[1], "w") as mark:
        mark.write("an orphan ran on")
    os._exit(0)
print(child, flush=True)
os._exit(0)
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has run its last line
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rank_whose_pool_died_before_it_asked_to_die_with_it_runs_nothing(tmp_path: Path) -> None:
    mark = tmp_path / "orphan-wrote"
    started = subprocess.run(
        [sys.executable, "-c", ORPHAN, str(mark)], capture_output=True, text=True, timeout=30, check=True
    )
    orphan = int(started.stdout)
    deadline = time.monotonic() + 20
    while not gone(orphan) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gone(orphan), f"the orphan {orphan} still runs 20 s after its parent exited"
    assert not mark.exists(), "a process whose parent died before it asked to die with it ran on as an orphan"


def test_a_rank_whose_pool_lives_runs_on(tmp_path: Path) -> None:
    # the other side: with its parent alive, asking to die with it changes nothing (the drill runs)
    mark = tmp_path / "ran"
    code = f"""
import os
from lightning_shardckpt.policies.drills.pool import die_with_parent
die_with_parent(os.getppid())
open({str(mark)!r}, "w").write("ran")
"""
    subprocess.run([sys.executable, "-c", code], timeout=30, check=True)
    assert mark.read_text() == "ran"
