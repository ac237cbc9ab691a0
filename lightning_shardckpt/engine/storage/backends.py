"""What differs per kind of storage, one class per kind, chosen once when a location is resolved.

The commit protocol asks of storage what `fsio` lists (create-if-absent, one-step replace of a small
file); how each kind of storage gives it differs, and so do a few other things: whether directories
exist, how a failed write is abandoned, how small files are read fastest, what a failure means for the
person who has to fix it. Each kind answers those here, so no caller asks "is this S3?":

- `LocalBackend`: POSIX disks. Temp file + `link()` for create-if-absent, temp file + `os.replace` for
  a replace, fsync of files and directories, `stat`/`open` instead of fsspec's per-file overhead.
- `S3Backend`: conditional puts (`If-None-Match: *`), no directories, no rename, listings never cached,
  botocore's silent retries counted.
- `ObjectStoreBackend`: other object stores (gcs, azure, ...): no directories, exclusive create on the
  server through fsspec's `open(path, "xb")`.
- `MemoryBackend`: fsspec's in-process memory filesystem (tests): create-if-absent under one lock.
- `FsspecBackend`: any other fsspec filesystem, through fsspec's generic calls.

`backend_for(fs)` picks the class; `fsio.resolve` calls it once and keeps the result on the Location.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import sys
import threading
import time
import uuid
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ...errors import StorageUnavailable
from ..format.checksum import checksum
from . import direct_file, retry, small_files, span_reads

log = logging.getLogger(__name__)

# Protocols whose "directories" are key prefixes: no mkdir, no rename, listings only for discovery.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})
_HOOK_ID = "lightning_shardckpt.count_http_retries"


class FsspecBackend:
    """Any fsspec filesystem: directories exist, writes go through fsspec's generic calls."""

    name: ClassVar[str] = "fsspec"
    is_local: ClassVar[bool] = False  # paths are OS paths: os.stat, os.open and symlinks apply
    has_directories: ClassVar[bool] = True  # False: a "directory" is a key prefix, gone with its last object

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs

    @classmethod
    def options_for(cls, url: str, options: dict[str, Any]) -> dict[str, Any]:
        """storage_options to open `url` with (before the filesystem exists)."""
        return options

    def on_resolved(self) -> None:
        """Called once by fsio.resolve on the new filesystem."""

    def normalise_path(self, path: str) -> str:
        return path

    def same_store(self, other: FsspecBackend) -> bool:
        """Both reach the same storage service kind (paths then compare as they are)."""
        return self.fs.protocol == other.fs.protocol

    # --- writes the commit protocol relies on ---

    def create_if_absent(self, path: str, data: bytes) -> None:
        """Write `data` to `path` atomically, or raise FileExistsError if `path` exists."""
        try:
            retry.call("create_if_absent", lambda: self._exclusive_create(path, data), target=path)
        except FileExistsError:
            # A create whose response was lost (timeout, 5xx after the object landed) is retried, by botocore,
            # s3fs or us, and then meets its own object: 412. The same bytes mean the first try won.
            if self._stored_checksum(path) == checksum(data):
                retry.counters.add("recovered.create_if_absent")
                log.warning(
                    "%s: a retried conditional create found its own earlier write; treating it as created", path
                )
                return
            raise

    def _exclusive_create(self, path: str, data: bytes) -> None:
        with self.fs.open(path, "xb") as handle:  # gcsfs and others: exclusive create on the server
            handle.write(data)

    def replace_small_file(self, path: str, data: bytes) -> None:
        """Replace a small file in one step (a whole-object put: readers see the old or the new bytes)."""
        retry.call("put", lambda: self.fs.pipe_file(path, data), target=path)

    def write_new_file(self, path: str, data: bytes) -> None:
        """Write a file of an uncommitted directory (no one reads it before the commit)."""
        retry.call("put", lambda: self.fs.pipe_file(path, data), target=path)

    # a crash may lose these two: where the backend has fsyncs (a local disk), they are skipped
    def create_if_absent_not_durable(self, path: str, data: bytes) -> None:
        """create_if_absent of a file nothing depends on surviving a crash (an event)."""
        self.create_if_absent(path, data)

    def replace_hint(self, path: str, data: bytes) -> None:
        """replace_small_file of a hint readers never trust alone (`latest`): stale, empty or missing is fine."""
        self.replace_small_file(path, data)

    def makedirs(self, path: str) -> None:
        try:
            self.fs.makedirs(path, exist_ok=True)
        except PermissionError as err:
            raise StorageUnavailable(f"cannot create {path!r}: permission denied; choose a writable dirpath") from err

    def open_shard(self, path: str, direct_io: bool) -> Any:
        """A shard file created for writing (`direct_io`: past the page cache where the storage allows it)."""
        return self.fs.open(path, "wb")

    def abort_write(self, handle: Any) -> None:
        """Abandon a file being written: closed, then removed, so no partial or damaged bytes stay under its name (a
        verified copy promises that: engine/tiers/verified_copy.py). Opening it for writing already replaced what
        the name held, so removing it loses nothing. Object stores override this: there the upload is aborted and
        the name keeps what it held before."""
        try:
            handle.close()
        except Exception:
            log.debug("closing a failed file raised", exc_info=True)
        path = getattr(handle, "path", None)
        if not isinstance(path, str):
            return
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass
        except Exception:  # it stays in an uncommitted directory, which retention removes
            log.debug("could not remove the abandoned file %s", path, exc_info=True)

    # --- reads ---

    def probe_files(self, paths: list[str], max_bytes: int | None = None) -> list[Any]:
        """Per path: bytes when the file exists, else the exception (FileNotFoundError, IsADirectoryError, ...;
        locally, where it costs nothing, SmallFileRefused for a file `read_small` would refuse, `max_bytes` its
        bound)."""
        return self.fs.cat_ranges(paths, [0] * len(paths), [1] * len(paths), on_error="return")

    def read_small(self, path: str, max_bytes: int) -> bytes:
        """The bytes of a small file of a root (a record, a pointer, a manifest, a lease): at most `max_bytes + 1`
        read, SmallFileRefused when it holds more, is not a regular file or is a symlink (small_files.py).
        The one read every metadata reader goes through; not retried here (callers use fsio.read_small)."""
        data = self.fs.cat_file(path, start=0, end=max_bytes + 1)
        return small_files.bounded(path, data, max_bytes)

    def read_small_files(self, paths: list[str], max_bytes: int) -> dict[str, Any]:
        """Path -> bytes or the exception reading it raised (concurrent on object stores), each read as
        `read_small` reads one."""
        results = self.fs.cat_ranges(paths, [0] * len(paths), [max_bytes + 1] * len(paths), on_error="return")
        return {path: _bounded_or_error(path, result, max_bytes) for path, result in zip(paths, results)}

    @property
    def reads_with_preadv(self) -> bool:
        """Shard files are read with os.preadv on a file descriptor instead of fsspec range reads."""
        return False

    def open_span(self, path: str, start: int, stop: int) -> span_reads.Span:
        """Bytes [start, stop) of `path`, streamed, with the file's size on storage (span_reads.py):
        here one size call and one range read per piece, what any fsspec filesystem allows."""
        return span_reads.PieceSpan(self.fs, path, start, stop)

    def directory_age_s(self, path: str) -> float | None:
        """Seconds since `path` (a directory) changed, where storage keeps that for directories."""
        return None

    # --- failures ---

    def explain(self, url: str, path: str, action: str, err: BaseException) -> str:
        """A message for StorageUnavailable: the URL, what failed and how to fix it."""
        detail = describe(err)
        if isinstance(err, PermissionError):
            return f"cannot {action} in {url}: permission denied; choose a writable dirpath ({detail})"
        return f"cannot {action} in {url}: {detail}; choose a writable dirpath"

    def _stored_checksum(self, path: str) -> str | None:
        try:
            return checksum(retry.call("read", lambda: self.fs.cat_file(path), target=path))
        except FileNotFoundError:
            return None


