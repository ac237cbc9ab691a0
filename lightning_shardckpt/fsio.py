"""fsspec access and the one primitive each backend must get right: create a file only if absent.

The commit protocol needs exactly two storage guarantees beyond plain writes:
- `create_if_absent`: the manifest appears whole or not at all, and never replaces an existing one;
- `replace_small_file`: the `latest` pointer is swapped in one step (readers never trust it alone).
Everything else (shard files, DCP metadata) is written to a fresh, uniquely named directory.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from .errors import StorageUnavailable

# MemoryFileSystem is shared by every instance in the process; one lock makes its create atomic.
_MEMORY_CREATE_LOCK = threading.Lock()


@dataclass(frozen=True)
class Location:
    """A resolved storage location: the fsspec filesystem and the path within it."""

    fs: fsspec.AbstractFileSystem
    path: str
    url: str

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)


def resolve(url: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> Location:
    """Turn a URL (`/data/ckpt`, `file://…`, `s3://bucket/run`, `memory://x`) into a Location."""
    text = os.fspath(url)
    if not text:
        raise StorageUnavailable("checkpoint location is empty; set dirpath to a local path or an fsspec URL")
    try:
        fs, path = fsspec.core.url_to_fs(text, **(storage_options or {}))
    except (ImportError, ValueError) as err:
        raise StorageUnavailable(
            f"cannot open storage for {text!r}: {err}. For s3:// install the extra: pip install 'lightning_shardckpt[s3]'"
        ) from err
    if isinstance(fs, LocalFileSystem):
        path = os.path.abspath(path)
    return Location(fs=fs, path=path.rstrip("/") or "/", url=text)


def create_if_absent(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write `data` to `path` atomically, or raise FileExistsError if `path` exists.

    Readers never observe a partial file: on local disks the bytes go to a temp name first and are
    hard-linked into place (link fails rather than overwrite); on S3 the put is conditional
    (`If-None-Match: *`) through s3fs's exclusive mode.
    """
    if isinstance(fs, LocalFileSystem):
        _local_create_if_absent(path, data)
    elif isinstance(fs, MemoryFileSystem):
        with _MEMORY_CREATE_LOCK:
            if fs.exists(path):
                raise FileExistsError(path)
            fs.pipe_file(path, data)
    else:
        # s3fs (and gcsfs) implement mode "xb" as a conditional create on the server.
        with fs.open(path, "xb") as handle:
            handle.write(data)


def replace_small_file(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Replace a small file in one step (used for `latest`, which readers never trust on its own)."""
    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        _write_fsync(tmp, data)
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path))
    else:
        fs.pipe_file(path, data)


def write_new_file(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write a file that belongs to an uncommitted directory (no one reads it before the commit)."""
    if isinstance(fs, LocalFileSystem):
        _write_fsync(path, data)
    else:
        fs.pipe_file(path, data)


def read_range(fs: fsspec.AbstractFileSystem, path: str, start: int, length: int) -> bytes:
    return fs.cat_file(path, start=start, end=start + length)


def makedirs(fs: fsspec.AbstractFileSystem, path: str) -> None:
    try:
        fs.makedirs(path, exist_ok=True)
    except PermissionError as err:
        raise StorageUnavailable(f"cannot create {path!r}: permission denied; choose a writable dirpath") from err


def sync_local_file(handle: Any) -> None:
    """fsync a file object when it is a local file; object stores are durable on close."""
    try:
        handle.flush()
        os.fsync(handle.fileno())
    except (AttributeError, OSError, ValueError):
        pass


def _local_create_if_absent(path: str, data: bytes) -> None:
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    _write_fsync(tmp, data)
    try:
        # link() refuses to replace an existing name: the atomic create-if-absent of POSIX.
        os.link(tmp, path)
    finally:
        os.unlink(tmp)
    _fsync_dir(directory)


def _write_fsync(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
