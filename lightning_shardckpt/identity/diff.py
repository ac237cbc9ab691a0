"""Compare a checkpoint's identity with the current run's, block by block, under an `IdentityPolicy`.

`error` blocks refuse the load with a readable diff and the fix, `warn` blocks log the diff, `ignore`
blocks stay silent (the report still lists them, for `shardckpt diff`).
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass, field, fields
from typing import Any, Final, Literal

from ..engine.collectives import rank_and_world
from ..engine.format.manifest import IDENTITY_BLOCKS as BLOCKS
from ..engine.validate import typed_options
from ..errors import ConfigError, IncompatibleCheckpoint

log = logging.getLogger(__name__)

PolicyAction = Literal["error", "warn", "ignore"]
ERROR: Final = "error"
WARN: Final = "warn"
IGNORE: Final = "ignore"
MAX_DIFF_LINES = 20  # per category in a diff; the rest is counted

_FIXES = {
    "model": "build the model the checkpoint was saved from",
    "config": "run with the checkpoint's config (`shardckpt diff` shows it)",
    "data": "train on the dataset version the checkpoint was trained on",
    "code": "check out the commit the checkpoint was saved from",
    "run": "nothing to fix: the run block is informational",
}


@dataclass(frozen=True, kw_only=True)
@typed_options("identity_policy")
class IdentityPolicy:
    """What a difference in each identity block does on load: "error" (refuse), "warn" (log) or "ignore"."""

    model: PolicyAction = ERROR  # changed tensors rarely load; "warn" for deliberate model surgery
    config: PolicyAction = (
        WARN  # a changed learning rate is a normal fine-tune; a changed model config shows up in `model`
    )
    data: PolicyAction = WARN  # a new dataset version is sometimes the point of a resume
    code: PolicyAction = IGNORE  # every commit changes it
    run: PolicyAction = IGNORE  # world size, hosts and command change on every elastic resume

    def __post_init__(self) -> None:
        for option in fields(self):
            value = getattr(self, option.name)
            if value not in (ERROR, WARN, IGNORE):
                raise ConfigError(
                    f"identity_policy.{option.name}={value!r} is unknown; use 'error' (refuse to load), "
                    "'warn' (log the difference and load) or 'ignore'"
                )

    def action(self, block: str) -> str:
        return getattr(self, block)


@dataclass
class BlockDiff:
    block: str
    action: str  # the policy's action for this block
    lines: list[str]  # readable differences, one per line

    def render(self) -> str:
        return f"[{self.block}]\n" + "\n".join("  " + line for line in self.lines)


@dataclass
class IdentityReport:
    """Differences between a checkpoint's identity and the current run's, block by block."""

    diffs: list[BlockDiff] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)  # blocks missing on either side: not compared

    @property
    def matches(self) -> bool:
        return not self.diffs

    @property
    def differences(self) -> dict[str, list[str]]:
        return {d.block: d.lines for d in self.diffs}

    def render(self) -> str:
        if self.matches:
            return "identity matches" + (f" (not recorded: {', '.join(self.unrecorded)})" if self.unrecorded else "")
        return "\n".join(d.render() for d in self.diffs)


def compare(
    saved: dict[str, Any] | None,
    current: dict[str, Any] | None,
    policy: IdentityPolicy | None = None,
    *,
    where: str = "the checkpoint",
) -> IdentityReport:
    """Diff `saved` against `current` identity blocks; raise for `error` blocks, log `warn` blocks."""
    policy = policy or IdentityPolicy()
    saved, current = saved or {}, current or {}
    report = IdentityReport()
    for block in BLOCKS:
        if saved.get(block) is None or current.get(block) is None:
            report.unrecorded.append(block)
            continue
        lines = _DIFFERS[block](saved[block], current[block])
        if lines:
            report.diffs.append(BlockDiff(block, policy.action(block), lines))
    rank = rank_and_world()[0]
    for diff in report.diffs:
        if diff.action == WARN and rank == 0:  # every rank compares (and raises); one tells
            log.warning(
                "rank %d: %s differs from the current run in %s (identity_policy.%s=warn):\n%s",
                rank,
                where,
                diff.block,
                diff.block,
                diff.render(),
            )
    refused = [d for d in report.diffs if d.action == ERROR]
    if refused:
        names = ", ".join(d.block for d in refused)
        fixes = "\n".join(
            f"To load anyway set identity_policy.{d.block}=warn (or ignore); to match, {_FIXES[d.block]}."
            for d in refused
        )
        raise IncompatibleCheckpoint(
            f"{where} does not match the current run ({names}):\n"
            + "\n".join(d.render() for d in refused)
            + "\n"
            + fixes
        )
    return report


def _diff_config(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    lines = []
    if saved.get("digest") != current.get("digest"):
        lines += _capped(
            list(
                difflib.unified_diff(
                    (saved.get("yaml") or "").splitlines(),
                    (current.get("yaml") or "").splitlines(),
                    fromfile="checkpoint",
                    tofile="current",
                    lineterm="",
                    n=1,
                )
            ),
            limit=3 * MAX_DIFF_LINES,
        )
    if saved.get("hyperparameters") is not None and current.get("hyperparameters") is not None:
        lines += _diff_mapping("hyperparameter", saved["hyperparameters"], current["hyperparameters"])
    return lines


def _diff_model(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    if saved.get("digest") == current.get("digest"):
        return []  # the same tensors load whatever the class is called now
    lines = _diff_fields(saved, current, ("class",))
    before, after = saved.get("tensors"), current.get("tensors")
    if before is None or after is None:
        return lines + [f"tensor digest {saved.get('digest')} -> {current.get('digest')}"]
    changed = [
        f"changed  {n}: {_spec(before[n])} -> {_spec(after[n])}"
        for n in sorted(before.keys() & after.keys())
        if before[n] != after[n]
    ]
    appeared = [f"appeared {n}: {_spec(after[n])}" for n in sorted(after.keys() - before.keys())]
    vanished = [f"vanished {n}: {_spec(before[n])}" for n in sorted(before.keys() - after.keys())]
    return lines + _capped(changed) + _capped(appeared) + _capped(vanished)


def _diff_data(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    lines = _diff_fields(saved, current, ("version", "kind", "length"))
    if None not in (saved.get("seed"), current.get("seed")):
        lines += _diff_fields(saved, current, ("seed",))  # another seed means another order of every epoch
    if saved.get("fingerprint") != current.get("fingerprint"):
        lines.append(f"fingerprint {saved.get('fingerprint')} -> {current.get('fingerprint')}")
        before = {f["path"]: f["bytes"] for f in saved.get("files") or []}
        after = {f["path"]: f["bytes"] for f in current.get("files") or []}
        lines += _capped(
            [
                f"file {p}: {before[p]} -> {after[p]} bytes"
                for p in sorted(before.keys() & after.keys())
                if before[p] != after[p]
            ]
        )
        lines += _capped([f"file added {p}" for p in sorted(after.keys() - before.keys())])
        lines += _capped([f"file removed {p}" for p in sorted(before.keys() - after.keys())])
    return lines


def _diff_code(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    lines = _diff_fields(saved, current, ("commit", "dirty"))
    return lines + _diff_mapping("version of", saved.get("versions") or {}, current.get("versions") or {})


def _diff_run(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return _diff_fields(saved, current, ("world_size", "device_type", "mesh_shape", "num_hosts", "command", "wandb"))


_DIFFERS = {"config": _diff_config, "data": _diff_data, "model": _diff_model, "code": _diff_code, "run": _diff_run}


def _diff_fields(saved: dict[str, Any], current: dict[str, Any], names: tuple[str, ...]) -> list[str]:
    return [f"{n} {saved.get(n)!r} -> {current.get(n)!r}" for n in names if saved.get(n) != current.get(n)]


def _diff_mapping(label: str, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    lines = [
        f"{label} {k}: {before[k]!r} -> {after[k]!r}"
        for k in sorted(before.keys() & after.keys())
        if before[k] != after[k]
    ]
    lines += [f"{label} {k} added: {after[k]!r}" for k in sorted(after.keys() - before.keys())]
    lines += [f"{label} {k} removed (was {before[k]!r})" for k in sorted(before.keys() - after.keys())]
    return lines


def _capped(lines: list[str], limit: int = MAX_DIFF_LINES) -> list[str]:
    if len(lines) <= limit:
        return lines
    return lines[:limit] + [f"... and {len(lines) - limit} more like these"]


def _spec(spec: list[Any]) -> str:
    shape, dtype = spec
    return f"{list(shape)} {dtype}"
