"""Which node roots are one storage under two names, so a peer copy between them is never counted as a copy.

A peer copy is worth something only on another failure domain. Two node roots with different URLs can still be
one directory: `node1` a symlink to `node0`, a bind mount, one shared disk mounted on both nodes. Copying rank
0's files "to node 1" then writes them where they already are, and the peer records claim a second copy that
does not exist. Names cannot tell (a symlink on another machine, an NFS export); the storage can: at setup the
first rank of each node root writes a marker file under `ROOT/peers/`, and every rank lists which markers its own
root shows. Roots that show each other's marker are one storage (`storage_of`); peer replication treats them as
one node root (nothing is sent between them), and warns once. For `shardckpt ls` on one machine, `distinct` drops a
local node root that resolves to another's directory.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any

from ..collectives import all_gather_objects, broadcast_from_coordinator
from ..format.names import join
from ..storage.fsio import Location

log = logging.getLogger(__name__)

_MARKER = ".root-probe-"  # ROOT/peers/.root-probe-<token>-<rank>: dot-named, no checkpoint name, removed at once


def storage_of(fast: Location, roots: list[str], rank: int, group: Any, peers_dir: str) -> list[int]:
    """For every rank of `group`, the lowest rank whose node root is the same storage as its own (collectives:
    every rank calls it alike). `roots`: every rank's node root URL; `peers_dir`: where the markers go."""
    first = roots.index(fast.url)  # the first rank of each URL writes that URL's marker
    token = broadcast_from_coordinator("peer-root-token", secrets.token_hex(6), group)
    directory = join(fast.path, peers_dir)
    marker = join(directory, f"{_MARKER}{token}-{first}")
    if first == rank:
        try:
            fast.backend.makedirs(directory)
            fast.backend.write_new_file(marker, b"")
        except OSError as err:  # the copies will fail on their own; identity falls back to the URL
            log.debug("could not write %s (%s)", marker, err)
    all_gather_objects("peer-root-written", None, group)  # every marker is written before any rank looks
    seen = _markers_seen(fast, directory, token) | {first}
    views = all_gather_objects("peer-root-seen", sorted(seen), group)  # every rank listed: the markers may go
    if first == rank:
        try:
            fast.fs.rm_file(marker)
        except OSError as err:
            log.debug("could not remove %s (%s)", marker, err)
    return [min(view) for view in views]


def _markers_seen(fast: Location, directory: str, token: str) -> set[int]:
    try:
        fast.fs.invalidate_cache(directory)
        names = [str(path).rstrip("/").rsplit("/", 1)[-1] for path in fast.fs.ls(directory, detail=False)]
    except OSError:
        return set()
    prefix = f"{_MARKER}{token}-"
    return {int(name[len(prefix) :]) for name in names if name.startswith(prefix) and name[len(prefix) :].isdigit()}


def aliases(roots: list[str], storage: list[int]) -> list[tuple[str, str]]:
    """(root, the root it is the same storage as) for every node root URL that is another's under a second name."""
    found = []
    for rank, url in enumerate(roots):
        owner = roots[storage[rank]]
        if url != owner and (url, owner) not in found:
            found.append((url, owner))
    return found


def distinct(roots: dict[int, Location]) -> dict[int, Location]:
    """`roots` without a local node root that resolves to the directory of a node root listed before it."""
    kept: dict[int, Location] = {}
    real: dict[str, int] = {}
    for node, location in roots.items():
        if location.backend.is_local:
            resolved = os.path.realpath(location.path)
            if resolved in real:
                log.warning(
                    "node root %s is %s, node %d's root under another name: counted once (a copy there is no copy)",
                    location.url,
                    resolved,
                    real[resolved],
                )
                continue
            real[resolved] = node
        kept[node] = location
    return kept
