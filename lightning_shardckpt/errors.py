"""One exception hierarchy: every error a user can meet says what went wrong and what to do."""

from __future__ import annotations

from typing import Any


class ShardCkptError(Exception):
    """Base class of every error raised by lightning_shardckpt."""


class ConfigError(ShardCkptError, ValueError):
    """An option has a value that cannot work; the message names the option and the fix."""


class StorageUnavailable(ShardCkptError):
    """The checkpoint location cannot be reached or written (missing bucket, credentials, permissions)."""


class CheckpointNotFound(ShardCkptError):
    """No committed checkpoint matches what was asked for."""


class CheckpointDeleted(CheckpointNotFound):
    """A checkpoint went away after it was picked (another job's retention on the root): not corruption."""


class CorruptCheckpoint(ShardCkptError):
    """Stored bytes do not match the checksums recorded at commit."""

    def __init__(self, message: str, *, problems: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        # Each problem names file, tensor (fqn), expected and actual checksum or size.
        self.problems = problems or []


class SignatureRefused(CorruptCheckpoint):
    """A reader requiring signatures refuses this checkpoint: unsigned, signed by no accepted key, or a file whose
    SHA-256 differs from the signed record. The message names the file and the key id. A CorruptCheckpoint, so
    `latest` and `last-good` pass over it to the newest validly signed checkpoint."""


class IncompatibleCheckpoint(ShardCkptError):
    """The checkpoint cannot be applied here: newer format, or keys/shapes that do not match."""


class CommitFailed(ShardCkptError):
    """A checkpoint did not commit; the previous committed checkpoint is still the latest."""


class UntrustedCheckpoint(ShardCkptError):
    """A checkpoint holds a pickled class outside the allow-list; loading it could run its code.

    The message names the class (`blocked`) and the fix: `trust_checkpoint=True` for a checkpoint you
    trust, or `torch.serialization.add_safe_globals([...])` for just that class.
    """

    def __init__(self, message: str, *, blocked: str | None = None) -> None:
        super().__init__(message)
        self.blocked = blocked
