"""Which tier a resume reads: the newest committed checkpoint every rank can read, fast tier first at a tie.

A node-local fast tier is readable only where it was written: on a resized or replaced cluster some
ranks lack the files (or the manifest) there. So each rank checks, in its own view of each tier,
which of the newest candidates are complete, and the ranks agree with one all-gather
("tier-readable") before choosing: only a checkpoint every rank can read is a candidate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .. import catalog
from ..collectives import all_gather_objects
from ..format.layout import MANIFEST, join
from ..format.manifest import files_with_metadata
from ..storage.fsio import Location

log = logging.getLogger(__name__)

FAST, DURABLE = "fast", "durable"
CANDIDATES_PER_TIER = 3  # newest commits checked per tier: each check is one listing of a checkpoint directory


@dataclass(frozen=True)
class TierChoice:
    tier: str  # "fast" | "durable"
    name: str  # checkpoint directory name
    url: str  # this rank's path of it
    step: int
    reason: str


def readable_here(location: Location, entry: catalog.CheckpointEntry) -> bool:
    """Every file of the committed checkpoint `entry` is present (at its committed size) in this rank's view."""
    try:
        listing = {
            str(info["name"]).rstrip("/").rsplit("/", 1)[-1]: info.get("size")
            for info in location.fs.ls(entry.path, detail=True)
        }
        if MANIFEST not in listing:
            return False
        return all(listing.get(path) == size for path, size in files_with_metadata(entry.manifest).items())
    except Exception:  # noqa: BLE001 - unreadable is the answer, whatever the reason
        log.debug("%s is not readable here", entry.path, exc_info=True)
        return False


def _candidates(location: Location | None, which: str | int) -> tuple[list[catalog.CheckpointEntry], set[str]]:
    """The tier's newest committed checkpoints of its latest run (newest first), and its drilled ones; for a
    step, an id or a directory name, the committed checkpoints it names (newest commit first)."""
    if location is None:
        return [], set()
    try:
        entries = catalog.list_checkpoints(location)
    except Exception:  # noqa: BLE001 - an unreachable tier offers nothing
        log.warning("cannot list %s; not considering it for the resume", location.url, exc_info=True)
        return [], set()
    if which not in ("latest", catalog.LAST_GOOD):
        named = [entry for entry in entries if entry.committed and catalog.names(entry, which)]
        return sorted(named, key=catalog.time_order, reverse=True)[:CANDIDATES_PER_TIER], set()
    newest = catalog.newest_committed(entries)
    if newest is None:
        return [], set()
    mine = catalog.committed_of_run(entries, newest.run_id)
    drilled = (
        {entry.name for entry in catalog.last_good(location, entries, newest.run_id, keep=len(mine))}
        if which == catalog.LAST_GOOD
        else set()
    )
    return list(reversed(mine))[:CANDIDATES_PER_TIER] if which != catalog.LAST_GOOD else list(reversed(mine)), drilled


def listed_anywhere(fast: Location | None, durable: Location | None, which: str | int) -> list[str]:
    """The candidates for `which` either tier lists (readable or not), as `TIER:NAME`."""
    return [
        f"{tier}:{entry.name}"
        for tier, location in ((FAST, fast), (DURABLE, durable))
        for entry in _candidates(location, which)[0]
    ]


def choose(fast: Location | None, durable: Location | None, which: str | int, group: Any) -> list[TierChoice]:
    """Collective "tier-readable": every rank calls it; returns the choices in preference order (same on every rank).

    `which`: "latest", "last-good" (among checkpoints drilled on either tier), or a step, an id or a directory
    name (on either tier). The first choice is the one to load; the others are fallbacks (the same checkpoint on
    the other tier first).
    """
    tiers = {FAST: fast, DURABLE: durable}
    found: dict[str, list[catalog.CheckpointEntry]] = {}
    drilled: set[str] = set()
    for tier, location in tiers.items():
        found[tier], tier_drilled = _candidates(location, which)
        drilled |= tier_drilled
    if which == catalog.LAST_GOOD:
        found = {
            tier: [e for e in entries if e.name in drilled][:CANDIDATES_PER_TIER] for tier, entries in found.items()
        }
    mine = {
        (tier, entry.name) for tier, entries in found.items() for entry in entries if readable_here(tiers[tier], entry)
    }
    everywhere = set.intersection(
        *[set(map(tuple, view)) for view in all_gather_objects("tier-readable", sorted(mine), group)]
    )
    ranked = []
    for tier, entries in found.items():
        for entry in entries:
            if (tier, entry.name) in everywhere:
                ranked.append((catalog.run_order(entry)[:2], entry.step, 0 if tier == FAST else 1, tier, entry))
    # newest commit first; at the same checkpoint (or step) the fast tier first
    ranked.sort(key=lambda item: (item[0][0], item[0][1], item[1], -item[2]), reverse=True)
    choices = []
    for _, _, _, tier, entry in ranked:
        location = tiers[tier]
        others = [t for t in found if t != tier and any(e.name == entry.name for e in found[t])]
        if tier == FAST:
            reason = (
                "newest commit every rank can read; the fast tier wins at a tie"
                if others
                else "newest commit every rank can read"
            )
        else:
            unreadable = [e.name for e in found[FAST] if (FAST, e.name) not in everywhere]
            reason = (
                "newest commit every rank can read; the fast tier's newer or equal copies are not readable by every rank "
                f"({', '.join(unreadable[:3])})"
                if unreadable
                else "newest commit every rank can read"
            )
        choices.append(TierChoice(tier, entry.name, join(location.url, entry.name), entry.step, reason))
    return choices
