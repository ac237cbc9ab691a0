"""The drill follower: a long-running process outside training that drills a root's new checkpoints.

`shardckpt drill --follow ROOT` (and `python recipes/drill.py follow=true`) runs one, on a spare CPU node,
as a cron/Kubernetes job, or on the training node at low priority. Every `interval_s` it lists the root and
its drill records; when `every_n_checkpoints` commits have landed since the newest checkpoint that has a
drill record or a live lease, it drills the newest of them through `run_drill` (warm workers: one pool kept
for the follower's life), which files the record the training run and `shardckpt last-good` read.

It keeps no state of its own: what it has done is what the records say, so a restarted follower picks up
where they end. Leases (policies/drills/leases.py) keep two followers on one root, or a follower and its
restarted self, from drilling one checkpoint at once: a drill runs only under a lease claimed with
create-if-absent, and only when the checkpoint still has no record once the lease is held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ...engine import catalog
from ...engine.format import drill_records
from ...engine.format.entry import CheckpointEntry
from ...engine.format.names import join
from ...engine.storage import fsio
from ...engine.validate import require_number
from ...errors import ShardCkptError
from .leases import DrillLeases
from .pool import REPLY_GRACE_S, STOP_GRACE_S
from .runner import DrillOptions, run_drill, warm_pool

log = logging.getLogger(__name__)


class DrillFollower:
    """Drill the root's newly committed checkpoints, one at a time, until stopped."""

    def __init__(
        self,
        root: str,
        options: DrillOptions | None = None,
        *,
        every_n_checkpoints: int = 1,
        interval_s: float = 30.0,
        on_record: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        require_number("follow.every_n_checkpoints", every_n_checkpoints, integer=True, at_least=1)
        require_number("follow.interval_s", interval_s, above=0, hint="seconds between looks at the root")
        self.options = options or DrillOptions()
        self.location = fsio.resolve(root, self.options.storage_options)
        self.every_n_checkpoints, self.interval_s = every_n_checkpoints, interval_s
        # a lease outlives the longest drill: a live holder is never taken over
        ttl_s = self.options.timeout_s + 2 * STOP_GRACE_S + REPLY_GRACE_S + 60.0
        self.leases = DrillLeases(self.location, ttl_s=ttl_s)
        self._on_record = on_record or (lambda record: None)
        self._pool = warm_pool(self.options)
        self.drills = 0
        self.newest: str | None = None  # the newest committed checkpoint the last look saw

    @property
    def malformed_leases(self) -> int:
        """Lease files seen that no follower wrote (each logged once): ignored, taken over as stale."""
        return len(self.leases.malformed)

    def warm_up(self) -> float:
        """Start the warm workers now (imports torch and the engine once); the seconds that took."""
        return self._pool.ensure_started()

    def run(self, *, once: bool = False, exit_when_idle_s: float | None = None) -> int:
        """Follow until interrupted; `once`: drill what is due now and return; `exit_when_idle_s`: return once
        nothing was committed or drilled for that long. Returns the number of drills run."""
        log.info("following %s: a drill every %d checkpoint(s)", self.location.url, self.every_n_checkpoints)
        idle_since, newest = time.monotonic(), self.newest
        try:
            self.warm_up()  # before the first lease: a lease's time is the drill's
            while True:
                try:
                    drilled = self.step()
                except (ShardCkptError, OSError) as err:  # storage down or a root in flux: look again later
                    log.warning("drill follower: %s: %s; retrying in %g s", type(err).__name__, err, self.interval_s)
                    drilled = None
                if drilled is not None or self.newest != newest:
                    idle_since, newest = time.monotonic(), self.newest
                if drilled is not None:
                    continue  # more may be due already
                if once or (exit_when_idle_s is not None and time.monotonic() - idle_since >= exit_when_idle_s):
                    return self.drills
                time.sleep(self.interval_s)
        finally:
            self._pool.close()

    def step(self) -> dict[str, Any] | None:
        """One look at the root: drill the checkpoint that is due, if any; its record, or None."""
        entries = [entry for entry in catalog.list_checkpoints(self.location) if entry.committed]
        self.newest = entries[-1].name if entries else None
        records = drill_records.list_record_names(self.location)
        held = self.leases.held()
        # settled: drilled, gone, or older than the newest drilled one (a killed follower's, never due again)
        drilled = [index for index, entry in enumerate(entries) if entry.name in records]
        settled = {entry.name for entry in entries[: drilled[-1] + 1]} if drilled else set()
        self.leases.remove_stale(settled | (set(held) - {entry.name for entry in entries}))
        candidate = self.due(entries, records, held)
        if candidate is None:
            return None
        lease = self.leases.claim(candidate.name, held.get(candidate.name, []))
        if lease is None:
            return None  # another follower took it between the listing and the claim
        try:
            if drill_records.list_record_names(self.location).get(candidate.name):
                return None  # drilled by another follower that released its lease before ours
            record = run_drill(
                join(self.location.url, candidate.name),
                self.options,
                pool=self._pool,
                record_fields={"drilled_by": f"follower {self.leases.owner}"},
            )
        finally:
            self.leases.release(lease)
        self.drills += 1
        self._on_record(record)
        return record

    def due(
        self, entries: list[CheckpointEntry], records: dict[str, list[Any]], held: dict[str, list[int]]
    ) -> CheckpointEntry | None:
        """The newest committed checkpoint once every_n_checkpoints have landed since the newest one that has a
        record or is being drilled (a live lease); None when nothing is due."""
        covered = -1
        for index, entry in enumerate(entries):
            leased = entry.name in held and entry.name not in records
            if entry.name in records or (leased and self.leases.is_live(entry.name, held[entry.name])):
                covered = index
        waiting = entries[covered + 1 :]
        return waiting[-1] if len(waiting) >= self.every_n_checkpoints else None
