"""From event documents to health observations: one place that says what each metric's value is.

The run evaluates its rules on the very documents it writes under ROOT/events/ (a checkpoint attempt's
record, a drill result, a resume), and `shardckpt health` replays the same files: the same function
on the same documents is what makes the offline verdicts equal the online ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ...engine.metrics import COMMITTED, FAILED, SKIPPED
from .rules import CAUSE, RANK, ROOT, RUN

DRILL_EVENT, RESUME_EVENT, HEALTH_EVENT, RULES_EVENT = "drill", "resume", "health", "health_rules"
DRILL_LAG_EVENT = "drill_lag"  # policies/drills/drills_plugin.py, drills external: commits the follower has not drilled
REPLICATION_EVENT = "replication"  # engine/tiers/replicate.py: one copy attempt to the durable tier
PEER_REPLICATION_EVENT = "peer_replication"  # engine/tiers/peers.py: one checkpoint copied to peer nodes
ALL_SERIES = None  # an observation's slice key that applies to every series of the rule (a commit clears every cause)
PASSED, DRILL_FAILED = "passed", "failed"  # a drill's verdicts (engine/format/drill_records.py)

# failure causes, most specific first: a rule sliced by cause tells a full disk from a dead rank
_CAUSES = (
    ("storage_full", re.compile(r"no space left|ENOSPC|quota|disk full", re.I)),
    ("timeout", re.compile(r"timed? ?out|deadline", re.I)),
    ("rank_incomplete", re.compile(r"did not report|ranks reported|were planned|bytes on storage", re.I)),
    ("storage_unavailable", re.compile(r"connection|unreachable|unavailable|refused|5\d\d|throttl", re.I)),
    ("corrupt", re.compile(r"checksum|corrupt|mismatch", re.I)),
)


@dataclass(frozen=True)
class Observation:
    """One value of one metric on one slice, at a step and a time."""

    metric: str
    slice: str
    key: str | None  # the series within the slice: run id, "rank3", a cause, "root"; ALL_SERIES: every series
    value: float
    step: int
    time: float


def failure_cause(text: str | None) -> str:
    for name, pattern in _CAUSES:
        if text and pattern.search(text):
            return name
    return "other"


def observe(event: dict[str, Any]) -> list[Observation]:
    """Every observation one event document yields (none for events health does not watch)."""
    kind = event.get("event")
    step, when = int(event.get("step") or 0), float(event.get("created_at") or 0.0)
    run = str(event.get("run_id") or "run")
    values: list[tuple[str, str, str | None, float]] = []  # metric, slice, key, value

    def each_scope(metric: str, value: float) -> None:
        values.append((metric, RUN, run, value))
        values.append((metric, ROOT, "root", value))

    if kind is None and event.get("outcome") in (COMMITTED, FAILED, SKIPPED):
        outcome = event["outcome"]
        each_scope("skipped", 1.0 if outcome == SKIPPED else 0.0)
        if outcome != SKIPPED:
            each_scope("pause_s", float(event.get("pause_s") or 0.0))
            each_scope("total_s", float(event.get("total_s") or 0.0))
            each_scope("committed", 1.0 if outcome == COMMITTED else 0.0)
            each_scope("failed", 1.0 if outcome == FAILED else 0.0)
            each_scope("failed_dirs_left", 1.0 if event.get("cleanup") == "left" else 0.0)
            each_scope("storage_retries", float(event.get("storage_retries") or 0))
            cause = failure_cause(event.get("cause")) if outcome == FAILED else None
            values.append(("failed", CAUSE, cause, 1.0) if cause else ("failed", CAUSE, ALL_SERIES, 0.0))
            counters = event.get("counters") or {}
            decided = int(counters.get(COMMITTED, 0)) + int(counters.get(FAILED, 0))
            if decided:
                each_scope("commit_ratio", int(counters.get(COMMITTED, 0)) / decided)
        ranks = [r for r in event.get("ranks") or [] if r.get("write_gbps") is not None]
        for rank in ranks:
            values.append(("write_gbps", RANK, f"rank{rank['rank']}", float(rank["write_gbps"])))
        if ranks:
            each_scope("write_gbps", min(float(r["write_gbps"]) for r in ranks))  # the slowest rank paces the save
    elif kind == DRILL_EVENT:
        if event.get("verdict") in (PASSED, DRILL_FAILED):  # a drill that never ran (not-drilled) proved nothing
            each_scope("drill_ok", 1.0 if event.get("verdict") == PASSED else 0.0)
        if event.get("time_to_resume_s") is not None:
            each_scope("time_to_resume_s", float(event["time_to_resume_s"]))
        if event.get("lag_checkpoints") is not None:
            each_scope("drill_lag_checkpoints", float(event["lag_checkpoints"]))
        if event.get("lag_s") is not None:
            each_scope("drill_lag_s", float(event["lag_s"]))
    elif kind == DRILL_LAG_EVENT:
        each_scope("drill_lag_checkpoints", float(event.get("lag_checkpoints") or 0))
        each_scope("drill_lag_s", float(event.get("lag_s") or 0))
    elif kind == REPLICATION_EVENT:
        each_scope("replication_ok", 1.0 if event.get("outcome") == COMMITTED else 0.0)
        each_scope("replication_lag_checkpoints", float(event.get("lag_checkpoints") or 0))
    elif kind == PEER_REPLICATION_EVENT:
        each_scope("peer_replication_ok", 1.0 if event.get("outcome") == COMMITTED else 0.0)
        each_scope("peer_replication_lag_checkpoints", float(event.get("lag_checkpoints") or 0))
    elif kind == RESUME_EVENT:
        if event.get("seconds") is not None:
            each_scope("resume_s", float(event["seconds"]))
        if event.get("signature_skipped") is not None:  # only a resume under a signature policy counts them
            each_scope("signature_skipped", float(event["signature_skipped"]))
    return [Observation(metric, slice_, key, value, step, when) for metric, slice_, key, value in values]
