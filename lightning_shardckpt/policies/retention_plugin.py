"""Retention as a plug-in: after each commit, delete what fell out of the window (rank 0, saver thread), and
tell the run's reporter what it deleted (training thread), so a W&B artifact never points at it unmarked."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..engine import metrics
from ..engine.format.names import parse_dirname
from ..engine.metrics import CheckpointRecord
from . import retention
from .plugin import Plugin, PluginContext

log = logging.getLogger(__name__)


class RetentionPlugin(Plugin):
    """Keeps `keep_last` (plus every `keep_every_n_steps`-th, the newest drilled, and what plug-ins spare).

    Runs on the saver's background thread, not the training thread: a listing and deletes cost storage
    round trips (seconds on S3), and an error there (a manifest another writer just deleted, a transient
    listing error) must never reach the training loop and fail the fit.
    """

    def __init__(self, keep_last: int | None, keep_every_n_steps: int | None, keep_last_drilled: int) -> None:
        self.keep_last = keep_last
        self.keep_every_n_steps = keep_every_n_steps
        self.keep_last_drilled = keep_last_drilled
        self._attached: weakref.WeakSet = weakref.WeakSet()  # savers whose commits run retention: once each
        self._lock = threading.Lock()
        self._deleted: list[dict[str, Any]] = []  # deleted on the saver thread, not yet reported (drain)
        self._last_pass: tuple[Any, Any, str | None, Callable] | None = None  # rank 0: what fit end's pass needs
        self._spared_in_flight = False  # the last pass kept something only because a plug-in still needed it

    def start(self, context: PluginContext) -> None:
        saver = context.saver
        if self.keep_last is None or not context.is_global_zero or saver is None or saver in self._attached:
            return  # saver None: a door that starts plug-ins before its saver exists saves nothing to retain
        self._attached.add(saver)
        location, run_id, spare = context.location, context.run_id, context.spare
        saver.add_listener(lambda record: self.after_commit(saver, record, location, run_id, spare))
        self._last_pass = (saver, location, run_id, spare)

    def flush(self) -> None:
        """Fit end, after the plug-ins before it finished (tiers: the last copies reached the durable tier): one
        more pass, since what a commit's pass spared because it was still in flight (a copy, a drill) may be
        free to go now, and no later commit would let it go. Only then: retention's storage round trips stay off
        the training thread otherwise."""
        if self._last_pass is None or not self._spared_in_flight:
            return
        saver, location, run_id, spare = self._last_pass
        self._apply(saver, location, run_id, spare, just_committed=None, step=None)

    def after_commit(
        self, saver: Any, record: CheckpointRecord, location: Any, run_id: str | None, spare: Callable
    ) -> None:
        """After a commit: delete what fell out of the window. Errors are logged and counted, never raised."""
        if record.outcome != metrics.COMMITTED:
            return
        just_committed = record.path.rstrip("/").rsplit("/", 1)[-1] if record.path else None
        self._apply(saver, location, run_id, spare, just_committed=just_committed, step=record.step)

    def _apply(
        self, saver: Any, location: Any, run_id: str | None, spare: Callable, *, just_committed: str | None, step
    ) -> None:
        keep_last = self.keep_last
        if keep_last is None:  # never attached to a saver then (start): nothing falls out of a window
            return
        try:
            spared = frozenset(spare(keep_last))
            self._spared_in_flight = bool(spared)
            deleted = retention.apply(
                location,
                keep_last,
                self.keep_every_n_steps,
                run_id=run_id,
                just_committed=just_committed,
                keep_last_drilled=self.keep_last_drilled,
                spare=spared,
            )
        except Exception:  # the next commit's pass deletes what this one could not
            saver.counters.note(metrics.RETENTION_ERRORS)
            log.warning(
                "retention %s failed; the next commit retries it",
                "at fit end" if step is None else f"after the checkpoint of step {step}",
                exc_info=True,
            )
            return
        self._note_deleted(location, deleted)

    def drain(self, context: PluginContext) -> None:
        """Rank 0, training thread: report the deletions since the last drain (W&B marks their artifacts)."""
        with self._lock:
            deleted, self._deleted = self._deleted, []
        if deleted:
            context.reporter.checkpoints_deleted(deleted)

    def _note_deleted(self, location: Any, names: list[str]) -> None:
        now = time.time()
        found = [(name, parse_dirname(name)) for name in names]
        with self._lock:
            self._deleted += [
                {
                    "checkpoint": name,
                    "step": parsed.step if parsed else None,
                    "uri": f"{location.url.rstrip('/')}/{name}",
                    "deleted_at": now,
                }
                for name, parsed in found
            ]
