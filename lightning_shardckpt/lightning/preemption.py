"""A preemption request on this rank: SIGUSR1 (handled here) or the Trainer's SIGTERM flag."""

from __future__ import annotations

import signal
from typing import Any

import lightning.pytorch as pl

from ..policies.plugin import PluginContext, PluginList


class PreemptionSignal:
    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None

    def install(self) -> None:
        def on_signal(signum: int, frame: Any) -> None:
            self.received = True
            if callable(self._previous):
                self._previous(signum, frame)

        try:
            self._previous = signal.signal(signal.SIGUSR1, on_signal)
        except ValueError:  # not the main thread: the trainer's SIGTERM flag still works
            self._previous = None

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGUSR1, self._previous)
            self._previous = None

    def agreed(self, trainer: pl.Trainer, enabled: bool, plugins: PluginList, context: PluginContext) -> bool:
        """Any rank's request, agreed by every rank at this batch end in one collective: a plug-in's own
        all-reduce (the health rules' control state) carries it, else the strategy's."""
        local = enabled and (self.received or bool(getattr(trainer, "received_sigterm", False)))
        verdict = plugins.sync(local, context)
        if verdict is None:
            verdict = enabled and trainer.strategy.reduce_boolean_decision(local, all=False)
        return bool(verdict)
