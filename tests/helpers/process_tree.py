"""A process's descendants, read from /proc, and a wait until every one of them has stopped running.

A process killed with SIGKILL is reaped by its parent at once, while what it started dies after it (Linux
PR_SET_PDEATHSIG: each child is signalled as its parent exits, one generation at a time). A test that then looks at
what those children write must first wait for them, or a grandchild's last write can land after the look.
"""

from __future__ import annotations

import os
import time


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...), read now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    """Whether `pid` still runs code: false once it is gone or a zombie (a zombie writes nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_stopped(pids: list[int], timeout_s: float) -> None:
    """Return once none of `pids` runs; AssertionError naming those still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (left := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes {left} still run {timeout_s:.0f} s after their ancestor was killed"
