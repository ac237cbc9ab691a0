"""Small files of a root read safely: regular files only, never a symlink, within a size bound, never blocking.

Anything in a checkpoint root may have been put there by someone else, and a reader that opens what a name
points to can be made to hang or to exhaust memory: a FIFO named `commit.json` blocks `open()` until a writer
comes (forever), a symlink to `/dev/zero` reads without end, a 2 GiB sparse `latest` is read whole before any
bound is checked, a symlink to `/etc/...` leads out of the root. So every metadata reader (the listing, the
commit index and the `latest` pointer, manifests, commit records, signatures, drill records and leases) reads
through `read_small` (backends.py: `FsspecBackend.read_small`, `read_small_files`), which refuses such a file
with SmallFileRefused, naming the path and why, before reading a byte of it:

- on local storage: `os.lstat` first (a symlink, a FIFO, a device or a socket is refused, not opened); the
  open is `O_NOFOLLOW | O_NONBLOCK` (a name swapped for a link or a FIFO between the lstat and the open still
  neither leads anywhere nor blocks), `fstat` of the open file checks it is still regular and within the bound;
- everywhere: at most `max_bytes + 1` bytes are read (a range read on object stores), and more than `max_bytes`
  is refused.

Nothing the package writes in a root is a symlink (`latest` is a file replaced in one step, index markers and
leases are files), so no symlink inside a root is followed either: a root itself may be a symlink (a node's
root under another name), the names in it may not.

SmallFileRefused is an OSError that no retry can fix (retry.py: its errno is none of the transient ones); each
caller turns it into the problem of that one file (a corrupt checkpoint, an ignored hint or lease), never of
the whole root.
"""

from __future__ import annotations

import errno
import os
import stat

# O_NOFOLLOW: a final component that is a symlink fails (ELOOP) instead of being followed; O_NONBLOCK: opening a
# FIFO returns at once instead of waiting for a writer (regular files read the same with or without it)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class SmallFileRefused(OSError):
    """A file a reader refuses before reading it: not a regular file, a symlink, or larger than it may be."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path} is {why}; only regular files within their size bound are read from a root")
        self.path = path
        self.why = why

    def __str__(self) -> str:
        return str(self.args[0])


def refusal(path: str, mode: int, size: int, max_bytes: int | None) -> SmallFileRefused | None:
    """Why a local file of `mode` and `size` (from lstat or fstat) is not read; None when it may be."""
    if stat.S_ISLNK(mode):
        target = _link_target(path)
        return SmallFileRefused(path, f"a symlink{target}, not a regular file")
    if not stat.S_ISREG(mode):
        return SmallFileRefused(path, f"not a regular file (a {_kind(mode)})")
    if max_bytes is not None and size > max_bytes:
        return SmallFileRefused(path, f"larger than {max_bytes} bytes ({size} bytes)")
    return None


def check_local(path: str, max_bytes: int | None = None) -> int:
    """The size of the local regular file `path`, within `max_bytes`; FileNotFoundError when absent,
    IsADirectoryError for a directory, SmallFileRefused for anything else. Opens nothing."""
    info = os.lstat(path)
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(path)
    problem = refusal(path, info.st_mode, info.st_size, max_bytes)
    if problem is not None:
        raise problem
    return info.st_size


def read_local(path: str, max_bytes: int) -> bytes:
    """The bytes of the local regular file `path`, at most `max_bytes` of them (see the module docstring)."""
    check_local(path, max_bytes)
    try:
        descriptor = os.open(path, _OPEN_FLAGS)
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise SmallFileRefused(path, "a symlink (it became one after it was looked at)") from None
        raise
    try:
        info = os.fstat(descriptor)
        problem = refusal(path, info.st_mode, info.st_size, max_bytes)
        if problem is not None:  # swapped for something else between the lstat and the open
            raise problem
        return bounded(path, _read_at_most(descriptor, max_bytes + 1), max_bytes)
    finally:
        os.close(descriptor)


def bounded(path: str, data: bytes, max_bytes: int) -> bytes:
    """`data` (read as at most `max_bytes + 1` bytes of `path`), refused when it holds more than `max_bytes`."""
    if len(data) > max_bytes:
        raise SmallFileRefused(path, f"larger than {max_bytes} bytes")
    return data


def _read_at_most(descriptor: int, limit: int) -> bytes:
    pieces, left = [], limit
    while left > 0:
        piece = os.read(descriptor, min(left, 1 << 20))
        if not piece:
            break
        pieces.append(piece)
        left -= len(piece)
    return b"".join(pieces)


def _link_target(path: str) -> str:
    try:
        return f" to {os.readlink(path)}"
    except OSError:
        return ""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "special file"
