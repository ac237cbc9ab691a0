"""One contiguous byte range of a stored file, streamed, with the file's size as storage states it.

What the read-back before commit needs (writer.py): the bytes of one span of its shard file, hashed piece by
piece as they arrive, and the file's size on storage, to check the upload was not cut short. How many requests
that costs is each kind of storage's business, answered by its backend's `open_span` (backends.py):
- `FileSpan`: a plain local file: `pread` on one descriptor, the size from `fstat`; no request at all.
- `S3Span`: one ranged GET whose body streams through the caller's buffer; the size is the total of the
  response's `Content-Range` (`bytes a-b/SIZE`), so the size check needs no HEAD. 1 request per span,
  however long the span, where reading it in pieces cost one GET per piece plus a HEAD.
- `PieceSpan`: any other fsspec filesystem: the size from `fs.size` (one metadata call), the bytes by one
  range read per piece, as before.
A span past the end of the file reads short; the caller names the short read (a truncated upload). Nothing here
retries: the caller retries a span whole (retry.py), which also covers a body cut off midway.
"""

from __future__ import annotations

import os
import re
from typing import Any, Protocol

SPAN_PIECE_BYTES = 8 * 2**20  # PieceSpan: one range request per this many bytes (chunk_reads.PIECE_BYTES)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class Span(Protocol):
    size: int  # the whole file's size on storage, as this span's read found it

    def readinto(self, view: memoryview) -> int:
        """Fill `view` with the span's next bytes; return how many (fewer only where the file ends)."""

    def close(self) -> None: ...


class FileSpan:
    """A span of a plain local file: pread on one descriptor."""

    def __init__(self, path: str, start: int, stop: int) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size
        self._at, self._stop = start, min(stop, self.size)

    def readinto(self, view: memoryview) -> int:
        wanted = max(0, min(len(view), self._stop - self._at))
        filled = 0
        while filled < wanted:
            count = os.preadv(self._fd, [view[filled:wanted]], self._at + filled)
            if not count:
                break
            filled += count
        self._at += filled
        return filled

    def close(self) -> None:
        os.close(self._fd)


class EmptySpan:
    """A span that starts at or past the end of the file: nothing to read, and the file's size."""

    def __init__(self, size: int) -> None:
        self.size = size

    def readinto(self, view: memoryview) -> int:
        return 0

    def close(self) -> None:
        pass


class PieceSpan:
    """A span of a file on any fsspec filesystem: one range read per piece, the size from `fs.size`."""

    def __init__(self, fs: Any, path: str, start: int, stop: int) -> None:
        self._fs, self._path = fs, path
        self.size = int(fs.size(path))
        self._at, self._stop = start, min(stop, self.size)

    def readinto(self, view: memoryview) -> int:
        wanted = max(0, min(len(view), SPAN_PIECE_BYTES, self._stop - self._at))
        if wanted == 0:
            return 0
        start = self._at
        data = self._fs.cat_file(self._path, start=start, end=start + wanted)
        view[: len(data)] = data
        self._at += len(data)
        return len(data)

    def close(self) -> None:
        pass


class S3Span:
    """A span of an S3 object: one ranged GET, its body streamed; the object's size from `Content-Range`."""

    def __init__(self, fs: Any, path: str, start: int, stop: int) -> None:
        self._fs = fs
        self._body: Any = None
        bucket, key, version = fs.split_path(path)
        request = {"Bucket": bucket, "Key": key, **({"VersionId": version} if version else {})}
        response = fs.call_s3("get_object", Range=f"bytes={start}-{stop - 1}", **request)
        self._body = response["Body"]
        self.size = _object_size(response, path, start)

    def readinto(self, view: memoryview) -> int:
        from fsspec.asyn import sync

        return sync(self._fs.loop, _fill, self._body, view)  # one hop to s3fs's event loop per buffer, not per packet

    def close(self) -> None:
        if self._body is None:
            return
        from fsspec.asyn import sync

        body, self._body = self._body, None
        try:
            sync(self._fs.loop, body.aclose)  # an unread rest is dropped with its connection
        except Exception:  # noqa: BLE001 - nothing to keep from a body being dropped
            pass


async def _fill(body: Any, view: memoryview) -> int:
    filled = 0
    while filled < len(view):
        count = await body.readinto(view[filled:])
        if not count:
            break
        filled += count
    return filled


def _object_size(response: dict[str, Any], path: str, start: int) -> int:
    """The object's size from a ranged GET's `Content-Range: bytes a-b/SIZE`."""
    match = _CONTENT_RANGE.fullmatch(str(response.get("ContentRange") or ""))
    if match is not None and match.group(3) != "*" and int(match.group(1)) == start:
        return int(match.group(3))
    if not response.get("ContentRange") and start == 0 and response.get("ContentLength") is not None:
        return int(response["ContentLength"])  # a store that ignores Range sends the whole object: its length
    raise OSError(
        f"{path}: a GET of the range from byte {start} answered Content-Range {response.get('ContentRange')!r}; "
        "the read-back needs an S3-compatible store that honours Range requests"
    )
