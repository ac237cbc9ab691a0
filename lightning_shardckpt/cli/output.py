"""Text output shared by the `shardckpt` subcommands: aligned tables, JSON documents, sizes, ages, times."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

PROG = "shardckpt"  # the name every error, warning and hint line starts with


def print_json(document: Any) -> None:
    print(json.dumps(document, indent=1, sort_keys=True, default=str))


def print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def human_bytes(count: int | None) -> str:
    if count is None:
        return "-"
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{count} B"


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def short_time(stamp: str | None) -> str:
    """`2026-12-04T13:05:55.640+00:00` -> `2026-12-04 13:05:55` (UTC, as the manifest records it)."""
    return "-" if stamp is None else stamp[:19].replace("T", " ")
