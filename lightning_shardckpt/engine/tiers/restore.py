"""Which tier a resume reads: the newest committed checkpoint every rank can read, fast tier first at a tie.

Which checkpoints a selector names, and in which order, is not decided here: it is engine/catalog.py's `candidates`,
the rules `Root.pick` applies, over the two tiers' checkpoints taken together (one root holding whatever either
tier lists; a checkpoint drilled on either tier is drilled). This module only chooses the copy: the first candidate
of which a copy is readable by every rank (and accepted by the signature policy), the fast copy first.

A node-local fast tier is readable only where it was written: on a resized or replaced cluster some
ranks lack the files (or the manifest) there. So each rank checks, in its own view of each tier,
which of the newest candidates are complete, and the ranks agree with one all-gather
("tier-readable") before choosing: only a checkpoint every rank can read is a candidate.

With a signature policy (LoadConfig.require_signature), rank 0 checks each candidate copy it can read as the loader
would (engine/format/signing.py: manifest.sig against the manifest's bytes) and sends its refusals in the same
all-gather: a refused copy is no candidate on any rank, and the checkpoints passed over for it are named, as
`latest` without tiers names them (engine/catalog.py, SIGNATURE_SKIPPED). Rank 0 alone judges the manifest, as the
loader's pick does; every rank still checks the files it reads against the signed digests at load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .. import catalog
from ..collectives import all_gather_objects, rank_and_world
from ..format import drill_records, groups
from ..format.manifest import files_with_metadata
from ..format.names import MANIFEST, join
from ..format.signing import SignaturePolicy, SignatureRefused
from ..storage.fsio import Location

log = logging.getLogger(__name__)

FAST, DURABLE = "fast", "durable"
CANDIDATES_PER_TIER = 3  # newest commits checked per tier: each check is one listing of a checkpoint directory
# with a signature policy: a forged or unsigned newest few must not leave `latest` without a candidate while older
# signed ones exist, and the ranks cannot know the refusals before they agree (one all-gather), so each looks deeper
SIGNED_CANDIDATES_PER_TIER = 8


@dataclass(frozen=True)
class TierChoice:
    tier: str  # "fast" | "durable"
    name: str  # checkpoint directory name
    url: str  # this rank's path of it
    step: int
    reason: str


@dataclass(frozen=True)
class TierPick:
    """`choose_signed`'s answer, the same on every rank."""

    choices: list[TierChoice]  # preference order: the first is the one to load, the others fallbacks
    refused: dict[str, str] = field(default_factory=dict)  # "TIER:NAME" -> why the signature policy refused that copy
    # checkpoints (directory names, newest first) newer than the first choice passed over because the policy refused
    # their copies: LoadResult.signature_skipped, the resume event's names and the `signature_skipped` metric
    signature_skipped: tuple[str, ...] = ()


def readable_here(location: Location, entry: catalog.CheckpointEntry) -> bool:
    """Every file of the committed checkpoint `entry` is present (at its committed size) in this rank's view."""
    try:
        listing = {
            str(info["name"]).rstrip("/").rsplit("/", 1)[-1]: info.get("size")
            for info in location.fs.ls(entry.path, detail=True)
        }
        if MANIFEST not in listing:
            return False
        # v5: its files are in its group tables
        manifest = groups.expanded(location.fs, entry.path, entry.committed_manifest)
        return all(listing.get(path) == size for path, size in files_with_metadata(manifest).items())
    except Exception:  # noqa: BLE001 - unreadable is the answer, whatever the reason
        log.debug("%s is not readable here", entry.path, exc_info=True)
        return False


def _listing(location: Location | None) -> list[catalog.CheckpointEntry]:
    if location is None:
        return []
    try:
        return catalog.list_checkpoints(location)
    except Exception:  # noqa: BLE001 - an unreachable tier offers nothing
        log.warning("cannot list %s; not considering it for the resume", location.url, exc_info=True)
        return []


