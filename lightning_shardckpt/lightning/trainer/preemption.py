"""Preemption in a Lightning fit: our flag-only SIGTERM / SIGUSR1 handlers instead of Lightning's (the ranks
agree on them at each batch end in the save loop, training/save_loop.py).

Lightning's own SIGTERM handler (trainer/connectors/signal_connector.py) broadcasts from inside the signal
handler, and its loops then raise SIGTERMException on the signalled rank only: SIGTERM to every rank, to one,
or at different steps hung the job with no final save. Lightning installs that handler when fit starts,
after the callbacks' `setup`, so `take_back` runs again at the sanity check's and the training's start. The
flag and the watchdog are framework-free: training/preemption.py.
"""

from __future__ import annotations

import logging

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

    @property
    def requested(self) -> bool:
        """This rank received SIGTERM / SIGUSR1 (the ranks then agree: training/save_loop.py)."""
        return self.requests.requested
