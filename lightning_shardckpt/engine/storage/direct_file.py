"""A shard file written past the page cache (O_DIRECT), for local disks that take it.

Why: a buffered `write()` makes the kernel copy every byte into the page cache, allocate and account those pages,
and later write them back on a kernel thread — measured here 0.20 CPU-s per 512 MiB on the writing thread, where
the same bytes written with O_DIRECT from an aligned buffer cost 0.05 (`benchmarks/save_profile.py --methods
floor,ours,ours_buffered` shows what it does to a whole save; docs/BENCHMARKS.md). A checkpoint is
written once and read rarely, so the page cache buys it nothing, and the writeback's CPU comes out of training's
cores too. DeepSpeed's FastPersist writes checkpoints the same way.

O_DIRECT wants the buffer's address, the file offset and the length aligned to the device's block. Our bytes come
as torch's record writer hands them (any size), so they are gathered in one page-aligned buffer (an anonymous
mmap) and written in whole aligned blocks with `pwrite`; that gather is one memcpy in user space, which is what the
kernel's page-cache copy was, without the rest. `flush()` writes the partial last block padded with zeros and cuts
the file back to its true size, so a flush (then `fsync`) makes every byte so far durable, and writing may go on
after it: the buffer keeps the partial block and rewrites it in place.

`open_direct(path)` returns None when the filesystem refuses O_DIRECT (tmpfs, some FUSE and network filesystems):
the caller then writes buffered, as before.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Any

ALIGN = 4096  # a multiple of every logical block size Linux devices use (512 and 4096)
BUFFER_BYTES = 8 * 2**20  # gathered before each write: a multiple of ALIGN, large enough that syscalls are few


def open_direct(path: str) -> DirectFile | None:
    """`path` created (truncated) for writing with O_DIRECT, or None where the OS or filesystem refuses it."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:  # macOS, Windows: no O_DIRECT
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as err:
        if err.errno == errno.EINVAL:  # this filesystem has no direct I/O
            return None
        raise
    return DirectFile(fd, path)


class DirectFile:
    """A write-only binary file over an O_DIRECT descriptor (see the module docstring)."""

    def __init__(self, fd: int, path: str) -> None:
        self.name = path
        self._fd: int | None = fd
        self._buffer = mmap.mmap(-1, BUFFER_BYTES)  # page-aligned, as O_DIRECT needs
        self._view = memoryview(self._buffer)
        self._fill = 0  # bytes gathered in the buffer
        self._base = 0  # the file offset of the buffer's first byte: always a multiple of ALIGN
        self._size = 0  # bytes written through this file

    def write(self, data: Any) -> int:
        self._require_fd()
        source = memoryview(data).cast("B")
        size = source.nbytes
        taken = 0
        while taken < size:
            count = min(size - taken, BUFFER_BYTES - self._fill)
            self._view[self._fill : self._fill + count] = source[taken : taken + count]
            self._fill += count
            taken += count
            if self._fill == BUFFER_BYTES:
                self._write_at_base(BUFFER_BYTES)
                self._base += BUFFER_BYTES
                self._fill = 0
        self._size += size
        return size

    def flush(self) -> None:
        """Write the partial last block (padded, then the file cut to its true size); the buffer keeps it, so
        later writes extend it and rewrite that block."""
        if self._fill:
            padded = -(-self._fill // ALIGN) * ALIGN
            self._view[self._fill : padded] = bytes(padded - self._fill)
            self._write_at_base(padded)
            os.ftruncate(self._require_fd(), self._size)

    def fileno(self) -> int:
        return self._require_fd()

    def tell(self) -> int:
        return self._size

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        """Flush and close; the descriptor is closed and the buffer released even when the flush fails."""
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            os.close(self._fd)
            self._fd = None
            self._view.release()
            self._buffer.close()

    def writable(self) -> bool:
        return True

    def _write_at_base(self, length: int) -> None:
        fd = self._require_fd()
        done = 0
        while done < length:
            written = os.pwrite(fd, self._view[done:length], self._base + done)
            if written <= 0 or written % ALIGN:
                # a direct write that stops short stops where the device did (a full disk, a quota): name it
                raise OSError(
                    errno.ENOSPC, f"short direct write: {done + max(written, 0)} of {length} bytes", self.name
                )
            done += written

    def _require_fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"I/O operation on closed file {self.name}")
        return self._fd
