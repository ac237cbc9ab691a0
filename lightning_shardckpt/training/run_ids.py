"""Which run id a fit uses: the root's owner check and retention go by it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..engine import ownership
from ..engine.collectives import rank_and_world
from .plan import CheckpointPlan


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

    def for_fit(self, resumed: Any, plan: CheckpointPlan, plugins: Any, broadcast: Callable[[Any], Any]) -> str:
        """`choose` for a fit of ShardedCheckpoint: its plan's root and the plug-ins' (tiers) decide which
        checkpoints are this run's; `broadcast(value)` gives every rank rank 0's value."""
        return self.choose(
            resumed,
            lambda path: plan.owns(path) or plugins.owns(path),
            lambda: broadcast(ownership.new_run_id()),
            lambda: broadcast(_owner_run_id(plan) if rank_and_world()[0] == 0 else None),
        )


def _owner_run_id(plan: CheckpointPlan) -> str | None:
    """The run id recorded in the root's owner marker; None without one (an unreadable marker: the
    saver's owner check reports it, with its fix, when the root's saver is created)."""
    try:
        owner = ownership.read_owner(plan.location)
    except Exception:  # noqa: BLE001 - a question asked before the owner check, which raises the real error
        return None
    return owner.get("run_id") if owner else None
