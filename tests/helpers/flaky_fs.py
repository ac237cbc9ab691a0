"""A local filesystem that refuses deletes while a marker file exists: a storage policy you switch.

`flaky:///abs/path` with storage_options `{"refuse_deletes_while": "/abs/marker"}` is the local
filesystem, except that `rm` and `rm_file` raise `PermissionError(EACCES)` while the marker file
exists, as an object store does under a bucket policy or object lock that denies DeleteObject.
Listing, reads and writes keep working. The switch is a real file, so every process of a job sees
it. Importing this module registers the protocol.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "flaky"


class RefusingDeletesFileSystem(LocalFileSystem):
    protocol = (PROTOCOL,)

    def __init__(self, refuse_deletes_while: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.marker = os.path.abspath(refuse_deletes_while)

    def _refuse(self, path: Any) -> None:
        if os.path.exists(self.marker):
            raise PermissionError(errno.EACCES, "delete denied by the storage's policy (marker present)", str(path))

    def rm_file(self, path: str) -> None:
        self._refuse(path)
        super().rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._refuse(path)
        super().rm(path, recursive=recursive, maxdepth=maxdepth)


def flaky_url(path: str | os.PathLike) -> str:
    return f"{PROTOCOL}://{os.path.abspath(path)}"


fsspec.register_implementation(PROTOCOL, RefusingDeletesFileSystem, clobber=True)
