"""A real counting fsspec filesystem: the local filesystem, with a log of every range read and slow reads.

`counting:///abs/path` with storage_options `{"log_id": "<unique>", "latency_s": 0.02}` behaves as the
local filesystem (it is one), except that `cat_file` (the range read our reader uses on any filesystem
but the plain local one) records (path, start, stop) in `LOGS[log_id]` (and `ls` the directory it lists), counts how many range reads run at
once, and takes `latency_s` longer, as an object store's round trip does. Distinct `log_id`s give
distinct instances and logs (fsspec caches one instance per set of options).

Importing this module registers the protocol.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "counting"


@dataclass
class ReadLog:
    reads: list[tuple[str, int, int]] = field(default_factory=list)
    lists: list[str] = field(default_factory=list)  # the directories `ls` listed (an object store's LIST), in order
    running: int = 0
    peak_running: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bytes_read(self, path: str, start: int, stop: int) -> list[tuple[int, int]]:
        """The parts of [start, stop) of `path` each read covered, in the order read."""
        return [(max(a, start), min(b, stop)) for p, a, b in self.reads if p == path and a < stop and b > start]


LOGS: dict[str, ReadLog] = {}


class CountingFileSystem(LocalFileSystem):
    protocol = (PROTOCOL,)

    def __init__(self, log_id: str, latency_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log = LOGS.setdefault(log_id, ReadLog())
        self.latency_s = float(latency_s)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        with self.log.lock:
            self.log.running += 1
            self.log.peak_running = max(self.log.peak_running, self.log.running)
        try:
            time.sleep(self.latency_s)
            data = super().cat_file(path, start=start, end=end, **kwargs)
        finally:
            with self.log.lock:
                self.log.running -= 1
        first = start or 0
        with self.log.lock:
            self.log.reads.append((path, first, first + len(data)))
        return data

    def ls(self, path: str, detail: bool = False, **kwargs: Any) -> Any:
        with self.log.lock:
            self.log.lists.append(self._strip_protocol(path))
        return super().ls(path, detail=detail, **kwargs)


def counting_url(path: str | os.PathLike) -> str:
    return f"{PROTOCOL}://{os.path.abspath(path)}"


fsspec.register_implementation(PROTOCOL, CountingFileSystem, clobber=True)
