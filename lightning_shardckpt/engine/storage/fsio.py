"""fsspec access and the one primitive each backend must get right: create a file only if absent.

The commit protocol needs exactly two storage guarantees beyond plain writes:
- `create_if_absent`: the manifest appears whole or not at all, and never replaces an existing one;
- `replace_small_file`: the `latest` pointer is swapped in one step (readers never trust it alone).
Everything else (shard files, DCP metadata) is written to a fresh, uniquely named directory.

On object stores (S3 through s3fs) nothing relies on rename, on directories or on listing consistency:
create-if-absent is a conditional put (`If-None-Match: *`), `latest` is a plain whole-object put,
directories do not exist (`makedirs` is a no-op and never creates a bucket), and listings are never
cached (`use_listings_cache=False`), so the catalog sees what other processes committed. The small
objects our code writes and reads are retried through `retry.call` (see retry.py for the layers).
How each kind of storage does these things is its backend's business (backends.py), chosen once in
`resolve` and kept on the Location; the functions here that take a bare filesystem ask `backend_for`.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import fsspec

from ...errors import StorageUnavailable
from ..format.names import join
from . import retry
from .backends import FsspecBackend, backend_class_for_url, backend_for

log = logging.getLogger(__name__)

PROBE_PREFIX = ".probe-"  # preflight's probe objects: ROOT/.probe-<uuid>, deleted right away


@dataclass(frozen=True)
class Location:
    """A resolved storage location: the fsspec filesystem, the path within it, and its storage backend.

    The backend (backends.py: what differs per kind of storage) is chosen once, here, from the filesystem.
    """

    fs: fsspec.AbstractFileSystem
    path: str
    url: str
    backend: FsspecBackend = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.backend is None:
            object.__setattr__(self, "backend", backend_for(self.fs))

    @property
    def is_local(self) -> bool:
        return self.backend.is_local

    def same_place(self, other: Location) -> bool:
        """Both name the same root on the same kind of storage."""
        return self.backend.same_store(other.backend) and self.path == other.path


def resolve(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Location:
    """Turn a URL (`/data/ckpt`, `file://…`, `s3://bucket/run`, `memory://x`) into a Location."""
    text = os.fspath(url)
    if not text:
        raise StorageUnavailable("checkpoint location is empty; set dirpath to a local path or an fsspec URL")
    protocol = fsspec.core.split_protocol(text)[0]
    options = backend_class_for_url(protocol).options_for(text, dict(storage_options or {}))
    try:
        fs, path = fsspec.core.url_to_fs(text, **options)
    except (ImportError, ValueError) as err:
        raise StorageUnavailable(
            f"cannot open storage for {text!r}: {err}. For s3:// install the extra: pip install 'lightning_shardckpt[s3]'"
        ) from err
    backend = backend_for(fs)
    backend.on_resolved()
    return Location(fs=fs, path=backend.normalise_path(path).rstrip("/") or "/", url=text, backend=backend)


def protocol_of(url: str | os.PathLike[str]) -> str:
    """The kind of storage a URL names, without opening it: `file` for a plain or `file://`/`local://` path."""
    protocol = fsspec.core.split_protocol(os.fspath(url))[0]
    return "file" if protocol in (None, "file", "local") else protocol


def create_if_absent(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write `data` to `path` atomically, or raise FileExistsError if `path` exists.

    Readers never observe a partial file: on local disks the bytes go to a temp name first and are
    hard-linked into place (link fails rather than overwrite); on S3 the put is conditional
    (`If-None-Match: *`, on the single PUT or on CompleteMultipartUpload), so the server refuses to
    replace an existing object. Callers holding a Location call `location.backend` directly.
    """
    backend_for(fs).create_if_absent(path, data)


