"""Bounded retries of whole storage operations, and the counters that make every retry visible.

Three layers retry an S3 request, innermost first:
1. botocore retries each HTTP request (legacy mode by default: up to 5 attempts on 5xx, 429/throttling,
   `RequestTimeout` and socket errors, sleeping `rand() * 2**n` s). This is the only layer that can retry
   one part of a multipart shard upload without re-sending the whole file.
2. s3fs wraps each call in up to `retries=5` more attempts (sleeping `0.1 * 1.7**i` s, at most 15 s),
   but only for connection-level errors (timeouts, dropped connections, unparseable responses) and
   `ClientError`s whose message says `SlowDown`; any other error is translated at once into an OSError
   (403 -> PermissionError, 404 -> FileNotFoundError, 412 on If-None-Match -> FileExistsError,
   503 -> OSError(EBUSY), 500 -> OSError(EREMOTEIO)).
3. This module: the operations our own code issues on small objects (manifest, `.metadata`, `latest`,
   read-back ranges) are retried as a whole when an error the lower layers gave up on is still
   transient, with bounded, jittered exponential backoff. Every retry is counted in `counters`, and
   botocore's own retries are counted there too (`record_http_retries`), so none stays invisible.

A persistent error is re-raised after the last attempt: that checkpoint fails, the next one starts afresh.
"""

from __future__ import annotations

import errno
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from ..validate import require_number, typed_options

log = logging.getLogger(__name__)

T = TypeVar("T")

# S3 error codes that mean "try again", whatever HTTP status carried them.
TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeoutException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "ConditionalRequestConflict",  # 409: a concurrent conditional write on the same key; AWS says retry
        "500",
        "502",
        "503",
        "504",
    }
)
# errno values s3fs and the OS use for transient conditions (s3fs maps 503 to EBUSY, 500 to EREMOTEIO).
TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("EBUSY", "EREMOTEIO", "ETIMEDOUT", "ECONNRESET", "ECONNREFUSED", "ECONNABORTED", "EAGAIN", "EPIPE")
    if hasattr(errno, name)
)
# Network errors of botocore / aiohttp, matched by class name so neither has to be installed.
TRANSIENT_CLASS_NAMES = frozenset(
    {
        "HTTPClientError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ClientConnectionError",
        "FSTimeoutError",
    }
)
# Errors that no retry can fix: the answer would be the same.
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


@dataclass(frozen=True, kw_only=True)
@typed_options("retry")
class RetryPolicy:
    """How often and how patiently a whole storage operation is retried."""

    attempts: int = 4  # total tries, the first included; the error of the last one is raised
    base_s: float = 0.5  # the first backoff; each further one doubles
    max_s: float = 8.0  # no single backoff is longer than this
    jitter: bool = True  # sleep a random share of the backoff ("full jitter"), so ranks do not retry in lockstep

    def __post_init__(self) -> None:
        require_number(
            "retry.attempts", self.attempts, integer=True, at_least=1, too_small="would never try the operation"
        )
        require_number("retry.base_s", self.base_s, at_least=0, hint="seconds")
        require_number("retry.max_s", self.max_s, at_least=0, hint="seconds")

    def backoff_s(self, retry_number: int, rng: random.Random | None = None) -> float:
        """Seconds to sleep before retry `retry_number` (1-based)."""
        ceiling = min(self.max_s, self.base_s * 2 ** (retry_number - 1))
        return (rng or random).uniform(0.0, ceiling) if self.jitter else ceiling


DEFAULT_POLICY = RetryPolicy()
_policy = DEFAULT_POLICY
_local = threading.local()


def set_policy(policy: RetryPolicy) -> RetryPolicy:
    """Use `policy` for every operation of this process from now on; return the previous one."""
    global _policy
    previous, _policy = _policy, policy
    return previous


def get_policy() -> RetryPolicy:
    return getattr(_local, "policy", None) or _policy


@contextmanager
def using(policy: RetryPolicy) -> Iterator[None]:
    """Use `policy` on this thread inside the block (e.g. fail fast in a preflight check)."""
    previous = getattr(_local, "policy", None)
    _local.policy = policy
    try:
        yield
    finally:
        _local.policy = previous


class RetryCounters:
    """Process-wide counts of retried storage operations; thread-safe, never reset by the package."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, key: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + amount

    def snapshot(self) -> dict[str, int]:
        """Keys: `retried.<op>` (our retries), `gave_up.<op>` (persistent errors), `http_retries.<S3 call>`
        (botocore's own retries), `recovered.create_if_absent` (a lost response resolved by checksum)."""
        with self._lock:
            return dict(self._counts)

    def total(self, prefix: str) -> int:
        with self._lock:
            return sum(value for key, value in self._counts.items() if key.startswith(prefix))


counters = RetryCounters()


def is_transient(err: BaseException) -> bool:
    """True if `err` (or an error it was raised from) is worth retrying: timeouts, resets, 5xx, throttling."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _PERMANENT):
            return False
        code = _s3_error_code(current)
        if code is not None:
            return code in TRANSIENT_CODES or _http_status(current) in (429, 500, 502, 503, 504)
        if isinstance(current, (TimeoutError, ConnectionError)):
            return True
        if any(cls.__name__ in TRANSIENT_CLASS_NAMES for cls in type(current).__mro__):
            return True
        if isinstance(current, OSError) and current.errno in TRANSIENT_ERRNOS:
            return True
        current = current.__cause__ or current.__context__
    return False


def call(operation: str, fn: Callable[[], T], *, policy: RetryPolicy | None = None, target: str = "") -> T:
    """Run `fn`, retrying transient errors under `policy`; count each retry under `operation`.

    `fn` must be safe to repeat (a whole-object put or a read). A conditional create is, provided its
    caller resolves the FileExistsError that a lost first response turns into (see fsio.create_if_absent).
    """
    policy = policy or get_policy()
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as err:
            if not is_transient(err):
                raise
            if attempt == policy.attempts:
                counters.add(f"gave_up.{operation}")
                log.error("%s %s failed %d times, giving up: %s", operation, target, attempt, _describe(err))
                raise
            delay = policy.backoff_s(attempt)
            counters.add(f"retried.{operation}")
            log.warning(
                "%s %s: transient storage error (%s); retry %d of %d in %.2fs",
                operation,
                target,
                _describe(err),
                attempt,
                policy.attempts - 1,
                delay,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


def record_http_retries(parsed: Any = None, model: Any = None, **_: Any) -> None:
    """botocore `after-call` hook: count the retries botocore made for one S3 call (success or error)."""
    try:
        retries = int(parsed["ResponseMetadata"].get("RetryAttempts", 0))
    except (TypeError, KeyError, ValueError):
        return
    if retries:
        counters.add(f"http_retries.{getattr(model, 'name', 'unknown')}", retries)


def _s3_error_code(err: BaseException) -> str | None:
    response = getattr(err, "response", None)
    if not isinstance(response, dict):
        return None
    code = (response.get("Error") or {}).get("Code")
    return str(code) if code is not None else None


def _http_status(err: BaseException) -> int | None:
    response = getattr(err, "response", None) or {}
    return (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")


def _describe(err: BaseException) -> str:
    code = None
    current: BaseException | None = err
    while current is not None and code is None:
        code = _s3_error_code(current)
        current = current.__cause__
    return f"{type(err).__name__}: {err}" + (f" [{code}]" if code else "")
