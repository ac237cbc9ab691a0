"""Warnings a logger emits inside a spawned rank (pytest's caplog does not reach there), as plain strings."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def warnings_of(name: str) -> Iterator[list[str]]:
    """The WARNING-and-above messages of logger `name` (and its children) while the block runs."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


class MessageLines(logging.Handler):
    """Every message of the loggers it is added to, as plain strings (`lines`), in a spawned rank."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
