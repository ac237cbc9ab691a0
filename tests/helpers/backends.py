"""Where a test's checkpoint root lives, local disk or S3 (moto on loopback), behind one picklable object.

Spawned ranks get a `Backend` as an argument, so they reach the same root with the same
`storage_options` as the test process (S3 ranks talk to the session's moto server over HTTP).

The storage effects of the fault matrix go through the backend, because some of them exist only on
one kind of storage:
- a flipped byte: rewritten in place on a local disk; on S3 an object cannot be changed in place, so
  it is read, modified and put back whole through the fsspec filesystem;
- an interrupted manifest write: on a local disk the half-written temp file that `create_if_absent`
  links into place; on S3 a conditional PUT whose body never finished (the server discards it: nothing
  visible), or a multipart upload that was started and never completed (also invisible, but it stays
  pending in `ListMultipartUploads` until aborted: the S3 analogue of the temp file left behind).
"""

from __future__ import annotations

import http.client
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from lightning_shardckpt import LoadConfig, SaveConfig
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.engine.storage.fsio import Location

LOCAL, S3 = "local", "s3"


@dataclass(frozen=True)
class Backend:
    """A checkpoint root and how to reach it; picklable, so it travels to spawned ranks."""

    name: str  # LOCAL | S3
    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    @property
    def is_s3(self) -> bool:
        return self.name == S3

    def location(self) -> Location:
        return fsio.resolve(self.url, self.storage_options or None)

    def save_config(self, **kwargs: Any) -> SaveConfig:
        return SaveConfig(storage_options=dict(self.storage_options), **kwargs)

    def load_config(self, **kwargs: Any) -> LoadConfig:
        return LoadConfig(storage_options=dict(self.storage_options), **kwargs)

    def with_options(self, **extra: Any) -> Backend:
        """The same root reached with other options (e.g. through a fault proxy, without HTTP retries)."""
        return Backend(self.name, self.url, {**self.storage_options, **extra})


def names(location: Location, directory: str) -> list[str]:
    """Base names directly under `directory` (files and sub-directories / key prefixes), sorted."""
    return sorted(path.rstrip("/").rsplit("/", 1)[-1] for path in location.fs.ls(directory, detail=False))


def flip_one_byte(location: Location, path: str) -> None:
    """Storage returns other bytes than were written: the middle byte of `path` is inverted."""
    fs = location.fs
    if location.is_local:
        with open(path, "r+b") as handle:  # in place, as a bad disk or a bit flip would
            middle = os.path.getsize(path) // 2
            handle.seek(middle)
            byte = handle.read(1)
            handle.seek(middle)
            handle.write(bytes([byte[0] ^ 0xFF]))
        return
    data = bytearray(fs.cat_file(path))  # objects are immutable: read, modify, put back whole
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))


def bucket_and_key(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


def start_put_and_never_finish(endpoint_url: str, path: str, body: bytes) -> http.client.HTTPConnection:
    """Send a conditional PUT (`If-None-Match: *`) of `body` to S3 but only half its bytes, and return the
    open connection. Closing it, or the process dying, drops the request: S3 stores nothing.

    Sent unsigned over plain HTTP: moto accepts any request unless told to enforce auth.
    """
    endpoint = urlsplit(endpoint_url)
    conn = http.client.HTTPConnection(endpoint.hostname, endpoint.port, timeout=10)
    conn.putrequest("PUT", "/" + path, skip_accept_encoding=True)
    conn.putheader("Content-Length", str(len(body)))
    conn.putheader("If-None-Match", "*")
    conn.putheader("Content-Type", "application/json")
    conn.endheaders()
    conn.send(body[: len(body) // 2])
    return conn


def abandon_multipart_upload(location: Location, path: str, part: bytes) -> str:
    """Start a multipart upload of `path`, upload one part, never complete it; return its upload id.

    What a coordinator dying inside a multipart create (manifests above twice `fsio.MULTIPART_CHUNK_BYTES`)
    leaves behind: no object at `path`, one pending upload.
    """
    bucket, key = bucket_and_key(path)
    fs = location.fs
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=part)
    return upload["UploadId"]


def pending_uploads(location: Location, under: str) -> list[str]:
    """Keys (relative to `under`) of multipart uploads started below `under` and neither completed nor aborted."""
    if location.is_local:
        return []
    bucket, prefix = bucket_and_key(under.rstrip("/") + "/")
    response = location.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    return sorted(upload["Key"][len(prefix) :] for upload in response.get("Uploads", []))


def abort_pending_uploads(location: Location, under: str) -> int:
    """Abort every pending multipart upload below `under` (what a bucket lifecycle rule does); return how many."""
    if location.is_local:
        return 0
    bucket, prefix = bucket_and_key(under.rstrip("/") + "/")
    uploads = location.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    for upload in uploads:
        location.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    return len(uploads)


# botocore's own per-request retries off: an injected error reaches s3fs and our retry layer at once
NO_HTTP_RETRIES = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}


def fault_after(armed_by: Any, method: str, pattern: str, **kwargs: Any) -> Any:
    """A FaultProxy rule that matches only once `armed_by` has fired: aims at a request whose path is not
    unique to one checkpoint (e.g. `ROOT/latest`) by the request that must precede it.
    Append the result to `proxy.faults`."""
    from tests.helpers.s3_server import Fault

    class FaultAfter(Fault):
        def matches(self, method: str, path: str) -> bool:
            return armed_by.hits > 0 and super().matches(method, path)

    return FaultAfter(method, pattern, **kwargs)
