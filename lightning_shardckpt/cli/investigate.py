"""`shardckpt diff` and `shardckpt timeline`: what changed between two checkpoints, and along a whole root."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..engine.format.names import join
from ..engine.root import open_root
from ..ops import diff as checkpoint_diff
from ..ops import references
from ..ops import timeline as root_timeline
from . import exit_codes, options
from .output import PROG, human_bytes, print_json, print_table, short_time


def add_commands(commands: Any) -> None:
    diff = commands.add_parser(
        "diff",
        parents=[options.common()],
        help="compare two checkpoints' identity and topology; exit 1 if they differ",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_DIFF_EPILOG,
    )
    diff.add_argument("a", metavar="A", help="a checkpoint reference (below)")
    diff.add_argument("b", metavar="B", help="a checkpoint reference (below)")
    diff.add_argument(
        "--root", metavar="ROOT", help="the root in which selectors (references without '/') are resolved"
    )
    diff.set_defaults(run=cmd_diff)
    timeline = commands.add_parser(
        "timeline",
        parents=[options.common()],
        help="every checkpoint and attempt in order: state, cause, identity changes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_TIMELINE_EPILOG,
    )
    timeline.add_argument("root", metavar="ROOT")
    timeline.add_argument(
        "--grace",
        type=options.number("--grace", at_least=0, too_small="is negative"),
        default=root_timeline.IN_FLIGHT_GRACE_S,
        metavar="SECONDS",
        help="an uncommitted directory last written less than this ago, with no failure event, is in-flight "
        "(default: %(default).0f)",
    )
    timeline.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="NAME",
        help="a metric recorded at save time (trainer.callback_metrics) as a column, e.g. train/loss (repeatable)",
    )
    timeline.set_defaults(run=cmd_timeline)


def cmd_diff(args: argparse.Namespace) -> int:
    a, b = references.resolve_pair(args.a, args.b, args.root, args.storage_options)
    result = checkpoint_diff.diff(a, b)
    if args.json:
        print_json(result)
    else:
        _print_diff(result)
    return exit_codes.OK if result["identical"] else exit_codes.FOUND_PROBLEM


def cmd_timeline(args: argparse.Namespace) -> int:
    location = open_root(args.root, args.storage_options)
    result = root_timeline.timeline(location, grace_s=args.grace)
    if result["events_problem"]:
        print(f"{PROG}: warning: {result['events_problem']}; causes are not shown", file=sys.stderr)
    if args.json:
        print_json(result)
    else:
        _print_timeline(result, args.metric)
    return exit_codes.OK


# --- printing diff and timeline ---


def _print_diff(result: dict[str, Any]) -> None:
    for side in ("a", "b"):
        head = result[side]
        print(
            f"{side.upper()}  {head['name']}  step {head['step']}  created {short_time(head['created_at'])}  {head['path']}"
        )
    unrecorded = []
    for name in checkpoint_diff.SHOWN:
        block = result["blocks"][name]
        print(f"\n{name}: {_diff_status(block)}")
        if block["status"] == checkpoint_diff.UNRECORDED:
            unrecorded += [name] if block["compared"] else []
            continue
        a, b = _flatten(block["a"]), _flatten(block["b"])
        table = [("  FIELD", "A", "B", "")]
        for key in [*a, *(key for key in b if key not in a)]:
            table.append((f"  {key}", _cell(a.get(key)), _cell(b.get(key)), "*" if a.get(key) != b.get(key) else ""))
        print_table(table)
        details = (
            block["lines"]
            if name in ("config", "model")
            else [line for line in block["lines"] if line.startswith("file ")]
        )
        for line in details:
            print(f"  {line}")
    if result["identical"]:
        matched = [name for name in result["compared"] if name not in unrecorded]
        print(
            f"\nidentical: {', '.join(matched) or 'nothing recorded'} match"
            + (f" (recorded in neither: {', '.join(unrecorded)})" if unrecorded else "")
            + "; position and run are not compared"
        )
    else:
        print(f"\ndifferent: {', '.join(result['differs'])}")


def _diff_status(block: dict[str, Any]) -> str:
    status, compared = block["status"], block["compared"]
    text = {
        checkpoint_diff.SAME: "same",
        checkpoint_diff.DIFFERS: "DIFFERS" if compared else "differs",
        checkpoint_diff.UNRECORDED: "not recorded",
        checkpoint_diff.ONLY_A: "DIFFERS: recorded in A only" if compared else "recorded in A only",
        checkpoint_diff.ONLY_B: "DIFFERS: recorded in B only" if compared else "recorded in B only",
    }[status]
    return text if compared else f"{text} (shown, not compared)"


def _print_timeline(result: dict[str, Any], metrics: list[str]) -> None:
    rows = result["checkpoints"]
    if not rows:
        print(f"no checkpoints in {result['root']}")
        return
    table = [
        (
            "",
            "STEP",
            "ID",
            "PARENT",
            "CREATED (UTC)",
            "SIZE",
            "STATE",
            "TRUST",
            "VERIFIED",
            *(name.upper() for name in metrics),
            "IDENTITY CHANGED",
        )
    ]
    for row in rows:
        trust = (row.get("trust") or "-") + (" (last good)" if row.get("last_good") else "")
        recorded = row.get("metrics") or {}
        table.append(
            (
                "*" if row["identity_changed"] else "",
                str(row["step"]),
                row["id"] or "-",
                row["parent"] or "-",
                short_time(row["created_at"]),
                human_bytes(row["bytes"]),
                _timeline_state(row),
                trust,
                _verified(row["verification"]),
                *(f"{recorded[name]:.6g}" if name in recorded else "-" for name in metrics),
                ", ".join(row["identity_changed"]),
            )
        )
    print_table(table)
    for row in rows:
        if row.get("resume"):
            print(f"step {row['step']}: {_resume_line(row['resume'])}")
        elif row["cause"]:
            print(f"step {row['step']} {row['id'] or '(no id)'}: {row['state']}: {row['cause']}")
    if any(row["state"] == root_timeline.IN_FLIGHT for row in rows):
        print(
            f"in-flight: no manifest yet and no failure event, last written less than {result['grace_s']:.0f}s ago (--grace)"
        )
    for row in rows:
        if row["identity_changed"]:
            before = join(result["root"], row["compared_with"])
            print(
                f"* step {row['step']} {row['id']}: {', '.join(row['identity_changed'])} changed since {row['compared_with']}; "
                f"see {PROG} diff {before} {row['path']}"
            )


def _timeline_state(row: dict[str, Any]) -> str:
    resume = row.get("resume")
    if not resume:
        return row["state"]
    before, after = resume.get("world_size_before"), resume.get("world_size_after")
    return f"{row['state']} {'?' if before is None else before}->{'?' if after is None else after} ranks"


def _resume_line(resume: dict[str, Any]) -> str:
    """`resumed from step-…-<id> on 2 -> 3 ranks in 1.20s`, with what is unknown said as such."""
    before, after = resume.get("world_size_before"), resume.get("world_size_after")
    ranks = f"{'?' if before is None else before} -> {'?' if after is None else after} ranks"
    text = f"resumed from {resume.get('from') or resume.get('from_path') or 'an unknown checkpoint'} on {ranks}"
    if resume.get("seconds") is not None:
        text += f" in {resume['seconds']:.2f}s"
    if resume.get("identity_differences"):
        text += f"; identity differs: {', '.join(resume['identity_differences'])}"
    return text


def _flatten(value: dict[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, item in (value or {}).items():
        if isinstance(item, dict) and item:
            out.update(_flatten(item, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = item
    return out


def _cell(value: Any, width: int = 48) -> str:
    text = "-" if value is None else value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _verified(verification: dict[str, Any] | None) -> str:
    if not verification:
        return "-"
    return f"{verification.get('mode')} {verification.get('chunks_verified')}/{verification.get('chunks_total')}"


_DIFF_EPILOG = """\
A and B are checkpoint references:
  a path or URL          a checkpoint directory, ROOT/latest, or a root (its latest)
  a selector (no '/')    a step (1000 or step-1000), an id, a directory name, or latest;
                         resolved in --root, else in the root of the other reference
                         (write ./NAME for a directory in the current one)
