"""Picklable fault hooks for `CheckpointSaver(fault_hook=...)`: fail, die or stall at a named point."""

from __future__ import annotations

import os
import time

import torch.distributed as dist


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Stall:
    """Sleep `seconds` at `point` (on `ranks`, default all): makes a background save slow on purpose."""

    def __init__(self, point: str, seconds: float, ranks: tuple[int, ...] | None = None) -> None:
        self.point, self.seconds, self.ranks = point, seconds, ranks

    def __call__(self, point: str) -> None:
        if point == self.point and (self.ranks is None or _rank() in self.ranks):
            time.sleep(self.seconds)


class FailOnce:
    """Raise OSError at `point` on `rank`, only for the first `times` occurrences."""

    def __init__(self, point: str, rank: int = 0, times: int = 1) -> None:
        self.point, self.rank, self.remaining = point, rank, times

    def __call__(self, point: str) -> None:
        if point == self.point and _rank() == self.rank and self.remaining > 0:
            self.remaining -= 1
            raise OSError(f"injected storage failure at {point} on rank {self.rank}")


class Die:
    """Kill this process (no cleanup, like SIGKILL) at `point` on `rank`."""

    def __init__(self, point: str, rank: int) -> None:
        self.point, self.rank = point, rank

    def __call__(self, point: str) -> None:
        if point == self.point and _rank() == self.rank:
            os._exit(17)
