"""A progress bar on stderr for the long operator commands (export, verify, compare), shown only when stderr
is a terminal: piped into a file or another program they stay quiet."""

from __future__ import annotations

import sys
from typing import Any


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, count: int) -> None:
        return None


def progress(total: int, desc: str, *, unit: str = "B", wanted: bool | None = None) -> Any:
    """A context manager with `update(n)`: a tqdm bar when `wanted` (None: when stderr is a terminal)."""
    if not (sys.stderr.isatty() if wanted is None else wanted):
        return _NoBar()
    from tqdm import tqdm  # a dependency of lightning: always there

    scaled = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, leave=False, **scaled)
