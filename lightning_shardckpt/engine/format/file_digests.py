"""File digests of signed checkpoints: which cryptographic hashes, where they are recorded, how a file is hashed.

The names signing.py's signature covers (FORMAT.md §12), apart from the signature itself, so that the modules
recording digests (listed_digests.py for format v2/v3) build on them without importing the signing policy that
checks them.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ...errors import ConfigError

# BLAKE3 by default: 0.31 CPU-s per GiB here against SHA-256's 0.68 (docs/BENCHMARKS.md, "Signing"); SHA-256 for a
# writer without the `blake3` package or a policy that names it. Both release the GIL on large buffers
BLAKE3, SHA256 = "blake3", "sha256"
DIGEST_ALGORITHMS = (BLAKE3, SHA256)
DIGEST_FIELD = "digest_algorithm"  # manifest: present exactly when files carry digests
FILE_DIGEST = "file_digest"  # part: its shard file's digest
PART_DIGESTS = "part_digests"  # manifest parts table: one string, 64 hex characters per rank
METADATA_DIGEST = "digest"  # manifest dcp_metadata record, signed: `.metadata`'s digest
DIGEST_CHARS = 64
NO_DIGEST = "-" * DIGEST_CHARS
INSTALL_HINT = "install the optional extra: pip install 'lightning_shardckpt[sign]' (cryptography, blake3)"


def new_digest(algorithm: str) -> Any:
    """A streaming file digest (update, hexdigest) of `algorithm` (32 bytes, 64 hex characters, either way)."""
    if algorithm == SHA256:
        return hashlib.sha256()
    if algorithm == BLAKE3:
        try:
            import blake3
        except ImportError as err:
            raise ConfigError(f"digest {BLAKE3!r} needs the `blake3` package; {INSTALL_HINT}, or use sha256") from err
        return blake3.blake3()
    raise ConfigError(f"digest algorithm {algorithm!r} is unknown; use one of {DIGEST_ALGORITHMS}")


def digest_of(data: bytes, algorithm: str) -> str:
    hasher = new_digest(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


FILE_READ_BYTES = 8 * 2**20


def file_digest(fs: Any, path: str, algorithm: str) -> tuple[str, int]:
    """The digest of a file's bytes as storage returns them, streamed in pieces; and its size."""
    hasher = new_digest(algorithm)
    total = 0
    with fs.open(path, "rb") as handle:
        while True:
            piece = handle.read(FILE_READ_BYTES)
            if not piece:
                break
            hasher.update(piece)
            total += len(piece)
    return hasher.hexdigest(), total