examples:
  shardckpt diff --root /data/ckpt/run-7 step-500 step-1000
  shardckpt diff /data/ckpt/run-7/latest 500
  shardckpt diff s3://bucket/run-7/latest s3://bucket/run-8/latest --storage-option anon=true

Identical (exit 0): the config, data (version, fingerprint, length, seed), model and code identity
blocks and the topology are equal; a block recorded in neither checkpoint is not compared. Position
(step, epoch, samples consumed) and the run block (command, hosts, logger run) are shown, never compared.
Exit 1: they differ. Exit 2: a reference could not be resolved to a committed checkpoint.
"""


_TIMELINE_EPILOG = """\
Rows are in the order they happened (commit time; for attempts without a manifest, the event's time,
else the directory's last write). STATE is:
  committed    manifest.json exists and validates
  failed       no manifest; the cause comes from the event log, or "no event recorded"
               once the directory is older than --grace
  in-flight    no manifest, no failure event, last written less than --grace seconds ago
  corrupt      manifest.json does not parse or validate
  uncommitted  the event log says committed, but manifest.json is gone (an interrupted deletion)
  skipped      the event log only: a save skipped while another was in flight
Committed checkpoints that retention deleted are not listed. A `*` marks a committed checkpoint whose
config, data, model or code identity or topology differs from the previous committed one (as diff).
"""
