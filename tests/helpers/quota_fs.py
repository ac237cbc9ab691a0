"""A real size-limited fsspec filesystem: a local directory tree with a byte budget, like a small disk.

`quota:///abs/path` with storage_options `{"budget_bytes": N, "quota_root": "/abs/dir"}` behaves as the
local filesystem, except that a file written through `fs.open` gets `OSError(ENOSPC)` once the bytes
stored under `quota_root` (measured on disk at every raw write, so other processes' files and deletions
count) would exceed the budget. Like a real full disk it keeps what fit, and the error surfaces where
Python's buffered file meets it: at a flush, inside some later `write`. The engine's
own small-file writes on local filesystems (manifest, `.metadata`, events) bypass fsspec's `open`,
so they are never refused, but the bytes they store count against the budget.

Importing this module registers the protocol (in every process that imports it: spawned ranks import
the test module that uses it).
"""

from __future__ import annotations

import errno
import io
import os
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

PROTOCOL = "quota"


def used_bytes(root: str) -> int:
    """Bytes of every file under `root` (a file deleted mid-walk counts as gone)."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except FileNotFoundError:
                pass
    return total


class _QuotaRaw(io.FileIO):
    """The raw file under Python's buffer, where a real disk would refuse bytes: checks the budget."""

    def __init__(self, path: str, mode: str, fs: QuotaFileSystem) -> None:
        super().__init__(path, mode.replace("b", ""))
        self._fs = fs

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        room = self._fs.budget_bytes - used_bytes(self._fs.quota_root)
        if len(view) > room:
            if room > 0:
                return super().write(view[:room])  # a short write, as a nearly full disk does
            raise OSError(errno.ENOSPC, f"No space left on device (quota of {self._fs.budget_bytes} bytes)", self.name)
        return super().write(view)


class _QuotaFile(LocalFileOpener):
    """A local file written through Python's usual buffer over a budget-checking raw file.

    As on a real disk, a refused write surfaces when the buffer flushes: often in a later `write`
    call, after part of its bytes were accepted into the buffer.
    """

    def _open(self) -> None:
        if not any(flag in self.mode for flag in "wxa"):
            super()._open()
            return
        if self.f is None or self.f.closed:
            self.f = io.BufferedWriter(_QuotaRaw(self.path, self.mode, self.fs))


class QuotaFileSystem(LocalFileSystem):
    protocol = (PROTOCOL,)

    def __init__(self, budget_bytes: int, quota_root: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.budget_bytes = int(budget_bytes)
        self.quota_root = os.path.abspath(quota_root)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if self.auto_mkdir and any(flag in mode for flag in "wxa"):
            self.makedirs(self._parent(path), exist_ok=True)
        return _QuotaFile(path, mode, fs=self, **kwargs)


def quota_url(path: str | os.PathLike) -> str:
    return f"{PROTOCOL}://{os.path.abspath(path)}"


def quota_options(quota_root: str | os.PathLike, budget_bytes: int) -> dict[str, Any]:
    return {"budget_bytes": int(budget_bytes), "quota_root": os.path.abspath(quota_root)}


fsspec.register_implementation(PROTOCOL, QuotaFileSystem, clobber=True)
