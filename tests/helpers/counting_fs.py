"""A real counting fsspec filesystem: the local filesystem, with a log of every range read and slow reads.

`counting:///abs/path` with storage_options `{"log_id": "<unique>", "latency_s": 0.02}` behaves as the
local filesystem (it is one), except that `cat_file` (the range read our reader uses on any filesystem
but the plain local one) records (path, start, stop) in `LOGS[log_id]` (and `ls` the directory it lists), counts
how many range reads run at once, and takes `latency_s` longer, as an object store's round trip does. With
`"log_opens": True` every read of a file opened for reading is logged too (a whole-file hash streams through one).
Distinct `log_id`s give distinct instances and logs (fsspec caches one instance per set of options).

Importing this module registers the protocol.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

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
_IN_CAT_FILE = threading.local()


class CountingFileSystem(LocalFileSystem):
    protocol = (PROTOCOL,)

    def __init__(self, log_id: str, latency_s: float = 0.0, log_opens: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log = LOGS.setdefault(log_id, ReadLog())
        self.latency_s = float(latency_s)
        self.log_opens = bool(log_opens)  # also log reads through open(): a whole-file hash streams through one

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        with self.log.lock:
            self.log.running += 1
            self.log.peak_running = max(self.log.peak_running, self.log.running)
        try:
            time.sleep(self.latency_s)
            _IN_CAT_FILE.active = True  # its own read through open() is this read: logged once, below
            try:
                data = super().cat_file(path, start=start, end=end, **kwargs)
            finally:
                _IN_CAT_FILE.active = False
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

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        if not self.log_opens or "r" not in mode or "+" in mode:
            return super()._open(path, mode, block_size=block_size, **kwargs)
        return _CountingOpener(self._strip_protocol(path), mode, self.log, fs=self, **kwargs)


class _CountingOpener(LocalFileOpener):
    """A file opened for reading whose reads are logged as cat_file's are: a whole-file hash streams through one."""

    def __init__(self, path: str, mode: str, log: ReadLog, **kwargs: Any) -> None:
        self._log = log
        super().__init__(path, mode, **kwargs)

    def read(self, *args: Any, **kwargs: Any) -> bytes:
        first = self.f.tell()
        data = self.f.read(*args, **kwargs)
        self._logged(first, len(data))
        return data

    def readinto(self, target: Any) -> int:
        first = self.f.tell()
        count = self.f.readinto(target)
        self._logged(first, count or 0)
        return count

    def _logged(self, first: int, count: int) -> None:
        if getattr(_IN_CAT_FILE, "active", False):
            return
        with self._log.lock:
            self._log.reads.append((self.path, first, first + count))


def counting_url(path: str | os.PathLike) -> str:
    return f"{PROTOCOL}://{os.path.abspath(path)}"


fsspec.register_implementation(PROTOCOL, CountingFileSystem, clobber=True)
