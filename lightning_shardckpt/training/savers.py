"""The savers of a plain training loop, and the collectives its training thread runs: what plug-ins call a strategy.

ShardedStrategy holds a Lightning fit's savers; a loop without Lightning has this instead. It gives plug-ins
(policies/plugin.py) the same few methods: `saver_for`, `existing_saver`, `replace_saver`, `checkpoint_group`,
`save_config`, `reduce_boolean_decision`. Two gloo groups, both created at construction (every rank, same
point): the checkpoint group, which the savers' background threads use, and a control group for the
training thread's agreements (preemption, the minutes clock, the health rules' control state, RNG states).
A collective on the group a background thread is using hangs, so the training thread never uses the first.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from ..engine.collectives import broadcast_from_coordinator, is_distributed, new_checkpoint_group
from ..engine.config import SaveConfig
from ..engine.save.saver import CheckpointSaver

log = logging.getLogger(__name__)


class SaverHost:
    """Savers per checkpoint root on one checkpoint group, all saving as one run (`save_config.run_id`)."""

    def __init__(self, save_config: SaveConfig) -> None:
        self.save_config = save_config
        self._savers: dict[str, CheckpointSaver] = {}
        self._group = new_checkpoint_group(save_config.collective_timeout_s)
        self.control_group = new_checkpoint_group(save_config.collective_timeout_s)

    # --- what plug-ins use ---
    def checkpoint_group(self) -> Any:
        return self._group

    def saver_for(self, root: str) -> CheckpointSaver:
        """The saver of `root`, created on first use (collective: every rank at the same point)."""
        if root not in self._savers:
            self._savers[root] = CheckpointSaver(root, self.save_config, group=self._group)
        return self._savers[root]

    def existing_saver(self, root: str) -> CheckpointSaver | None:
        return self._savers.get(root)

    def replace_saver(self, root: str, saver: CheckpointSaver) -> None:
        """Adopt a saver made elsewhere (tiers' degraded mode): `close` closes it too."""
        self._savers[root] = saver

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """Every rank's `decision` combined: all true (`all`) or any true; every rank gets the same answer."""
        if not is_distributed():
            return bool(decision)
        flag = torch.tensor([1.0 if decision else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN if all else dist.ReduceOp.MAX, group=self.control_group)
        return bool(flag.item())

    # --- what the front door uses ---
    def all_reduce_max(self, values: list[float]) -> list[float]:
        """MAX over every rank (the health rules' control state), on the control group."""
        vector = torch.tensor(values, dtype=torch.float64)
        if is_distributed():
            dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=self.control_group)
        return vector.tolist()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (a clock verdict, a listing)."""
        return broadcast_from_coordinator("checkpointer-agree", value, self.control_group)

    def adopt_run_id(self, run_id: str) -> None:
        """This run's id for every saver from now on; a saver of another id is closed (the next save makes one)."""
        if self.save_config.run_id == run_id:
            return
        self.save_config = replace(self.save_config, run_id=run_id)
        for root, saver in list(self._savers.items()):
            if saver.run_id != run_id:
                saver.close()
                del self._savers[root]

    def fence(self) -> float:
        """Block until every requested save's state is copied (before the live state may change)."""
        return sum(saver.fence() for saver in self._savers.values())

    def wait(self) -> None:
        """Block until every requested save finished (a load must not share the group with a save)."""
        for saver in self._savers.values():
            saver.wait()

    def close(self) -> None:
        """Let in-flight saves commit, stop the savers, then release the groups once no saver thread runs."""
        savers, self._savers = list(self._savers.values()), {}
        try:
            for saver in savers:
                saver.close()
        finally:
            if is_distributed() and all(saver.wait(0) and saver.stopped for saver in savers):
                for group in (self._group, self.control_group):
                    if group is not None:
                        dist.destroy_process_group(group)
                self._group = self.control_group = None
