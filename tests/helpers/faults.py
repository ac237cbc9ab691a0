"""Picklable fault hooks for `CheckpointSaver(fault_hook=...)`: fail, die or stall at a named point."""

from __future__ import annotations

import os
import random
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


# The fault points of one save, in the order a save reaches them (storage.py, commit.py), up to the commit
# point. `after_manifest` is left out on purpose: the manifest exists then, so the checkpoint is committed
# although the save reports a failure, and a soak that counts outcomes against the disk would disagree with
# itself (tests/distributed/test_commit_failures.py covers that point on its own).
PRE_COMMIT_POINTS = ("before_write", "mid_shard", "after_write", "before_receipt", "before_metadata", "before_manifest")


class RandomFailures:
    """Fail a seeded random `rate` of saves, each at a random point before the commit; picklable.

    With `saves`, exactly round(rate * saves) of the first `saves` saves fail (which ones is seeded);
    without, each save fails with probability `rate`. A save starts at its first `before_write`; the
    same seed on every rank draws the same saves and points, so the ranks agree. `injected` lists the
    (save index, point) of each failure raised in this process.
    """

    def __init__(
        self, rate: float = 0.1, seed: int = 0, saves: int | None = None, points: tuple[str, ...] = PRE_COMMIT_POINTS
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate={rate} is outside [0, 1]")
        self.rate, self.points = rate, tuple(points)
        self._rng = random.Random(seed)
        self._doomed = set(self._rng.sample(range(saves), round(rate * saves))) if saves is not None else None
        self.save_index = -1
        self._armed: str | None = None  # the point at which the current save fails, if it does
        self.injected: list[tuple[int, str]] = []

    def __call__(self, point: str) -> None:
        if point == "before_write":  # the first point of every save, on every rank
            self.save_index += 1
            fails = (self.save_index in self._doomed) if self._doomed is not None else self._rng.random() < self.rate
            self._armed = self._rng.choice(self.points) if fails else None
        if self._armed is not None and point == self._armed:
            self._armed = None
            self.injected.append((self.save_index, point))
            raise OSError(f"injected storage failure at {point} (save #{self.save_index})")


class DiskFullOnOccurrences:
    """Raise ENOSPC at `point` on `rank` at its n-th occurrences (1-based): chosen saves fail, the rest commit."""

    def __init__(self, point: str, occurrences: tuple[int, ...], rank: int = 0) -> None:
        self.point, self.occurrences, self.rank, self.seen = point, set(occurrences), rank, 0

    def __call__(self, point: str) -> None:
        if point != self.point or _rank() != self.rank:
            return
        self.seen += 1
        if self.seen in self.occurrences:
            import errno

            raise OSError(errno.ENOSPC, f"No space left on device (injected at {point}, occurrence {self.seen})")
