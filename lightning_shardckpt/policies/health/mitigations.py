"""What a health rule does when it fires and when it resolves: a small registry of real actions.

A mitigation is `fn(context, transition) -> str | None`, called on rank 0 for both transitions
(`transition.kind` is "fired" or "resolved"); it returns what it changed, which is logged, recorded in
the health event and sent with the alert every transition raises (W&B `run.alert` when the Trainer logs
to W&B; a log line and an event always). It never touches training objects directly: it edits the `MitigationContext`
(the run's desired control state and a queue of actions), which the training thread applies on every
rank at the next batch end, so all ranks change their save schedule at the same step.

The built-ins below only edit that state (microseconds) and run where the rule was evaluated. A user's
mitigation may take seconds (paging someone): it runs on a `MitigationWorker` thread, one at a time in
order, so neither the saver's thread nor the training thread ever waits on it; control it edits still
reaches every rank through the next batch end's exchange.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError
from .evaluate import FIRED, Transition

log = logging.getLogger(__name__)

DRILL = "drill"  # a kind of queued action
DEFAULT_FACTOR, DEFAULT_MAX_FACTOR = 2.0, 8.0


@dataclass
class HealthControl:
    """The run's schedule as the firing rules want it; rank 0's copy is what every rank applies."""

    factors: dict[str, float] = field(default_factory=dict)  # rule -> save-interval multiplier while it fires
    max_factor: float = DEFAULT_MAX_FACTOR
    # rule -> the series (ranks, causes, runs) it fires on: a mitigation holds while any of them fires, so
    # one rank recovering does not lift what another rank's slowness still needs
    holders: dict[str, list[str]] = field(default_factory=dict)
    skip_rules: set[str] = field(default_factory=set)  # rules holding when_busy at "skip"
    stop_reason: str | None = None

    def hold(self, transition: Transition) -> bool:
        """Record a firing series; True when its rule was not held before (the mitigation starts now)."""
        keys = self.holders.setdefault(transition.rule.name, [])
        if transition.key not in keys:
            keys.append(transition.key)
        return len(keys) == 1

    def release(self, rule: str, key: str) -> bool:
        """Record a resolved series; True when no series of the rule fires any more (the mitigation ends)."""
        keys = self.holders.get(rule, [])
        if key in keys:
            keys.remove(key)
        if keys:
            return False
        self.holders.pop(rule, None)
        self.factors.pop(rule, None)
        self.skip_rules.discard(rule)
        return True

    @property
    def interval_factor(self) -> float:
        product = 1.0
        for factor in tuple(self.factors.values()):  # one atomic copy: a mitigation thread may be editing it
            product *= factor
        return min(product, self.max_factor)

    def encode(self) -> list[float]:
        """Three numbers every rank agrees on (see HealthWatch.sync). A user's mitigation may edit the
        state from the mitigation thread meanwhile: `interval_factor` reads a copy of the factors."""
        return [self.interval_factor, 1.0 if self.skip_rules else 0.0, 1.0 if self.stop_reason else 0.0]

    def state_dict(self) -> dict[str, Any]:
        return {
            "factors": dict(self.factors),
            "max_factor": self.max_factor,
            "skip_rules": sorted(self.skip_rules),
            "holders": {rule: list(keys) for rule, keys in self.holders.items()},
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.factors = {str(k): float(v) for k, v in (state.get("factors") or {}).items()}
            self.max_factor = float(state.get("max_factor", DEFAULT_MAX_FACTOR))
            self.skip_rules = set(state.get("skip_rules") or ())
            self.holders = {str(rule): list(keys) for rule, keys in (state.get("holders") or {}).items()}


@dataclass
class MitigationContext:
    """What a mitigation may change: the control state and the queue of actions for the training thread."""

    control: HealthControl
    actions: list[tuple[str, Transition, str]] = field(default_factory=list)  # (kind, transition, text)

    def queue(self, kind: str, transition: Transition, text: str = "") -> None:
        self.actions.append((kind, transition, text))


Mitigation = Callable[[MitigationContext, Transition], "str | None"]
_REGISTRY: dict[str, Mitigation] = {}
_LOCK = threading.Lock()


def register_mitigation(name: str, mitigation: Mitigation) -> None:
    """Make `mitigation(context, transition)` available to rules as `mitigation: <name>`."""
    if not callable(mitigation):
        raise ConfigError(f"mitigation {name!r} must be callable as fn(context, transition)")
    with _LOCK:
        _REGISTRY[name] = mitigation


def mitigation_for(name: str) -> Mitigation:
    """A registered mitigation, or "module:function" imported; a ConfigError names what is known."""
    with _LOCK:
        if name in _REGISTRY:
            return _REGISTRY[name]
    if ":" in name:
        module, _, attribute = name.partition(":")
        try:
            found = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as err:
            raise ConfigError(
                f"mitigation {name!r} cannot be imported ({err}); check the module is importable on every rank"
            ) from err
        if callable(found):
            mitigation: Mitigation = found  # an importable callable: a user's mitigation, called as documented
            return mitigation
    raise ConfigError(f"mitigation {name!r} is unknown; registered: {sorted(_REGISTRY)}; or give 'module:function'")


# --- the built-ins ---
def alert(context: MitigationContext, transition: Transition) -> str | None:
    """Tell the owner and change nothing: every transition already raises an alert."""
    return None


def lower_frequency(context: MitigationContext, transition: Transition) -> str:
    """Save less often while storage is slow: fewer saves queue behind each other, the pause stops growing."""
    options = transition.rule.mitigation_options
    name, control = transition.rule.name, context.control
    before = control.interval_factor
    if transition.kind == FIRED and control.hold(transition):
        control.max_factor = float(options.get("max_factor", control.max_factor))
        control.factors[name] = float(options.get("factor", DEFAULT_FACTOR))
    elif transition.kind != FIRED:
        control.release(name, transition.key)
    return f"save interval x{before:g} -> x{control.interval_factor:g}"


def skip_when_busy(context: MitigationContext, transition: Transition) -> str:
    """A save due while the previous one is still in flight is skipped instead of stalling training."""
    before = bool(context.control.skip_rules)
    if transition.kind == FIRED:
        context.control.hold(transition)
        context.control.skip_rules.add(transition.rule.name)
    else:
        context.control.release(transition.rule.name, transition.key)
    after = bool(context.control.skip_rules)
    return f"when_busy {'skip' if before else 'configured'} -> {'skip' if after else 'configured'}"


def drill_now(context: MitigationContext, transition: Transition) -> str | None:
    """Prove the newest committed checkpoint restores now, rather than at the next scheduled drill."""
    if transition.kind != FIRED:
        return None
    context.queue(DRILL, transition)
    return "restore drill of the newest committed checkpoint requested"


def stop_training(context: MitigationContext, transition: Transition) -> str | None:
    """Last resort (never a default): a final blocking save, then a clean stop that says why."""
    if transition.kind != FIRED:
        return None
    context.control.stop_reason = transition.describe()
    return "final blocking save, then stop"


_BUILT_INS: dict[str, Mitigation] = {
    "alert": alert,
    "lower_frequency": lower_frequency,
    "skip_when_busy": skip_when_busy,
    "drill_now": drill_now,
    "stop_training": stop_training,
}
for _name, _fn in _BUILT_INS.items():
    register_mitigation(_name, _fn)


def edits_control_only(name: str) -> bool:
    """True for the built-ins (still registered under their own name): microsecond edits of the control
    state, safe to run where the rule was evaluated, under the health lock. Anything else is a user's
    action of unknown duration and runs on the MitigationWorker."""
    return _BUILT_INS.get(name) is not None and mitigation_for(name) is _BUILT_INS[name]


class MitigationWorker:
    """One thread per HealthWatch that runs slow (user) mitigations in order, off every training path."""

    def __init__(self, run: Callable[[Transition], None]) -> None:
        self._run = run
        self._pending: list[Transition] = []
        self._busy = 0  # submitted and not yet finished
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, transition: Transition) -> None:
        with self._changed:
            self._pending.append(transition)
            self._busy += 1
            if self._thread is None:  # started on first use: most runs have only built-in mitigations
                self._thread = threading.Thread(target=self._loop, name="shardckpt-health-mitigations", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every submitted mitigation to finish; False (logged) if some still run."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._busy and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
            if self._busy:
                log.warning(
                    "health: %d mitigation(s) still running after %.0f s; not waiting for them "
                    "(a user mitigation should return promptly: hand long work to its own thread)",
                    self._busy,
                    timeout_s,
                )
            return not self._busy

    def _loop(self) -> None:
        while True:
            with self._changed:
                while not self._pending:
                    self._changed.wait()
                transition = self._pending.pop(0)
            try:
                self._run(transition)
            except Exception:  # the runner records its own failures; this thread must outlive any of them
                log.exception("health: mitigation of rule %s failed", transition.rule.name)
            finally:
                with self._changed:
                    self._busy -= 1
                    self._changed.notify_all()
