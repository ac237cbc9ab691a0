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
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ...errors import StorageUnavailable
from ..format.checksum import checksum
from ..format.layout import join
from . import retry

log = logging.getLogger(__name__)

# MemoryFileSystem is shared by every instance in the process; one lock makes its create atomic.
_MEMORY_CREATE_LOCK = threading.Lock()
# Protocols whose "directories" are key prefixes: no mkdir, no rename, listings only for discovery.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})
# A conditional create larger than twice this is a multipart upload (If-None-Match on its completion).
MULTIPART_CHUNK_BYTES = 50 * 2**20  # s3fs's default part size; S3 allows 5 MiB .. 5 GiB
PROBE_PREFIX = ".probe-"  # preflight's probe objects: ROOT/.probe-<uuid>, deleted right away
_HOOK_ID = "lightning_shardckpt.count_http_retries"


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
    options = dict(storage_options or {})
    protocol = fsspec.core.split_protocol(text)[0]
    if protocol in OBJECT_STORE_PROTOCOLS:
        if options.get("use_listings_cache"):
            log.warning(
                "%s: ignoring use_listings_cache=True: a cached listing hides checkpoints other processes commit", text
            )
        # never cache listings: the catalog must see what other processes committed since the last look
        options["use_listings_cache"] = False
    try:
        fs, path = fsspec.core.url_to_fs(text, **options)
    except (ImportError, ValueError) as err:
        raise StorageUnavailable(
            f"cannot open storage for {text!r}: {err}. For s3:// install the extra: pip install 'lightning_shardckpt[s3]'"
        ) from err
    if isinstance(fs, LocalFileSystem):
        path = os.path.abspath(path)
    _count_s3_http_retries(fs)
    return Location(fs=fs, path=path.rstrip("/") or "/", url=text)


def is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return any(p in OBJECT_STORE_PROTOCOLS for p in protocols)


def create_if_absent(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write `data` to `path` atomically, or raise FileExistsError if `path` exists.

    Readers never observe a partial file: on local disks the bytes go to a temp name first and are
    hard-linked into place (link fails rather than overwrite); on S3 the put is conditional
    (`If-None-Match: *`, on the single PUT or on CompleteMultipartUpload), so the server refuses to
    replace an existing object.
    """
    if isinstance(fs, LocalFileSystem):
        _local_create_if_absent(path, data)
        return
    if isinstance(fs, MemoryFileSystem):
        with _MEMORY_CREATE_LOCK:
            if fs.exists(path):
                raise FileExistsError(path)
            fs.pipe_file(path, data)
        return
    try:
        retry.call("create_if_absent", lambda: _conditional_put(fs, path, data), target=path)
    except FileExistsError:
        # A create whose response was lost (timeout, 5xx after the object landed) is retried, by botocore,
        # s3fs or us, and then meets its own object: 412. The same bytes mean the first try won.
        if _stored_checksum(fs, path) == checksum(data):
            retry.counters.add("recovered.create_if_absent")
            log.warning("%s: a retried conditional create found its own earlier write; treating it as created", path)
            return
        raise


def replace_small_file(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Replace a small file in one step (used for `latest`, which readers never trust on its own)."""
    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        _write_fsync(tmp, data)
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path))
    else:
        # an S3 PUT replaces the whole object at once: readers see the old or the new pointer, never half
        retry.call("put", lambda: fs.pipe_file(path, data), target=path)


