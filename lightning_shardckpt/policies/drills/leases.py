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
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

from ...engine.format.layout import DRILLS_DIR, join
from ...engine.storage.fsio import Location

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
            return False  # unreadable or gone: nobody can be shown to hold it
        if float(body.get("expires_at") or 0) <= time.time():
            return False
        return not (body.get("host") == self.host and not _process_alive(int(body.get("pid") or 0)))

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
        try:
            body = json.loads(self.location.fs.cat_file(join(self._directory, lease_name(checkpoint, generation))))
        except (OSError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    def _remove(self, path: str) -> None:
        try:
            self.location.fs.rm_file(path)
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("could not remove drill lease %s (%s); it expires by itself", path, err)


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