class LocalBackend(FsspecBackend):
    """A POSIX filesystem: link() for create-if-absent, os.replace for a replace, fsync throughout."""

    name = "local"
    is_local = True

    def normalise_path(self, path: str) -> str:
        return os.path.abspath(path)

    def open_shard(self, path: str, direct_io: bool) -> Any:
        """With `direct_io`, O_DIRECT where the disk takes it (direct_file.py); buffered otherwise, and always
        through a filesystem class that opens files its own way (a subclass overriding `_open`: it wraps them)."""
        opens_plainly = type(self.fs)._open is LocalFileSystem._open
        direct = direct_file.open_direct(path) if direct_io and opens_plainly else None
        return direct if direct is not None else super().open_shard(path, direct_io)

    def create_if_absent(self, path: str, data: bytes) -> None:
        """Readers never see a partial file: the bytes go to a temp name first and are hard-linked into place."""
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        _write_fsync(tmp, data)
        try:
            # link() refuses to replace an existing name: the atomic create-if-absent of POSIX.
            os.link(tmp, path)
        finally:
            os.unlink(tmp)
        _fsync_dir(directory)

    def replace_small_file(self, path: str, data: bytes) -> None:
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        _write_fsync(tmp, data)
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path))

    def write_new_file(self, path: str, data: bytes) -> None:
        _write_fsync(path, data)

    def create_if_absent_not_durable(self, path: str, data: bytes) -> None:
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as handle:
            handle.write(data)
        try:
            os.link(tmp, path)  # still atomic and still refusing to replace: only the fsyncs are left out
        finally:
            os.unlink(tmp)

    def replace_hint(self, path: str, data: bytes) -> None:
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)  # readers see the old name or the new one, never a partial file

    def probe_files(self, paths: list[str], max_bytes: int | None = None) -> list[Any]:
        # lstat first: a symlink or a FIFO is refused, never followed or opened (fsspec's open of a FIFO blocks)
        checked = [_stat_local(path, max_bytes) for path in paths]
        if self._plain:
            return checked  # fsspec's per-file open costs more than the read itself: the lstat answers
        readable = [path for path, result in zip(paths, checked) if not isinstance(result, BaseException)]
        probed = iter(super().probe_files(readable))
        return [result if isinstance(result, BaseException) else next(probed) for result in checked]

    def read_small(self, path: str, max_bytes: int) -> bytes:
        if not self._plain:
            # a FIFO or a link is refused before fsspec opens it; and fsspec's local read allocates all it is
            # asked for up front, so it is asked for what the file holds (+1: a file grown meanwhile is refused)
            size = small_files.check_local(path, max_bytes)
            return super().read_small(path, min(size, max_bytes))
        return small_files.read_local(path, max_bytes)

    def read_small_files(self, paths: list[str], max_bytes: int) -> dict[str, Any]:
        return {path: _read_local(self, path, max_bytes) for path in paths}

    @property
    def _plain(self) -> bool:
        # only the plain local filesystem is read around fsspec: a subclass (a test's counting or quota
        # filesystem, a wrapper) may change how bytes are read, so it is read through fsspec like a remote store
        return type(self.fs) is LocalFileSystem

    @property
    def reads_with_preadv(self) -> bool:
        return self._plain and hasattr(os, "preadv")

    def open_span(self, path: str, start: int, stop: int) -> span_reads.Span:
        if not self.reads_with_preadv:
            return super().open_span(path, start, stop)
        return span_reads.FileSpan(path, start, stop)

    def directory_age_s(self, path: str) -> float | None:
        try:
            return time.time() - os.stat(path).st_mtime
        except FileNotFoundError:
            return None


