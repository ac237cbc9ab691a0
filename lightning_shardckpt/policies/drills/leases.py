"""Drill leases: who is drilling which checkpoint now, so two drill followers never drill one at once.

A lease is a small write-once file beside the drill records, `ROOT/drills/.lease--<checkpoint>--<generation>.json`,
made with the backend's create-if-absent (a hard link locally, a conditional PUT on S3): of two followers
claiming the same generation exactly one succeeds. The body names its holder (host, pid, a random token,
so two holders never write equal bytes: S3's create-if-absent takes equal bytes for its own retried write)
and when it expires. A lease is stale once expired, or at once when its holder ran on this host and that
process is gone (a killed follower: its drill died with it, policies/drills/pool.py); a stale lease is taken
over by claiming the next generation, again create-if-absent, so only one follower takes it over.

Leases are dot-files, which drill_records.list_records skips: they never count as records, and
`shardckpt ls` does not show them. A holder removes its lease after the drill filed its record.

Anyone who can write the root can write a lease file too. One that is not what `claim` writes (not a JSON object
within the size and depth bounds, `expires_at` not a finite number, `pid` not an integer, `host` not a string)
shows no live holder: it is logged once, counted in `malformed`, and treated as stale, so it is taken over like
an expired one and removed with the others once its checkpoint is settled. Nothing in a lease stops a follower.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

from ...engine.format import bounded_json
from ...engine.format.names import DRILLS_DIR, join
from ...engine.storage import fsio
from ...engine.storage.fsio import Location
from ...engine.storage.small_files import SmallFileRefused

log = logging.getLogger(__name__)

_LEASE_NAME = re.compile(r"^\.lease--(?P<checkpoint>.+)--(?P<generation>\d{6})\.json$")


@dataclass(frozen=True)
class Lease:
    checkpoint: str
    generation: int
    path: str


def lease_name(checkpoint: str, generation: int) -> str:
    return f".lease--{checkpoint}--{generation:06d}.json"


class DrillLeases:
    """Claim, check and release drill leases under one root, as `owner`."""

    def __init__(self, location: Location, *, owner: str | None = None, ttl_s: float = 900.0) -> None:
        self.location = location
        self.host = socket.gethostname()
        self.owner = owner or f"{self.host}:{os.getpid()}:{secrets.token_hex(4)}"
        self.ttl_s = ttl_s
        self._directory = join(location.path, DRILLS_DIR)
        self.malformed: set[str] = set()  # lease files seen that claim did not write (each logged once)

    def held(self) -> dict[str, list[int]]:
        """Checkpoint directory name -> the generations of its lease files, oldest first (one listing)."""
        try:
            names = self.location.fs.ls(self._directory, detail=False)
        except FileNotFoundError:
            return {}
        leases: dict[str, list[int]] = {}
        for name in names:
            match = _LEASE_NAME.match(name.rstrip("/").rsplit("/", 1)[-1])
            if match:
                leases.setdefault(match["checkpoint"], []).append(int(match["generation"]))
        return {checkpoint: sorted(generations) for checkpoint, generations in leases.items()}

    def is_live(self, checkpoint: str, generations: list[int]) -> bool:
        """Whether the newest lease of `checkpoint` still holds it (one small read)."""
        if not generations:
            return False
        body = self._read(checkpoint, generations[-1])
        if body is None:
            return False  # unreadable, malformed or gone: nobody can be shown to hold it
        if body["expires_at"] <= time.time():
            return False
        return not (body["host"] == self.host and not _process_alive(body["pid"]))

    def claim(self, checkpoint: str, generations: list[int] | None = None) -> Lease | None:
        """This owner's lease on `checkpoint`, or None when another holds it or won the race for it."""
        if generations is None:
            generations = self.held().get(checkpoint, [])
        if generations and self.is_live(checkpoint, generations):
            return None
        generation = generations[-1] + 1 if generations else 0
        path = join(self._directory, lease_name(checkpoint, generation))
        now = time.time()
        body = {
            "checkpoint": checkpoint,
            "owner": self.owner,
            "host": self.host,
            "pid": os.getpid(),
            "claimed_at": now,
            "expires_at": now + self.ttl_s,
        }
        try:
            self.location.backend.makedirs(self._directory)
            self.location.backend.create_if_absent(path, json.dumps(body, sort_keys=True).encode())
        except FileExistsError:
            return None  # another follower claimed this generation first
        return Lease(checkpoint, generation, path)

    def release(self, lease: Lease) -> None:
        """Remove this owner's lease (best effort: an expired lease frees itself)."""
        self._remove(lease.path)

    def remove_stale(self, done: set[str]) -> None:
        """Remove the leases of checkpoints in `done` (drilled, or gone) that no live holder has."""
        for checkpoint, generations in self.held().items():
            if checkpoint in done and not self.is_live(checkpoint, generations):
                for generation in generations:
                    self._remove(join(self._directory, lease_name(checkpoint, generation)))

    def _read(self, checkpoint: str, generation: int) -> dict[str, Any] | None:
        """The lease's body with `expires_at`, `pid` and `host` checked; None when it is gone or malformed."""
        name = lease_name(checkpoint, generation)
        try:
            data = fsio.read_small(self.location.fs, join(self._directory, name), bounded_json.SMALL_MAX_BYTES)
        except SmallFileRefused as err:  # a FIFO, a link or a huge file: never opened or read whole
            self._malformed(name, err.why)
            return None
        except OSError:
            return None  # released or removed meanwhile
        try:
            body = bounded_json.loads(data, bounded_json.SMALL_MAX_BYTES)
        except bounded_json.UnreadableJson as err:
            self._malformed(name, str(err))
            return None
        problem = lease_problem(body, checkpoint)
        if problem:
            self._malformed(name, problem)
            return None
        return {**body, "pid": body.get("pid") or 0, "host": body.get("host")}

    def _malformed(self, name: str, problem: str) -> None:
        if name not in self.malformed:
            self.malformed.add(name)
            log.warning(
                "drill lease %s in %s is %s; not one a follower wrote: ignored (taken over as stale, removed once its "
                "checkpoint is drilled or gone)",
                name,
                self._directory,
                problem,
            )
        return None

    def _remove(self, path: str) -> None:
        try:
            self.location.fs.rm_file(path)
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("could not remove drill lease %s (%s); it expires by itself", path, err)


def lease_problem(body: Any, checkpoint: str) -> str | None:
    """None for a lease body of `checkpoint` as `claim` writes it (what is_live reads of it); else what is wrong."""
    if not isinstance(body, dict):
        return f"a JSON {type(body).__name__}, not an object"
    if body.get("checkpoint") != checkpoint:
        return f"a lease of {body.get('checkpoint')!r} under the name of another checkpoint"
    expires_at = body.get("expires_at")
    if isinstance(expires_at, bool) or not isinstance(expires_at, (int, float)) or not math.isfinite(expires_at):
        return f"expires_at={expires_at!r}, not a time in seconds"
    pid = body.get("pid")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < 1 << 31):
        return f"pid={pid!r}, not a process id"
    if not isinstance(body.get("host"), (str, type(None))):
        return f"host={body.get('host')!r}, not a host name"
    return None


def _process_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
