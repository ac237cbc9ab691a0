"""`shardckpt bisect ROOT --bad CHECK`: the earliest known-bad checkpoint and the last known-good before it.

The investigation scaffold, one command: (1) the earliest known-bad time, (2) exact identities on either
side of the boundary (`diff`), (3) the smallest affected slice (which tensors, files and ranks; for a
check about values, the tensors ranked by how much they changed from good to bad) with the known-good
counterexample, and (4) mitigation (resume the last known-good) kept apart from root cause.

Order is commit order along one run's lineage (engine/catalog.py: the run's `seq`), the run `latest`
comes from unless `run_id` names another. Binary search assumes the check is monotone (good, then
bad for good): 1 + ceil(log2(n + 1)) checks at most. `linear=True` checks oldest first and stops at
the first bad one, for checks that flip back and forth.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from ..engine import catalog
from ..engine.format.names import join, shard_rank
from ..engine.storage.fsio import Location
from ..errors import CheckpointNotFound
from . import diff as identity_diff
from .checks import NUMERIC, Check, CheckpointHandle, CheckResult, safely
from .choices import BISECT_TOP as DEFAULT_TOP
from .compare import compare_readers, summary
from .references import Resolved

log = logging.getLogger(__name__)

BINARY, LINEAR = "binary", "linear"
HYDRA_RECIPE = "python recipes/train.py"


def max_checks(count: int) -> int:
    """The most checks a binary search over `count` checkpoints runs: the newest, then halving."""
    return 1 + math.ceil(math.log2(count + 1)) if count else 0


@dataclass
class _Search:
    location: Location
    lineage: list[catalog.CheckpointEntry]
    check: Check
    results: dict[int, CheckResult] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)  # indices in the order they were checked

    def bad(self, index: int) -> bool:
        if index not in self.results:
            entry = self.lineage[index]
            result = safely(self.check, CheckpointHandle(self.location, entry))
            log.info(
                "bisect: %s (step %d): %s, %s", entry.name, entry.step, "BAD" if result.bad else "good", result.summary
            )
            self.results[index] = result
            self.order.append(index)
        return self.results[index].bad


def lineage_of(location: Location, run_id: str | None = None) -> list[catalog.CheckpointEntry]:
    """The committed checkpoints of one run in commit order: `run_id`'s, else those of the run `latest` comes from."""
    entries = catalog.list_checkpoints(location)
    newest = catalog.newest_committed(entries, run_id)
    if newest is None:
        raise CheckpointNotFound(f"no committed checkpoint in {location.url}; nothing to bisect")
    return catalog.committed_of_run(entries, newest.run_id)


def bisect(
    location: Location,
    check: Check,
    *,
    kind: str = NUMERIC,
    linear: bool = False,
    run_id: str | None = None,
    top: int = DEFAULT_TOP,
    check_name: str = "",
) -> dict[str, Any]:
    """Search the lineage and report the boundary (module doc); JSON-ready."""
    lineage = lineage_of(location, run_id)
    search = _Search(location, lineage, check)
    first_bad = _first_bad_linear(search) if linear else _first_bad_binary(search)
    report: dict[str, Any] = {
        "root": location.url,
        "check": check_name,
        "mode": LINEAR if linear else BINARY,
        "run_id": lineage[-1].run_id,
        "lineage": len(lineage),
        "checks_run": len(search.order),
        "max_checks": len(lineage) if linear else max_checks(len(lineage)),
        "checked": [_checked_row(lineage[i], search.results[i]) for i in search.order],
        "first_bad": None,
        "last_good": None,
        "earliest_known_bad_at": None,
        "identity": None,
        "affected": None,
        "resume": None,
    }
    if first_bad is None:
        return report
    bad_entry = lineage[first_bad]
    good_entry = lineage[first_bad - 1] if first_bad > 0 else None
    report["first_bad"] = _header(location, bad_entry, search.results[first_bad])
    report["earliest_known_bad_at"] = (bad_entry.record or {})["created_at"]  # a lineage's entries are committed
    if good_entry is not None:
        report["last_good"] = _header(location, good_entry, search.results[first_bad - 1])
        good, bad = (Resolved(entry.name, location, entry) for entry in (good_entry, bad_entry))
        report["identity"] = identity_diff.diff(good, bad)
        report["resume"] = resume_commands(location, good_entry)
    report["affected"] = _affected(location, good_entry, bad_entry, search.results[first_bad], kind, top)
    return report


def _first_bad_binary(search: _Search) -> int | None:
    last = len(search.lineage) - 1
    if not search.bad(last):
        return None  # the newest is good: for a monotone check, so is everything before it
    good, bad = -1, last  # invariant: everything <= good is good (-1: before the lineage), `bad` is bad
    while bad - good > 1:
        middle = (good + bad) // 2
        if search.bad(middle):
            bad = middle
        else:
            good = middle
    return bad


def _first_bad_linear(search: _Search) -> int | None:
    return next((index for index in range(len(search.lineage)) if search.bad(index)), None)


def _affected(
    location: Location,
    good: catalog.CheckpointEntry | None,
    bad: catalog.CheckpointEntry,
    result: CheckResult,
    kind: str,
    top: int,
) -> dict[str, Any]:
    """The smallest affected slice: what the check blamed (tensors, files, ranks) and, for a check about
    values, every tensor ranked by its change from the known-good counterexample."""
    files = sorted(set(result.files) | {name for item in result.tensors for name in item.get("files") or []})
    affected: dict[str, Any] = {
        "summary": result.summary,
        "tensors": result.tensors,
        "files": files,
        "ranks": sorted({rank for rank in map(shard_rank, files) if rank is not None}),
        "changes": None,
        "change_summary": None,
    }
    if kind == NUMERIC and good is not None:
        good_handle, bad_handle = CheckpointHandle(location, good), CheckpointHandle(location, bad)
        with good_handle.reader() as before, bad_handle.reader() as after:
            changes = compare_readers(before, after)
        affected["change_summary"] = summary(changes)
        affected["changes"] = [change.to_dict() for change in changes if change.status != "equal"][:top]
    return affected


def resume_commands(location: Location, entry: catalog.CheckpointEntry) -> dict[str, str]:
    """How to roll back to `entry`: the Trainer's `ckpt_path`, and the Hydra recipe's `resume`."""
    path = join(location.url, entry.name)
    return {
        "ckpt_path": path,
        "python": f'trainer.fit(model, datamodule, ckpt_path="{path}")',
        "hydra": f"{HYDRA_RECIPE} checkpoint.dirpath={location.url} resume={path}",
    }


def _header(location: Location, entry: catalog.CheckpointEntry, result: CheckResult) -> dict[str, Any]:
    return {
        **_checked_row(entry, result),
        "path": join(location.url, entry.name),
        "id": entry.checkpoint_id,
        "created_at": (entry.record or {})["created_at"],  # committed: listed with its record
    }


def _checked_row(entry: catalog.CheckpointEntry, result: CheckResult) -> dict[str, Any]:
    return {"name": entry.name, "step": entry.step, "seq": entry.seq, "bad": result.bad, "summary": result.summary}