class MemoryBackend(FsspecBackend):
    """fsspec's memory filesystem (tests): one store per process, so one lock makes a create atomic."""

    name = "memory"
    _create_lock: ClassVar[threading.Lock] = threading.Lock()

    def create_if_absent(self, path: str, data: bytes) -> None:
        with self._create_lock:
            if self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(path, data)


class ObjectStoreBackend(FsspecBackend):
    """An object store: directories are key prefixes, listings are never cached, writes never rename."""

    name = "object-store"
    has_directories = False

    @classmethod
    def options_for(cls, url: str, options: dict[str, Any]) -> dict[str, Any]:
        if options.get("use_listings_cache"):
            log.warning(
                "%s: ignoring use_listings_cache=True: a cached listing hides checkpoints other processes commit", url
            )
        # never cache listings: the catalog must see what other processes committed since the last look
        return {**options, "use_listings_cache": False}

    def makedirs(self, path: str) -> None:
        """Keys need no parent; s3fs's makedirs would create a missing bucket, hiding a typo."""

    def abort_write(self, handle: Any) -> None:
        """Abort the multipart upload instead of committing a partial object."""
        discard = getattr(handle, "discard", None)
        if discard is None:
            super().abort_write(handle)
            return
        try:
            discard()
        except Exception:  # the directory stays uncommitted either way; a lifecycle rule reaps the upload
            log.debug("aborting the upload of %s failed", getattr(handle, "path", handle), exc_info=True)
        handle.closed = True  # a close() now would try to commit what was discarded

    def explain(self, url: str, path: str, action: str, err: BaseException) -> str:
        code = error_code(err)
        detail = describe(err)
        bucket = path.split("/", 1)[0]
        endpoint = getattr(self.fs, "endpoint_url", None) or "the default endpoint"
        if code == "NoSuchBucket":
            return f"{url}: bucket {bucket!r} does not exist: create it or fix dirpath"
        if code in _CREDENTIAL_CODES or _has_class(err, _NO_CREDENTIALS):
            return f"{url}: credentials rejected by {endpoint} ({detail}): set storage_options key/secret or AWS_* env vars"
        if isinstance(err, PermissionError) or code in ("AccessDenied", "AllAccessDisabled"):
            return (
                f"{url}: access denied when trying to {action} ({detail}): the credentials need s3:PutObject, "
                f"s3:GetObject, s3:DeleteObject and s3:ListBucket on bucket {bucket!r}"
            )
        if retry.is_transient(err):
            return f"{url}: cannot reach {endpoint} ({detail}): check endpoint_url, the network and the service status"
        return f"{url}: cannot {action} ({detail})"


