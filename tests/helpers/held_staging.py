"""Hold the background part of an overlapped staging copy, so training provably runs while it is pending.

Without a hold, the copy of a small test state finishes in microseconds and a missing fence would go
unnoticed; held, anything that changes deferred state before the fence reaches the checkpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from lightning_shardckpt.engine.save import staging


@contextmanager
def held_staging_copy(*, gate: threading.Event | None = None, delay_s: float = 0.0) -> Iterator[None]:
    """Every DeferredCopy started inside waits for `gate` (when given), then `delay_s`, then copies."""
    original = staging.DeferredCopy._copy

    def held(self: staging.DeferredCopy) -> None:
        if gate is not None:
            gate.wait()
        time.sleep(delay_s)
        original(self)

    staging.DeferredCopy._copy = held
    try:
        yield
    finally:
        staging.DeferredCopy._copy = original
