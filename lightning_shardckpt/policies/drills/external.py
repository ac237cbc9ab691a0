"""Drills `external`: the training run drills nothing itself and watches what a drill follower files.

With `drill.mode=external` a follower (`shardckpt drill --follow ROOT`, policies/drills/follower.py) drills
the run's checkpoints in processes of its own, so the run spends nothing on them. `FollowerWatch` is the
run's side: a daemon thread of rank 0 that lists ROOT/drills/ every `poll_s` (one listing; a record's small
body read once) and hands each new record of a checkpoint this run committed to `on_record` with the drill
lag, as if its own drill had finished: the same metrics, events and health rules. After commits with no new
record it hands `on_lag` the lag alone, so a rule sees a follower that fell behind or stopped (no record
would ever say so).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ...engine.format import drill_records
from ...engine.format.drill_records import PASSED
from ...engine.storage.fsio import Location

log = logging.getLogger(__name__)


class FollowerWatch:
    """The training run's view of an external drill follower: new records and the drill lag."""

    def __init__(
        self,
        location: Location,
        on_record: Callable[[dict[str, Any], dict[str, float]], None],
        on_lag: Callable[[dict[str, float]], None],
        *,
        poll_s: float,
    ) -> None:
        self._location, self._on_record, self._on_lag, self.poll_s = location, on_record, on_lag, poll_s
        self._commits: list[tuple[str, float]] = []  # this run's commits: directory name, wall time
        self._reported_commits = 0  # commits the last lag report covered
        self._seen: set[str] = set()  # record file names already handed on
        self._drilled: set[str] = set()  # checkpoints whose newest record passed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def committed(self, name: str) -> None:
        """A checkpoint of this run committed (training thread)."""
        with self._lock:
            self._commits.append((name, time.time()))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shardckpt-drill-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 30.0)

    def lag(self) -> dict[str, float]:
        """Commits since the newest drilled one of this run, and seconds since the first of them committed."""
        with self._lock:
            commits = list(self._commits)
        newest = max((index for index, (name, _) in enumerate(commits) if name in self._drilled), default=-1)
        waiting = commits[newest + 1 :]
        return {
            "lag_checkpoints": float(len(waiting)),
            "lag_s": time.time() - waiting[0][1] if waiting else 0.0,
        }

    def poll(self) -> None:
        """One look at ROOT/drills/: hand on the new records of this run's checkpoints, else the lag."""
        with self._lock:
            ours = {name for name, _ in self._commits}
            commits = len(self._commits)
        listing = drill_records.list_record_names(self._location)
        new = []
        for checkpoint, names in listing.items():
            if checkpoint not in ours:
                continue
            if names[-1].verdict == PASSED:
                self._drilled.add(checkpoint)
            new += [name for name in names if name.filename not in self._seen]
        for name in sorted(new, key=lambda record: record.drill_id):
            self._seen.add(name.filename)
            body = drill_records.read_record(self._location, name) or {
                "checkpoint": name.checkpoint,
                "drill_id": name.drill_id,
                "verdict": name.verdict,
            }
            self._on_record(body, self.lag())
        if not new and commits > self._reported_commits:
            self._on_lag(self.lag())
        self._reported_commits = commits

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as err:  # storage down for a moment: the next look may see it
                log.warning("could not read the drill follower's records: %s: %s", type(err).__name__, err)
        try:
            self.poll()  # what the follower filed while training ended
        except Exception:
            log.debug("last look at the drill records failed", exc_info=True)