def _candidates(
    tiers: dict[str, Location | None], which: str | int, per_tier: int = CANDIDATES_PER_TIER
) -> tuple[list[str], dict[str, list[catalog.CheckpointEntry]]]:
    """What `which` names on the tiers taken together: the catalog's candidates (catalog.candidates, the rules
    `Root.pick` applies) over one root holding every checkpoint either tier lists, a checkpoint drilled on either
    tier being drilled (drills run on the fast tier; its durable copy is the same checkpoint). Returns their names
    in the pick's order of preference, and each tier's copies of them, its first `per_tier` (each is checked with
    one listing of its directory): a tier's newest copies are considered even where the other tier has newer ones."""
    listed = {tier: _listing(location) for tier, location in tiers.items()}
    together: dict[str, catalog.CheckpointEntry] = {}
    for entries in listed.values():
        for entry in entries:  # a copy that is not committed (a torn or corrupt one) does not hide the other's
            if entry.name not in together or (entry.committed and not together[entry.name].committed):
                together[entry.name] = entry
    states: dict[str, str] | None = None
    if which == catalog.LAST_GOOD:
        states = {}
        for tier, location in tiers.items():
            if location is None or not listed[tier]:
                continue
            for name, state in drill_records.trust_states(location, listed[tier]).items():
                if states.get(name) != drill_records.DRILLED:
                    states[name] = state
    copies = {tier: {entry.name: entry for entry in entries if entry.committed} for tier, entries in listed.items()}
    order: list[str] = []
    found: dict[str, list[catalog.CheckpointEntry]] = {tier: [] for tier in tiers}
    left = {tier: len(held) for tier, held in copies.items()}  # copies not yet met in the order
    for entry in catalog.candidates(list(together.values()), which, states=states):
        kept = False
        for tier in tiers:
            if entry.name in copies[tier]:
                left[tier] -= 1
                if len(found[tier]) < per_tier:
                    found[tier].append(copies[tier][entry.name])
                    kept = True
        if kept:
            order.append(entry.name)
        if all(len(found[tier]) >= per_tier or left[tier] == 0 for tier in tiers):
            break  # `latest` is lazy: no tier has a candidate left to take
    return order, found


def listed_anywhere(fast: Location | None, durable: Location | None, which: str | int) -> list[str]:
    """The candidates for `which` either tier lists (readable or not), as `TIER:NAME`."""
    _, found = _candidates({FAST: fast, DURABLE: durable}, which)
    return [f"{tier}:{entry.name}" for tier, entries in found.items() for entry in entries]


def choose(fast: Location | None, durable: Location | None, which: str | int, group: Any) -> list[TierChoice]:
    """Collective "tier-readable": every rank calls it; returns the choices in preference order (same on every rank).

    `which`: "latest", "last-good" (among checkpoints drilled on either tier), or a step, an id or a directory
    name (on either tier). The first choice is the one to load; the others are fallbacks (the same checkpoint on
    the other tier first). Without a signature policy: `choose_signed` says more.
    """
    return choose_signed(fast, durable, which, group, None).choices


