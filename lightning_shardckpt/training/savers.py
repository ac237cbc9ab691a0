"""The savers a front door hosts: one per checkpoint root, on one checkpoint group, all saving as one run.

Every front door has one `SaverHost`: the Trainer's strategy, Fabric's strategy, the plain loop's Checkpointer.
It is what plug-ins call the host (policies/plugin.py `SaverHosting`): `saver_for`, `existing_saver`,
`replace_saver`, `checkpoint_group`, `save_config`, `reduce_boolean_decision`. Two kinds of collectives, never on
one group: the savers' background threads use the checkpoint group (gloo, created once, on every rank at the same
point); the training thread's agreements (preemption, the minutes clock, the health rules' control state, the RNG
gather) go through an `Agreement`, the Lightning strategy's own collectives or a `ControlGroup` of the host's
own. A collective on the group a background thread is using hangs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..engine.collectives import broadcast_from_coordinator, is_distributed, new_checkpoint_group
from ..engine.config import SaveConfig
from ..engine.metrics import CheckpointRecord
from ..engine.save.saver import CheckpointSaver, FaultHook

log = logging.getLogger(__name__)


class Agreement(Protocol):
    """The training thread's collectives: every rank calls each at the same point and gets the same answer."""

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """Every rank's `decision` combined: all true (`all`) or any true."""
        ...

    def all_reduce_max(self, values: list[float]) -> list[float]:
        """Element-wise MAX over every rank."""
        ...