def write_new_file(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write a file that belongs to an uncommitted directory (no one reads it before the commit)."""
    if isinstance(fs, LocalFileSystem):
        _write_fsync(path, data)
    else:
        retry.call("put", lambda: fs.pipe_file(path, data), target=path)


def read_range(fs: fsspec.AbstractFileSystem, path: str, start: int, length: int) -> bytes:
    return retry.call("read_range", lambda: fs.cat_file(path, start=start, end=start + length), target=path)


def makedirs(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Create a directory where directories exist; on object stores do nothing (and never create a bucket)."""
    if is_object_store(fs):
        return  # keys need no parent; s3fs's makedirs would create a missing bucket, hiding a typo
    try:
        fs.makedirs(path, exist_ok=True)
    except PermissionError as err:
        raise StorageUnavailable(f"cannot create {path!r}: permission denied; choose a writable dirpath") from err


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
    fs = location.fs
    action = "create the root"
    written = False
    try:
        makedirs(fs, location.path)
        action = "write a probe object"
        create_if_absent(fs, probe, payload)
        written = True
        action = "check conditional create"
        try:
            create_if_absent(fs, probe, payload + b"second writer\n")
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
        raise StorageUnavailable(_explain(location, action, err)) from err
    finally:
        if written:
            _remove_quietly(fs, probe)


def abort_write(handle: Any) -> None:
    """Abandon a file being written: on S3 abort its multipart upload instead of committing a partial object."""
    discard, fs = getattr(handle, "discard", None), getattr(handle, "fs", None)
    if discard is not None and fs is not None and is_object_store(fs):
        try:
            discard()
        except Exception:  # the directory stays uncommitted either way; a lifecycle rule reaps the upload
            log.debug("aborting the upload of %s failed", getattr(handle, "path", handle), exc_info=True)
        handle.closed = True  # a close() now would try to commit what was discarded
        return
    try:
        handle.close()
    except Exception:
        log.debug("closing a failed file raised", exc_info=True)


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


def _is_s3(fs: Any) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "s3" in protocols


def _conditional_put(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    if _is_s3(fs):
        if "mode" not in inspect.signature(type(fs)._pipe_file).parameters:
            # older s3fs has no conditional create: an unconditional put could overwrite a committed manifest
            raise StorageUnavailable(
                f"s3fs {getattr(sys.modules.get('s3fs'), '__version__', '?')} cannot create an object only if absent "
                "(If-None-Match: *), which the commit needs; upgrade it: pip install 'lightning_shardckpt[s3]'"
            )
        try:
            # one PUT (or CompleteMultipartUpload above 100 MiB) with If-None-Match: *; s3fs aborts the
            # upload when the condition fails. Its open(path, "xb") sends the same header but leaves a
            # failed multipart upload behind, so the put goes through pipe_file.
            fs.pipe_file(path, data, mode="create", chunksize=MULTIPART_CHUNK_BYTES)
        except OSError as err:
            # s3fs turns 412 into FileExistsError only when the server names the If-None-Match condition
            if not isinstance(err, FileExistsError) and _error_code(err) in ("PreconditionFailed", "412"):
                raise FileExistsError(errno.EEXIST, f"{path} already exists (412 PreconditionFailed)", path) from err
            raise
    else:
        with fs.open(path, "xb") as handle:  # gcsfs and others: exclusive create on the server
            handle.write(data)


def _stored_checksum(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    try:
        return checksum(retry.call("read", lambda: fs.cat_file(path), target=path))
    except FileNotFoundError:
        return None


def _count_s3_http_retries(fs: Any) -> None:
    """Make botocore's per-request retries visible in `retry.counters` (they are silent otherwise)."""
    if not _is_s3(fs) or getattr(fs, "asynchronous", False):
        return
    try:
        client = fs.connect()
        client.meta.events.register("after-call.s3", retry.record_http_retries, unique_id=_HOOK_ID)
    except Exception:  # counting is a nicety; the first real request reports any connection problem
        log.debug("could not hook botocore's retry counter", exc_info=True)


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


def _explain(location: Location, action: str, err: BaseException) -> str:
    """A message for StorageUnavailable: the URL, what failed and how to fix it."""
    url, fs = location.url, location.fs
    code = _error_code(err)
    detail = f"{type(err).__name__}: {err}" + (f" [{code}]" if code else "")
    if not is_object_store(fs):
        if isinstance(err, PermissionError):
            return f"cannot {action} in {url}: permission denied; choose a writable dirpath ({detail})"
        return f"cannot {action} in {url}: {detail}; choose a writable dirpath"
    bucket = location.path.split("/", 1)[0]
    endpoint = getattr(fs, "endpoint_url", None) or "the default endpoint"
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


def _error_code(err: BaseException) -> str | None:
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


def _remove_quietly(fs: fsspec.AbstractFileSystem, path: str) -> None:
    try:
        fs.rm_file(path)
    except Exception:
        log.debug("could not remove probe %s", path, exc_info=True)
