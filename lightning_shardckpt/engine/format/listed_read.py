"""One small file a committed manifest lists (a part, a group table), read and checked before it is parsed."""

from __future__ import annotations

from typing import Any

from ...errors import CorruptCheckpoint, SignatureRefused
from ..storage import fsio
from ..storage.small_files import SmallFileRefused
from .checksum import checksum
from .file_digests import digest_of
from .names import join


def read_listed(
    fs: Any,
    directory: str,
    name: str,
    size: int,
    digest: str | None,
    what: str,
    crypto: tuple[str, str, str] | None = None,
) -> bytes:
    """The bytes of `name` in `directory`, which the manifest lists at `size` bytes with checksum `digest`:
    read at most one byte more than listed (so a grown file is caught without reading it all), then checked.
    CorruptCheckpoint names the file when it is missing, of another size or checksum. `crypto` (a reader with a
    signature policy, signed v5): (algorithm, expected digest, the id of the key whose signature over the manifest
    was accepted), checked first: SignatureRefused names the file whose bytes are not the ones the signature binds,
    whatever its xxh3 says, and the key."""
    path = join(directory, name)
    try:
        data = fsio.read_small(fs, path, size)
    except SmallFileRefused as err:  # a FIFO, a link, or grown past its listed size: never read whole
        raise CorruptCheckpoint(
            f"{err}: the manifest lists it at {size} bytes; the {what} was altered after commit. Restore it from a "
            "replica or load an older checkpoint",
            problems=[{"file": name, "tensor": None, "expected": digest, "actual": err.why}],
        ) from None
    except FileNotFoundError as err:
        raise CorruptCheckpoint(
            f"{path} is missing: the manifest lists it. Restore it from a replica or load an older checkpoint",
            problems=[{"file": name, "tensor": None, "expected": "present", "actual": "missing"}],
        ) from err
    if crypto is not None and digest_of(data, crypto[0]) != crypto[1]:
        raise SignatureRefused(
            f"{path}: its {crypto[0]} digest differs from the one the manifest signed by key {crypto[2][:16]} vouches "
            f"for; the {what} was changed after it was signed. Resume a checkpoint whose files are intact (`latest` "
            "passes over this one)"
        )
    actual = checksum(data)
    if len(data) != size or actual != digest:
        raise CorruptCheckpoint(
            f"{path}: {len(data)} bytes with checksum {actual}, the manifest says {size} bytes, {digest}; the {what} "
            "was altered after commit. Restore it from a replica or load an older checkpoint",
            problems=[{"file": name, "tensor": None, "expected": digest, "actual": actual}],
        )
    return data
