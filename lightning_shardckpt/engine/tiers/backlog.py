"""How far a background copier is behind what was submitted to it, and waiting until it catches up.

The durable-tier replicator (replicate.py) and the peer replicator (peers.py) both take commits on the
caller's thread and copy them on their own; `flush` on either waits here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Backlog:
    """Submitted and handled counts under one condition; the owner may guard its own related fields with `lock`."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.submitted = 0
        self.handled = 0

    @property
    def pending(self) -> int:
        return self.submitted - self.handled

    def add(self) -> None:
        with self.lock:
            self.submitted += 1

    def done(self, count: int) -> None:
        with self.lock:
            self.handled += count
            self.lock.notify_all()

    def wake(self) -> None:
        """Waiters look again (the copier stopped: `gave_up` is true now)."""
        with self.lock:
            self.lock.notify_all()

    def wait_empty(self, deadline: float, gave_up: Callable[[], bool]) -> bool:
        """Block until every submission was handled (True), `deadline` (time.monotonic()) passed or `gave_up()`
        (False)."""
        with self.lock:
            while self.pending > 0 and not gave_up():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.lock.wait(min(remaining, 0.5))
        return not gave_up()
