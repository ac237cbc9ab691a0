"""The steps around the one resume, written once for every front door; a door only applies the loaded state.

training/resume.py picks and loads a checkpoint. What every door does around it is here, in one order:

1. `load_resumed` (every rank): saves of the state it loads into that no reader could load are refused (before
   training: training/preflight.py), fence (the load overwrites parameters and optimizer state in place, which an
   overlapped staging copy may still be reading), wait (the load's collectives run on the checkpoint group, which
   a saver's thread must not be using meanwhile), pick and load (one call to training/resume.py, the one place a
   reference is interpreted), the not-restored report (rank 0, once, never silently). Returns a `Resumed`.
2. the door applies the state (its own sections, sampler, RNG, Lightning's dict): the one part that differs.
3. `announce_resume` (every rank, once the state is applied): run-id continuation (a resume of this run's
   checkpoint continues its id; the save loop's `continue_from`), then on rank 0 the `resume` event (under
   ROOT/events/ unless `save.write_events` is off), the resume line and the metrics. Once per resume: a door that
   reaches it again for the same load (the Trainer's next fit) repeats none of it.

The Checkpointer and Fabric run 1-3 in one call; the Trainer's are split by Lightning: its strategy loads while
Lightning restores (1), Lightning applies the dict (2), and the callback announces at train start (3), when this
run's identity can be compared with the checkpoint's (the event's `differences`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..engine.collectives import rank_and_world
from ..engine.load.loader import LoadResult
from ..errors import IncompatibleCheckpoint
from ..policies.plan import CheckpointPlan
from ..policies.plugin import Reporter
from . import console
from .door_targets import DoorTarget, Layout, warn_not_restored
from .preflight import refuse_unloadable_saves
from .resume import resume, resume_event, resume_line, signature_metrics, write_resume_event


class ResumeHost(Protocol):
    """What the sequence needs of a door's savers (training/savers.py SaverHost)."""

    def fence(self) -> float: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def checkpoint_group(self) -> Any: ...


class RunContinuation(Protocol):
    """What the sequence needs of a door's save loop (training/save_loop.py SaveLoop)."""

    reporter: Reporter

    def continue_from(self, resumed: LoadResult) -> str: ...


@dataclass
class Resumed:
    """One resume: what was loaded, into what, what it did not give back, and (rank 0, once announced) its event."""

    loaded: LoadResult
    target: DoorTarget
    not_restored: tuple[str, ...]
    event: dict[str, Any] | None = None
    announced: bool = False

    @property
    def layout(self) -> Layout:
        assert self.target.layout is not None  # the loader shaped the target for the checkpoint it loaded
        return self.target.layout


def load_resumed(
    plan: CheckpointPlan,
    host: ResumeHost,
    target: DoorTarget,
    reference: str | int,
    *,
    strict: bool,
    rank: int,
    lacking: Callable[[Layout], list[str]] = Layout.not_restored,
    spell: Callable[[str], str] = str,
) -> Resumed | None:
    """Steps 1 of the module docstring, every rank. None: nothing to resume from (`latest` of an empty root).
    `lacking(layout)`: what the door asked for and the checkpoint did not give back, in its user's words (`spell`
    names one entry)."""
    # a resume comes before the first training step: refuse saves no reader could load before training, not at the
    # first save (the state as the door will save it: its entries by path, live tensors)
    refuse_unloadable_saves(
        plan.save, rank_and_world()[1], lambda: {".".join(path): value for path, value in target.entries.items()}
    )
    host.fence()  # the load overwrites what a staging copy may still be reading
    host.wait()  # one thread at a time on the checkpoint group: a save in flight commits first
    try:
        loaded = resume(plan, target, reference, host.checkpoint_group(), strict=strict)  # the pick and the load
    except IncompatibleCheckpoint as err:
        raise target.explain(err) from err
    if loaded is None:
        return None
    resumed = Resumed(loaded=loaded, target=target, not_restored=())
    resumed.not_restored = tuple(lacking(resumed.layout))
    if rank == 0:
        warn_not_restored(loaded.path, resumed.layout, list(resumed.not_restored), spell=spell)
    return resumed


def announce_resume(
    resumed: Resumed,
    *,
    plan: CheckpointPlan,
    loop: RunContinuation | None,
    rank: int,
    world_size: int,
    identity: dict[str, Any] | None = None,
    metrics: Callable[[LoadResult], dict[str, float]] = signature_metrics,
) -> dict[str, Any] | None:
    """Step 3 of the module docstring, every rank; returns rank 0's resume event (None elsewhere), which the door
    hands the plug-ins at train start. `loop`: the door's save loop (None: a load before the run's root is known,
    which has no run to continue, no events folder and no loggers). `identity`: the door's comparison of the
    checkpoint's identity with this run's, carried in the event. `metrics(loaded)`: what the loggers get."""
    if loop is not None:
        loop.continue_from(resumed.loaded)
    if resumed.announced:
        return resumed.event
    resumed.announced = True
    if rank != 0:
        return None
    loaded = resumed.loaded
    resumed.event = resume_event(loaded, world_size, **(identity or {}))
    if loop is not None and plan.save.write_events:
        write_resume_event(plan.location, resumed.event)
    console.say(resume_line(loaded, world_size))
    values = metrics(loaded)
    if loop is not None and values:
        loop.reporter.log_metrics(values)
    return resumed.event
