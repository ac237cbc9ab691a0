"""Decisions plug-ins take part in, one small Protocol each, and the named rule that combines their answers.

A plug-in's events (policies/plugin.py: `Plugin`) tell it what happened; a decision asks it something the run
then acts on. A plug-in answers a decision by having its one method; `PluginList` asks every plug-in that has it
and combines the answers by the rule named here, as Orbax combines `should_save` / `should_preserve` policies:

| decision            | method            | asked                                   | rule                         |
|---------------------|-------------------|-----------------------------------------|------------------------------|
| shape the plan      | `shape_plan`      | set-up, before the strategy gets it     | each in turn (`in_order`)    |
| carry preemption    | `sync`            | step end, every rank (a collective)     | any rank asked (`any_true`)  |
| apply run control   | `apply_control`   | step end, every rank, after `sync`      | each (`each`)                |
| scale save intervals| `interval_factor` | step end                                | product (`product`)          |
| stop training       | `stop_reason`     | step end, after `sync`                  | first reason (`first`)       |
| spare from deletion | `spare`           | retention, saver thread                 | union (`union`)              |
| route the save      | `saver_override`  | each save                               | first saver (`first`)        |
| add manifest extras | `save_extra`      | each save, every rank                   | merged (`merged`)            |
| claim a checkpoint  | `owns`            | resume: is it this run's                | any (`any_true`)             |
| drill one now       | `drill_now`       | a health rule's mitigation              | each (`each`)                |
| count               | `counters`        | with every logged record                | merged (`merged`)            |

Every rule is written once, here; `PluginList` only names which rule a decision uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ..engine.save.saver import CheckpointSaver
    from .context import PluginContext
    from .plan import CheckpointPlan, Placement

T = TypeVar("T")


@runtime_checkable
class PlanShaper(Protocol):
    def shape_plan(self, plan: CheckpointPlan, placement: Placement) -> CheckpointPlan:
        """Set-up, before the door uses the plan: return it changed (tiers: this node's fast root) or as is."""
        ...


@runtime_checkable
class ControlExchange(Protocol):
    def sync(self, preempted: bool, context: PluginContext) -> bool | None:
        """Step end, every rank: run this plug-in's own all-reduce carrying the local preemption flag; return
        the agreed flag (every rank alike), or None when it ran none (it abstains). With no exchanger, the door
        agrees on the flag itself."""
        ...


@runtime_checkable
class ControlApplier(Protocol):
    def apply_control(self, saver: CheckpointSaver | None, when_busy: str) -> None:
        """Step end, every rank, after `sync`: apply control state every rank now shares to the saver."""
        ...


@runtime_checkable
class IntervalScaler(Protocol):
    def interval_factor(self) -> float:
        """Multiplies the save intervals (steps and minutes)."""
        ...


@runtime_checkable
class StopDecider(Protocol):
    def stop_reason(self) -> str | None:
        """Why training must stop now (every rank answers alike after `sync`); None: go on."""
        ...


@runtime_checkable
class RetentionGuard(Protocol):
    def spare(self, keep_last: int | None) -> set[str]:
        """Checkpoint directory names retention must keep although outside its window (saver thread)."""
        ...


@runtime_checkable
class SaverRouter(Protocol):
    def saver_override(self) -> CheckpointSaver | None:
        """A saver saves go to instead of the root's (tiers' degraded mode); None: the root's."""
        ...


@runtime_checkable
class ManifestExtras(Protocol):
    def save_extra(self, module: torch.nn.Module, rank: int) -> dict[str, Any] | None:
        """Every rank, at a save: entries for the manifest's `extra` (rank 0's are written)."""
        ...


@runtime_checkable
class RunMembership(Protocol):
    def owns(self, checkpoint_path: str) -> bool:
        """A checkpoint of a root this plug-in writes too: a resume from it continues this run."""
        ...


@runtime_checkable
class DrillTarget(Protocol):
    def drill_now(self, checkpoint_path: str) -> None:
        """Drill this checkpoint now, whatever the schedule."""
        ...


@runtime_checkable
class CounterSource(Protocol):
    def counters(self) -> dict[str, int]:
        """Counters logged with every checkpoint record."""
        ...


# every decision, in the table's order: the plug-in check (policies/plugin_check.py) reads their methods from here
DECISIONS: tuple[type, ...] = (
    PlanShaper,
    ControlExchange,
    ControlApplier,
    IntervalScaler,
    StopDecider,
    RetentionGuard,
    SaverRouter,
    ManifestExtras,
    RunMembership,
    DrillTarget,
    CounterSource,
)


# --- the rules ---


def in_order(answers: Iterable[Callable[[T], T]], start: T) -> T:
    """Each answer transforms the previous one, in the plug-ins' order."""
    value = start
    for answer in answers:
        value = answer(value)
    return value


def any_true(answers: Iterable[bool | None]) -> bool | None:
    """True if any answered true; None when nobody answered (None answers abstain: the caller decides alone)."""
    verdict = None
    for answer in answers:
        if answer is not None:
            verdict = bool(answer) or bool(verdict)
    return verdict


def each(answers: Iterable[Callable[[], None]]) -> None:
    """Every one is asked, in order, for its effect; nothing is combined."""
    for answer in answers:
        answer()


def product(answers: Iterable[float]) -> float:
    return math.prod(answers, start=1.0)


def first(answers: Iterable[T | None]) -> T | None:
    """The first answer that is not None (or empty), in the plug-ins' order."""
    return next((answer for answer in answers if answer), None)


def union(answers: Iterable[set[str]]) -> set[str]:
    return set().union(*answers)


def merged(answers: Iterable[dict[str, Any] | None]) -> dict[str, Any]:
    """Later plug-ins' keys win over earlier ones' (no plug-in writes another's keys)."""
    out: dict[str, Any] = {}
    for answer in answers:
        out.update(answer or {})
    return out