class S3Backend(ObjectStoreBackend):
    """S3 through s3fs: create-if-absent is a conditional put (If-None-Match: *)."""

    name = "s3"
    # A conditional create larger than twice this is a multipart upload (If-None-Match on its completion).
    multipart_chunk_bytes: ClassVar[int] = 50 * 2**20  # s3fs's default part size; S3 allows 5 MiB .. 5 GiB

    def on_resolved(self) -> None:
        """Make botocore's per-request retries visible in `retry.counters` (they are silent otherwise)."""
        if getattr(self.fs, "asynchronous", False):
            return
        try:
            client = self.fs.connect()
            client.meta.events.register("after-call.s3", retry.record_http_retries, unique_id=_HOOK_ID)
        except Exception:  # counting is a nicety; the first real request reports any connection problem
            log.debug("could not hook botocore's retry counter", exc_info=True)

    def open_span(self, path: str, start: int, stop: int) -> span_reads.Span:
        """One ranged GET, whatever the span's length; the object's size from its Content-Range (no HEAD)."""
        try:
            return span_reads.S3Span(self.fs, path, start, stop)
        except OSError as err:
            if error_code(err) not in ("InvalidRange", "416"):
                raise
            # the span starts at or past the object's end (416, which names no size): it reads short, and one HEAD
            # gives the size, so the caller names the truncation
            return span_reads.EmptySpan(int(self.fs.size(path)))

    def _exclusive_create(self, path: str, data: bytes) -> None:
        if "mode" not in inspect.signature(type(self.fs)._pipe_file).parameters:
            # older s3fs has no conditional create: an unconditional put could overwrite a committed manifest
            raise StorageUnavailable(
                f"s3fs {getattr(sys.modules.get('s3fs'), '__version__', '?')} cannot create an object only if absent "
                "(If-None-Match: *), which the commit needs; upgrade it: pip install 'lightning_shardckpt[s3]'"
            )
        try:
            # one PUT (or CompleteMultipartUpload above 100 MiB) with If-None-Match: *; s3fs aborts the
            # upload when the condition fails. Its open(path, "xb") sends the same header but leaves a
            # failed multipart upload behind, so the put goes through pipe_file.
            self.fs.pipe_file(path, data, mode="create", chunksize=self.multipart_chunk_bytes)
        except OSError as err:
            # s3fs turns 412 into FileExistsError only when the server names the If-None-Match condition
            if not isinstance(err, FileExistsError) and error_code(err) in ("PreconditionFailed", "412"):
                raise FileExistsError(errno.EEXIST, f"{path} already exists (412 PreconditionFailed)", path) from err
            raise


