"""Which run id a fit uses: the root's owner check and retention go by it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class RunIds:
    """This run's id, kept across fits of one callback.

    Resumed from a checkpoint of this run's roots: that checkpoint's run id (a resumed run is the same
    run, so the root's owner check passes). Resumed from another root (a warm start, a fine-tune): a
    new run, with a new id. `save.run_id` set by the user wins over both.
    """

    def __init__(self, configured: str | None) -> None:
        self.configured = configured
        self.current: str | None = None

    def choose(self, resumed: Any, continues_run: Callable[[str], bool], new_id: Callable[[], str]) -> str:
        """`resumed`: the LoadResult of the resume (None: a fresh fit); `continues_run(path)`: the
        checkpoint is in one of this run's roots; `new_id()`: one id for every rank (a broadcast)."""
        resumed_id = (resumed.manifest.get("run_id") if resumed is not None else None) or None
        if self.configured:
            self.current = self.configured
        elif resumed_id and continues_run(resumed.path):
            self.current = resumed_id
        elif self.current is None:
            self.current = new_id()
        return self.current