def choose_signed(
    fast: Location | None,
    durable: Location | None,
    which: str | int,
    group: Any,
    policy: SignaturePolicy | None,
    refused_before: dict[str, tuple[str, tuple]] | None = None,
) -> TierPick:
    """`choose`, honouring a signature policy: a copy the policy refuses (rank 0 checks) is no candidate on any rank.
    Collective "tier-readable" (one all-gather, refusals included). `refused_before`: fast-tier checkpoints the peer
    restore already refused ({name: (why, commit order)}, the same on every rank), counted among those passed over."""
    tiers = {FAST: fast, DURABLE: durable}
    per_tier = CANDIDATES_PER_TIER if policy is None else SIGNED_CANDIDATES_PER_TIER
    order, found = _candidates(tiers, which, per_tier)
    mine = {
        (tier, entry.name)
        for tier, entries in found.items()
        for entry in entries
        if readable_here(_listed(tiers[tier]), entry)
    }
    refused_here: dict[str, tuple[str, tuple]] = {}
    if policy is not None and rank_and_world(group)[0] == 0:  # rank 0 judges manifests, as the loader's pick does
        for tier, entries in found.items():
            for entry in entries:
                if (tier, entry.name) not in mine:
                    continue
                try:
                    why = _refusal(policy, _listed(tiers[tier]), entry)
                except Exception:  # noqa: BLE001 - not judged (a read failed): no candidate, but nothing refused
                    log.warning("cannot check the signature of %s; not considering it", entry.path, exc_info=True)
                    mine.discard((tier, entry.name))
                    continue
                if why is not None:
                    mine.discard((tier, entry.name))
                    refused_here[f"{tier}:{entry.name}"] = (why, _order(entry))
    views = all_gather_objects("tier-readable", {"readable": sorted(mine), "refused": refused_here}, group)
    everywhere = set.intersection(*[set(map(tuple, view["readable"])) for view in views])
    refused = {f"{FAST}:{name}": verdict for name, verdict in (refused_before or {}).items()}
    refused.update({copy: verdict for view in views for copy, verdict in view["refused"].items()})
    # the pick's order (catalog.candidates); at the same checkpoint the fast tier first
    copy_of = {(tier, entry.name): entry for tier, entries in found.items() for entry in entries}
    ranked = [(tier, copy_of[tier, name]) for name in order for tier in (FAST, DURABLE) if (tier, name) in everywhere]
    choices = []
    for tier, entry in ranked:
        location = _listed(tiers[tier])
        others = [t for t in found if t != tier and any(e.name == entry.name for e in found[t])]
        if tier == FAST:
            reason = (
                "newest commit every rank can read; the fast tier wins at a tie"
                if others
                else "newest commit every rank can read"
            )
        else:
            passed = [e.name for e in found[FAST] if (FAST, e.name) not in everywhere]
            unreadable = [name for name in passed if f"{FAST}:{name}" not in refused]
            unsigned = [name for name in passed if f"{FAST}:{name}" in refused]
            reason = "newest commit every rank can read"
            if unreadable:
                reason += f"; the fast tier's newer or equal copies are not readable by every rank ({', '.join(unreadable[:3])})"
            if unsigned:
                reason += f"; the signature policy refused the fast tier's copies of {', '.join(unsigned[:3])}"
        choices.append(TierChoice(tier, entry.name, join(location.url, entry.name), entry.step, reason))
    return TierPick(choices, {copy: why for copy, (why, _) in refused.items()}, _passed_over(refused, ranked))


def _listed(location: Location | None) -> Location:
    """A tier that offered candidates: it was listed, so it is configured."""
    assert location is not None, "a candidate of a tier that is not there"
    return location


def _order(entry: catalog.CheckpointEntry) -> tuple:
    """The ranking's key of a checkpoint (commit order, then step), comparable across ranks and tiers."""
    return (*catalog.run_order(entry)[:2], entry.step)


def _refusal(policy: SignaturePolicy, location: Location, entry: catalog.CheckpointEntry) -> str | None:
    """Why the policy refuses this copy's manifest (None: it accepts it); a read that fails raises (retried first:
    a transient error is no forgery, never counted as one). The loader checks the picked one again, and every rank
    the files it reads: a copy changed after this check is still refused."""
    try:
        entry.extra[catalog.SIGNED_BY] = policy.check_manifest(location.fs, entry.path, entry.committed_manifest)
        return None
    except SignatureRefused as err:
        return str(err)


def _passed_over(refused: dict[str, tuple[str, tuple]], ranked: list[tuple]) -> tuple[str, ...]:
    """Names of the checkpoints newer than the first choice (all, without one) of which a copy was refused; newest
    first. A refused copy of the chosen checkpoint itself (its other tier's copy is read) passes over nothing."""
    first = ranked[0][1] if ranked else None
    newer = {}
    for copy, (_, order) in refused.items():
        name = copy.split(":", 1)[1]
        if first is None or (name != first.name and tuple(order) > _order(first)):
            newer[name] = tuple(order)
    return tuple(sorted(newer, key=lambda name: newer[name], reverse=True))