def _protocols(fs: Any) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def backend_class_for_url(protocol: str | None) -> type[FsspecBackend]:
    """The backend class for a URL's protocol, before its filesystem exists (to choose storage_options)."""
    return ObjectStoreBackend if protocol in OBJECT_STORE_PROTOCOLS else FsspecBackend


def backend_for(fs: fsspec.AbstractFileSystem) -> FsspecBackend:
    """The one place that tells kinds of storage apart."""
    if isinstance(fs, LocalFileSystem):
        return LocalBackend(fs)
    if isinstance(fs, MemoryFileSystem):
        return MemoryBackend(fs)
    protocols = _protocols(fs)
    if "s3" in protocols:
        return S3Backend(fs)
    if any(p in OBJECT_STORE_PROTOCOLS for p in protocols):
        return ObjectStoreBackend(fs)
    return FsspecBackend(fs)


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


def _stat_local(path: str, max_bytes: int | None) -> Any:
    try:
        small_files.check_local(path, max_bytes)  # lstat: a symlink or a FIFO is refused, never followed or opened
        return b""
    except (FileNotFoundError, NotADirectoryError) as err:
        return FileNotFoundError(str(err)) if isinstance(err, NotADirectoryError) else err
    except OSError as err:
        return err


def _read_local(backend: LocalBackend, path: str, max_bytes: int) -> Any:
    try:
        return backend.read_small(path, max_bytes)
    except OSError as err:
        return err


def _bounded_or_error(path: str, result: Any, max_bytes: int) -> Any:
    if isinstance(result, BaseException):
        return result
    try:
        return small_files.bounded(path, result, max_bytes)
    except small_files.SmallFileRefused as err:
        return err


_CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "AuthorizationHeaderMalformed",
    }
)
_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError")


def describe(err: BaseException) -> str:
    code = error_code(err)
    return f"{type(err).__name__}: {err}" + (f" [{code}]" if code else "")


def error_code(err: BaseException) -> str | None:
    """The S3 error code of `err` or of the botocore error it was translated from."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict) and (response.get("Error") or {}).get("Code"):
            return str(response["Error"]["Code"])
        current = current.__cause__ or current.__context__
    return None


def _has_class(err: BaseException, names: tuple[str, ...]) -> bool:
    current: BaseException | None = err
    while current is not None:
        if any(cls.__name__ in names for cls in type(current).__mro__):
            return True
        current = current.__cause__
    return False
