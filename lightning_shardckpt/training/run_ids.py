"""Which run id a fit uses: the root's owner check and retention go by it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class RunIds:
    """This run's id, kept across fits of one callback.

    Resumed from a checkpoint of this run's roots, or of the run that owns this root (Lightning's
    `last.ckpt` or a top-k path next to it, which the strategy writes with the run's id): that
    checkpoint's run id (a resumed run is the same run, so the root's owner check passes). Resumed from
    another run's checkpoint into a root that run does not own (a warm start, a fine-tune): a new run,
    with a new id; the resume event in the new root names the checkpoint it came from. `save.run_id`
    set by the user wins over all.
    """

    def __init__(self, configured: str | None) -> None:
        self.configured = configured
        self.current: str | None = None

    def choose(
        self,
        resumed: Any,
        continues_run: Callable[[str], bool],
        new_id: Callable[[], str],
        root_owner: Callable[[], str | None] = lambda: None,
    ) -> str:
        """`resumed`: the LoadResult of the resume (None: a fresh fit); `continues_run(path)`: the
        checkpoint is in one of this run's roots; `new_id()`: one id for every rank (a broadcast);
        `root_owner()`: the run id that owns this root, every rank alike (a broadcast, called on every
        rank or on none)."""
        resumed_id = (resumed.manifest.get("run_id") if resumed is not None else None) or None
        if self.configured:
            self.current = self.configured
        elif resumed_id and (continues_run(resumed.path) or root_owner() == resumed_id):
            self.current = resumed_id
        elif self.current is None:
            self.current = new_id()
        return self.current
