"""The few lines a run shows its user whatever the front door and logging set-up: the resume line, above all.

A plain loop configures no logging, so an INFO line of ours would be invisible; Lightning shows its own "Restoring
states" line through a logger with a handler of its own. We do as Lightning does: the `lightning_shardckpt.console`
logger prints to stderr when the program configured no logging (the root logger has no handler), and otherwise
leaves the lines to the program's handlers. Rank 0 says them; the caller checks the rank.
"""

from __future__ import annotations

import logging
import sys

console = logging.getLogger("lightning_shardckpt.console")


def say(line: str) -> None:
    """One line for the user (rank 0 calls it), shown even where nothing configured logging."""
    if not logging.getLogger().hasHandlers() and not console.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        console.addHandler(handler)
        console.propagate = False  # no second copy through a handler configured later
    if console.level == logging.NOTSET:
        console.setLevel(logging.INFO)
    console.info(line)