class ControlGroup:
    """An `Agreement` on a gloo group of its own, for a loop without a framework's collectives (the plain loop,
    Fabric). Created on every rank at the same point."""

    def __init__(self, timeout_s: float) -> None:
        self.group = new_checkpoint_group(timeout_s)

    def broadcast(self, value: Any) -> Any:
        return broadcast_from_coordinator("control-agree", value, self.group)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        if not is_distributed():
            return bool(decision)
        flag = torch.tensor([1.0 if decision else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN if all else dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def all_reduce_max(self, values: list[float]) -> list[float]:
        vector = torch.tensor(values, dtype=torch.float64)
        if is_distributed():
            dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=self.group)
        return vector.tolist()

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


class SaverHost:
    """Savers per checkpoint root on one checkpoint group, all saving as one run (`save_config.run_id`)."""

    def __init__(self, save_config: SaveConfig, agreement: Agreement, *, fault_hook: FaultHook | None = None) -> None:
        self._config = save_config
        self.agreement = agreement
        self.fault_hook = fault_hook
        self._savers: dict[str, CheckpointSaver] = {}
        self._group: Any = None
        self._group_made = False
        self._guarded: dict[int, Any] = {}  # id(optimizer) -> its step pre-hook's handle
        self._listeners: list[Callable[[CheckpointRecord], None]] = []  # told of every saver's finished saves
        self._outlived = False  # a closed saver's thread outlived its timeout: the group must stay

    # --- what plug-ins use (policies/plugin.py SaverHosting) ---
    @property
    def save_config(self) -> SaveConfig:
        return self._config

    def checkpoint_group(self) -> Any:
        """The dedicated gloo group of the savers' threads (created once, on first use, on every rank)."""
        if not self._group_made:
            self._group = new_checkpoint_group(self._config.collective_timeout_s)
            self._group_made = True
        return self._group

    def saver_for(self, root: str) -> CheckpointSaver:
        """The saver of `root`, created on first use (collective: every rank at the same point), once the savers of
        other roots finished what they have in flight (`_one_thread_on_the_group`)."""
        if root not in self._savers:
            self._savers[root] = self.new_saver(root)
        self._one_thread_on_the_group(root)
        return self._savers[root]

    def existing_saver(self, root: str) -> CheckpointSaver | None:
        return self._savers.get(root)

    def replace_saver(self, root: str, saver: CheckpointSaver) -> None:
        """Adopt a saver made elsewhere (tiers' degraded mode): `wait` waits for it, `close` closes it."""
        self._savers[root] = saver

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        return self.agreement.reduce_boolean_decision(decision, all)

    # --- what the front door uses ---
    def configure(self, save_config: SaveConfig) -> None:
        """The door's save options from now on (the plan's, once set up); savers made before keep theirs."""
        self._config = save_config

    def new_saver(self, root: str, config: SaveConfig | None = None) -> CheckpointSaver:
        """A saver of `root` the host does not keep (a blocking save to an explicit path); collective. Without a
        run id yet, the first saver's generated one becomes this run's, so every later root records the same."""
        self._one_thread_on_the_group(root)  # the constructor's "root-owner" broadcast runs on the group
        saver = CheckpointSaver(root, config or self._config, group=self.checkpoint_group(), fault_hook=self.fault_hook)
        if self._config.run_id is None:
            self._config = replace(self._config, run_id=saver.run_id)
        for listener in self._listeners:
            saver.add_listener(listener)
        return saver

    def add_listener(self, listener: Callable[[CheckpointRecord], None]) -> None:
        """Call `listener(record)` with every finished save of every saver this host makes from now on (on the
        saver's background thread, as `CheckpointSaver.add_listener`)."""
        self._listeners.append(listener)

    def savers(self) -> list[CheckpointSaver]:
        return list(self._savers.values())

    def release(self, root: str) -> None:
        """Let `root`'s saver commit what it has and stop (its host copy of the state goes with it)."""
        saver = self._savers.pop(root, None)
        if saver is not None:
            self._close_all([saver])

    def adopt_run_id(self, run_id: str) -> None:
        """This run's id for every saver from now on; a saver of another id is closed (the next save makes one)."""
        if self._config.run_id == run_id:
            return
        self._config = replace(self._config, run_id=run_id)
        for root, saver in list(self._savers.items()):
            if saver.run_id != run_id:
                del self._savers[root]
                self._close_all([saver])

    def guard(self, optimizers: Iterable[torch.optim.Optimizer], unless: Callable[[], bool] = lambda: False) -> None:
        """A fence before every `step()` of `optimizers` (a step pre-hook, once per optimizer): overlapped staging
        copies parameters and optimizer state while the loop goes on, and must finish before the update changes
        them. `unless()` true skips it (the Trainer's optimizer_step fences after its closure instead)."""
        for optimizer in optimizers:
            if id(optimizer) not in self._guarded:

                def fence_before_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
                    if not unless():
                        self.fence()  # a step pre-hook returns None (or replacement arguments)

                self._guarded[id(optimizer)] = optimizer.register_step_pre_hook(fence_before_step)

    def fence(self) -> float:
        """Block until every requested save's state is copied (before the live state may change); seconds blocked."""
        return sum(saver.fence() for saver in self._savers.values())

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every requested save finished (a load must not share the group with a save); False if
        `timeout` passed first."""
        return all(saver.wait(timeout) for saver in self._savers.values())

    def close(self) -> bool:
        """Let in-flight saves commit, stop the savers and the fences, then release the checkpoint group once no
        saver thread runs. True when none does (False: one outlived its timeout and still uses the group)."""
        savers, self._savers = list(self._savers.values()), {}
        for handle in self._guarded.values():
            handle.remove()
        self._guarded = {}
        try:
            self._close_all(savers)
        finally:
            if self._group is not None and not self._outlived:
                dist.destroy_process_group(self._group)
            if not self._outlived:
                self._group, self._group_made = None, False
        return not self._outlived

    def _one_thread_on_the_group(self, root: str) -> None:
        """Block until the savers of roots other than `root` finished their saves (fenced, then committed or
        failed). Every saver of this host runs its collectives on the one checkpoint group, each from its own
        thread (or, for a new saver's "root-owner" check, the training thread); two threads' collectives on one
        group pair up in different orders on different ranks and hang (Fabric's save to `step-N/` then at once to
        `final/`). So a save to another root, or a new saver, first lets the group fall quiet: the previous root's
        commit comes first, as docs/howto/fabric.md promises."""
        for other_root, saver in self._savers.items():
            if other_root != root:
                saver.fence()
                saver.wait()

    def _close_all(self, savers: list[CheckpointSaver]) -> None:
        errors = []
        for saver in savers:
            try:
                saver.close()  # may raise a background save's error (save.on_error="raise") once its worker stopped
            except Exception as err:  # noqa: BLE001 - every saver is closed first; the first error is raised after
                errors.append(err)
        self._outlived = self._outlived or not all(saver.wait(0) and saver.stopped for saver in savers)
        if errors:
            raise errors[0]

    # --- the training thread's agreements ---
    def broadcast(self, value: Any) -> Any:
        return self.agreement.broadcast(value)

    def all_reduce_max(self, values: list[float]) -> list[float]:
        return self.agreement.all_reduce_max(values)


def all_reduce_max_on_default_group(values: list[float], device: torch.device) -> list[float]:
    """MAX over every rank on the training group, on the strategy's device (a framework's collectives: the Trainer's
    and Fabric's strategies, whose training group may be NCCL)."""
    vector = torch.tensor(values, dtype=torch.float64)
    if is_distributed() and dist.get_world_size() > 1:
        vector = vector.to(device)
        dist.all_reduce(vector, op=dist.ReduceOp.MAX)
    return vector.cpu().tolist()
