"""Preemption in a Lightning fit: our flag-only SIGTERM / SIGUSR1 handlers instead of Lightning's, and the
ranks' agreement on them at each batch end.

Lightning's own SIGTERM handler (trainer/connectors/signal_connector.py) broadcasts from inside the signal
handler, and its loops then raise SIGTERMException on the signalled rank only: SIGTERM to every rank, to one,
or at different steps hung the job with no final save. Lightning installs that handler when fit starts,
after the callbacks' `setup`, so `take_back` runs again at the sanity check's and the training's start. The
flag and the watchdog are framework-free: training/preemption.py.
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl

from ...policies.plugin import PluginContext, PluginList
from ...training.preemption import PreemptionRequests

log = logging.getLogger(__name__)


class PreemptionSignal:
    def __init__(self, grace_s: float | None) -> None:
        self.requests = PreemptionRequests(grace_s)
        self.stopped_at: int | None = None  # the step this fit saved and stopped at for a preemption

    def install(self) -> None:
        self.stopped_at = None
        self.requests.install()

    def take_back(self) -> None:
        self.requests.take_back()

    def restore(self) -> None:
        self.requests.close()

    def agreed(self, trainer: pl.Trainer, enabled: bool, plugins: PluginList, context: PluginContext) -> bool:
        """Any rank's request, agreed by every rank at this batch end in one collective: a plug-in's own
        all-reduce (the health rules' control state) carries it, else the strategy's. Lightning's flag counts
        too: a SIGTERM in the moment before `take_back` reached Lightning's handler."""
        local = enabled and (self.requests.requested or bool(getattr(trainer, "received_sigterm", False)))
        verdict = plugins.sync(local, context)
        if verdict is None:
            verdict = enabled and trainer.strategy.reduce_boolean_decision(local, all=False)
        if verdict:
            self.stopped_at = trainer.global_step
        return bool(verdict)

    def stopping(self, trainer: pl.Trainer, committed: bool, root: str) -> None:
        """Rank 0 says where the preempted run stands: its final save committed, or not."""
        if trainer.is_global_zero:
            saved = "is committed" if committed else "did NOT commit (see above)"
            log.warning("preempted: step %d %s under %s; training stops", trainer.global_step, saved, root)