def replace_small_file(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Replace a small file in one step (used for `latest`, which readers never trust on its own)."""
    backend_for(fs).replace_small_file(path, data)


def write_new_file(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write a file that belongs to an uncommitted directory (no one reads it before the commit)."""
    backend_for(fs).write_new_file(path, data)


def read_small(fs: fsspec.AbstractFileSystem, path: str, max_bytes: int) -> bytes:
    """A small file of a root (record, pointer, manifest, lease), retried: regular files only, at most `max_bytes`
    (small_files.py; SmallFileRefused otherwise). Callers holding a Location may pass `location.fs`."""
    backend = backend_for(fs)
    return retry.call("read", lambda: backend.read_small(path, max_bytes), target=path)


def read_range(fs: fsspec.AbstractFileSystem, path: str, start: int, length: int) -> bytes:
    data: bytes = retry.call("read_range", lambda: fs.cat_file(path, start=start, end=start + length), target=path)
    return data  # fsspec is untyped: cat_file's bytes are Any to mypy


def makedirs(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Create a directory where directories exist; on object stores do nothing (and never create a bucket)."""
    backend_for(fs).makedirs(path)


def preflight(location: Location) -> None:
    """Check, before training starts, that checkpoints can be committed under `location`.

    Writes a probe object `ROOT/.probe-<uuid>` with create-if-absent, checks that a second create of it
    is refused (a store that ignores `If-None-Match` would let two writers both "commit"), reads it
    back, lists the root (the catalog finds checkpoints by listing) and deletes it. Raises
    StorageUnavailable naming the URL, what failed and the fix. Cheap: five small requests.
    """
    probe = join(location.path, f"{PROBE_PREFIX}{uuid.uuid4().hex}")
    payload = f"lightning_shardckpt preflight {uuid.uuid4().hex}\n".encode()
    # one attempt of ours: botocore and s3fs already retry each request, and a wrong endpoint should fail
    # in seconds, not after our retries multiplied theirs
    with retry.using(retry.RetryPolicy(attempts=1)):
        _probe(location, probe, payload)


def _probe(location: Location, probe: str, payload: bytes) -> None:
    fs, backend = location.fs, location.backend
    action = "create the root"
    written = False
    try:
        backend.makedirs(location.path)
        action = "write a probe object"
        backend.create_if_absent(probe, payload)
        written = True
        action = "check conditional create"
        try:
            backend.create_if_absent(probe, payload + b"second writer\n")
        except FileExistsError:
            pass
        else:
            raise StorageUnavailable(
                f"{location.url}: the storage replaced an existing object although the write was conditional "
                "(If-None-Match: *); the commit protocol needs conditional creates. Use AWS S3 or an "
                "S3-compatible store that enforces them"
            )
        action = "read the probe object back"
        if fs.cat_file(probe) != payload:
            raise StorageUnavailable(f"{location.url}: a probe object read back other bytes than were written")
        action = "list the root"
        fs.ls(location.path, detail=False)
        action = "delete the probe object"
        fs.rm_file(probe)
        written = False
    except StorageUnavailable:
        raise
    except Exception as err:
        raise StorageUnavailable(location.backend.explain(location.url, location.path, action, err)) from err
    finally:
        if written:
            _remove_quietly(fs, probe)


def open_shard(fs: fsspec.AbstractFileSystem, path: str, direct_io: bool = False) -> Any:
    """A shard file created for writing; `direct_io`: past the page cache where the storage allows it."""
    return backend_for(fs).open_shard(path, direct_io)


def abort_write(handle: Any) -> None:
    """Abandon a file being written: on S3 abort its multipart upload instead of committing a partial object."""
    fs = getattr(handle, "fs", None)
    if fs is not None:
        backend_for(fs).abort_write(handle)
        return
    try:
        handle.close()
    except Exception:
        log.debug("closing a failed file raised", exc_info=True)


def sync_local_file(handle: Any) -> None:
    """fsync a file object when it is a local file; object stores are durable on close.

    Only "this file has no descriptor" is passed over (an object store's file: AttributeError, or
    io.UnsupportedOperation, a ValueError). A flush or fsync that fails (EIO, or ENOSPC a filesystem with delayed
    allocation reports only now) raises: the file is not durable and its checkpoint must not commit."""
    try:
        descriptor = handle.fileno()
    except (AttributeError, ValueError):
        return
    handle.flush()
    os.fsync(descriptor)


def _remove_quietly(fs: fsspec.AbstractFileSystem, path: str) -> None:
    try:
        fs.rm_file(path)
    except Exception:
        log.debug("could not remove probe %s", path, exc_info=True)


def written_at(info: dict[str, Any]) -> float:
    """A listed entry's modification time in seconds since the epoch (local disks give `mtime`, object stores
    `LastModified`); 0 when the listing says nothing."""
    value = info.get("mtime", info.get("LastModified", info.get("last_modified", 0.0)))
    return value.timestamp() if hasattr(value, "timestamp") else float(value or 0.0)
