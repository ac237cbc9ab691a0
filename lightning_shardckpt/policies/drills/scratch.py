"""A drill's local scratch directory (the record header, each rank's log, rank 0's outcome), and the removal of those
whose starter died without removing its own.

A starter that is SIGKILLed mid-drill (a follower stopped with `kill -9`, a training job killed by the OOM killer or
a node drain) cannot run the `TemporaryDirectory` clean-up, so its directory stays in the temp directory; a host
whose followers are killed now and then would collect them forever. Each name carries the starter's pid, and every
drill first removes the directories of starters that are gone, once they are also a day old: a pid seen as dead
may belong to another pid namespace that shares this temp directory (two containers, one /tmp), so age is what makes
removal safe; a drill lasts at most its timeout_s.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

PREFIX = "shardckpt-drill-"
ORPHAN_AGE_S = 24 * 3600.0


@contextlib.contextmanager
def scratch_directory() -> Iterator[str]:
    """A fresh directory for one drill, removed afterwards; orphans of dead starters are removed first."""
    remove_orphans()
    with tempfile.TemporaryDirectory(prefix=f"{PREFIX}{os.getpid()}-") as path:
        yield path


def remove_orphans(now: float | None = None) -> list[str]:
    """Remove the scratch directories of starters that are gone and that nothing touched for a day; the removed paths.
    Anything else (a live starter, another user's directory, a name without a pid) is left as it is."""
    now = time.time() if now is None else now
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{PREFIX}*-*")):
        pid = os.path.basename(path)[len(PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)) or now - _last_touched(path) < ORPHAN_AGE_S:
            continue
        shutil.rmtree(path, ignore_errors=True)  # refuses a symlink: a link planted under our name leads nowhere
        if not os.path.exists(path):
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _last_touched(path: str) -> float:
    """The newest modification time of the directory and the files in it (rank logs grow during a drill)."""
    try:
        times = [os.stat(path).st_mtime]
        times += [entry.stat().st_mtime for entry in os.scandir(path)]
    except OSError:  # removed meanwhile, or unreadable: treat as just touched, leave it
        return time.time()
    return max(times)
