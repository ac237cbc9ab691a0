"""The `shardckpt` command: list, inspect, verify, diff and trace checkpoints on any fsspec storage.

    shardckpt ls ROOT                      committed, uncommitted and corrupt checkpoints; which is latest
    shardckpt inspect ROOT|DIR             one manifest, summarised
    shardckpt verify ROOT/latest|DIR       full checksum pass; exit 1 names every bad file and tensor
    shardckpt diff A B                     config / data / model / code identity and topology, side by side
    shardckpt timeline ROOT                every checkpoint, attempt and resume in order: state, cause, identity changes
    shardckpt gc ROOT [--yes]              uncommitted directories older than the grace: list (default) or remove
    shardckpt health ROOT [--plot OUT.png] health rules over the root's events: owner, normal range, firing, mitigation
    shardckpt drill ROOT|DIR / last-good   restore drills; the newest drilled checkpoint
    shardckpt bisect ROOT --bad CHECK      the earliest known-bad checkpoint, the last known-good, what changed
    shardckpt compare A B                  per-tensor numeric differences of two checkpoints (any world sizes)
    shardckpt export CKPT OUT              one torch or safetensors file (or shards) of the global tensors

Exit codes: 0 success (verify: sound; diff: identical), 1 verify found problems, diff found differences or
gc could not remove a directory, health found a rule firing, 2 the command could not run (no such checkpoint, unreachable storage, bad
arguments).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from ..engine import catalog
from ..engine.format import drill_records
from ..engine.format import manifest as manifest_format
from ..engine.format.layout import join
from ..engine.storage.fsio import Location
from ..errors import ShardCkptError
from ..ops import gc, investigate
from ..ops.verify import verify_checkpoint
from . import drill as cli_drill
from . import health as cli_health
from . import investigate as cli_investigate
from . import tiers as cli_tiers
from .output import human_bytes as _human_bytes
from .output import print_json as _print_json
from .output import print_table as _print_table

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR = 0, 1, 2
PROG = "shardckpt"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help (0) and on bad usage (2)
        return exit_.code if isinstance(exit_.code, int) else EXIT_ERROR
    args.storage_options = dict(args.storage_option)
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        return args.run(args)
    except (ShardCkptError, OSError) as err:
        # one line, no traceback: the message already says what went wrong and what to do
        kind = type(err).__name__
        message = " ".join(str(err).split()) or kind
        print(f"{PROG}: error: {message}" + ("" if isinstance(err, ShardCkptError) else f" ({kind})"), file=sys.stderr)
        return EXIT_ERROR


# --- subcommands ---


def cmd_ls(args: argparse.Namespace) -> int:
    if args.durable:  # tiers: both side by side (cli_tiers.py)
        return cli_tiers.cmd_ls_tiers(args, _storage_option)
    location = investigate.open_root(args.root, args.storage_options)
    entries = catalog.list_checkpoints(location)
    latest = catalog.resolve_latest(location, entries)
    trust = drill_records.trust_states(location, entries)  # one listing of ROOT/drills/: no record is read
    good = catalog.last_good(location, entries)
    rows = [_ls_row(entry, location, latest, trust, good[-1] if good else None) for entry in entries]
    if args.json:
        _print_json(
            {
                "root": location.url,
                "latest": latest.name if latest else None,
                "last_good": good[-1].name if good else None,
                "latest_pointer": catalog.read_latest_pointer(location),
                "checkpoints": rows,
            }
        )
        return EXIT_OK
    if not rows:
        print(f"no checkpoints in {location.url}")
        return EXIT_OK
    table = [("STEP", "ID", "STATE", "TRUST", "SIZE", "REFERENCED", "AGE", "LATEST", "NAME")]
    for row in rows:
        marks = ("*" if row["latest"] else "") + (" good" if row["last_good"] else "")
        table.append(
            (
                str(row["step"]),
                row["id"],
                row["state"],
                row["trust"] or "-",
                _human_bytes(row["bytes"]),
                _human_bytes(row["bytes_referenced"]) if row["bytes_referenced"] else "-",
                _human_age(row["age_s"]),
                marks.strip(),
                row["name"],
            )
        )
    _print_table(table)
    print(
        "LATEST: * = what ckpt_path='latest' resumes; good = the last known-good (newest drilled), ckpt_path='last-good'"
    )
    if any(row["bytes_referenced"] for row in rows):
        print(
            "SIZE: the checkpoint's own files; REFERENCED: unchanged chunks it reads from earlier checkpoints (incremental saves)"
        )
    for row in rows:
        if row["problem"]:
            print(f"{row['name']}: {row['problem']}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    location, entry = _open(args.path, args.storage_options)
    manifest = entry.manifest
    identity = manifest.get("identity") or {}
    summary = {
        "path": join(location.url, entry.name),
        "id": manifest["id"],
        "parent": manifest.get("parent"),
        "run_id": manifest.get("run_id"),
        "step": manifest["step"],
        "epoch": manifest.get("epoch"),
        "samples_consumed": manifest.get("samples_consumed"),
        "created_at": manifest["created_at"],
        "format_version": manifest["format_version"],
        "writer": manifest.get("writer"),
        "topology": manifest["topology"],
        "files": {"count": len(manifest["files"]), "bytes": manifest_format.total_bytes(manifest)},
        "referenced": {
            "files": len(manifest.get("references") or []),
            "bytes": manifest_format.referenced_bytes(manifest),
        },
        "tensors": len(manifest["tensors"]),
        "objects": len(manifest["objects"]),
        "verification": manifest.get("verification"),
        "identity": {"keys": sorted(identity), "filled": sorted(key for key, value in identity.items() if value)},
    }
    if args.json:
        _print_json(summary)
        return EXIT_OK
    files = summary["files"]
    summary["files"] = f"{files['count']} ({_human_bytes(files['bytes'])}, {files['bytes']} bytes)"
    referenced = summary["referenced"]
    summary["referenced"] = (
        f"{referenced['bytes']} bytes in {referenced['files']} file(s) of earlier checkpoints"
        if referenced["files"]
        else "none (a full checkpoint)"
    )
    summary["identity"] = ", ".join(
        f"{key}{'' if key in summary['identity']['filled'] else ' (empty)'}" for key in summary["identity"]["keys"]
    )
    width = max(len(key) for key in summary)
    for key, value in summary.items():
        text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value
        print(f"{key:<{width}}  {'-' if text is None else text}")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    location, entry = _open(args.path, args.storage_options)
    report = verify_checkpoint(location, entry)
    if args.json:
        _print_json(report.to_dict())
    elif report.ok:
        print(
            f"OK {report.path}: {report.files} file(s), {report.chunks} chunks, "
            f"{_human_bytes(report.bytes_read)} checked in {report.seconds:.2f}s"
        )
    else:
        print(
            f"CORRUPT {report.path}: {len(report.problems)} problem(s) in {report.files} file(s), {report.chunks} chunks"
        )
        table = [("KIND", "FILE", "TENSOR", "EXPECTED", "ACTUAL")]
        for problem in report.problems:
            table.append(
                (
                    problem["kind"],
                    problem["file"],
                    problem["tensor"] or "-",
                    str(problem["expected"]),
                    str(problem["actual"]),
                )
            )
        _print_table(table)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def cmd_diff(args: argparse.Namespace) -> int:
    a, b = investigate.resolve_pair(args.a, args.b, args.root, args.storage_options)
    result = investigate.diff(a, b)
    if args.json:
        _print_json(result)
    else:
        _print_diff(result)
    return EXIT_OK if result["identical"] else EXIT_PROBLEMS


def cmd_timeline(args: argparse.Namespace) -> int:
    location = investigate.open_root(args.root, args.storage_options)
    result = investigate.timeline(location, grace_s=args.grace)
    if result["events_problem"]:
        print(f"{PROG}: warning: {result['events_problem']}; causes are not shown", file=sys.stderr)
    if args.json:
        _print_json(result)
    else:
        _print_timeline(result, args.metric)
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    location = investigate.open_root(args.root, args.storage_options)
    report = gc.collect(location, args.grace_minutes * 60.0, dry_run=not args.yes)
    if args.json:
        _print_json(report.to_dict())
    else:
        _print_gc(report, args.grace_minutes)
    for item in report.failed:
        print(f"{PROG}: warning: could not remove {item.path}: {item.problem}", file=sys.stderr)
    return EXIT_PROBLEMS if report.failed else EXIT_OK


# --- printing gc, diff and timeline ---


def _print_gc(report: gc.GcReport, grace_minutes: float) -> None:
    remove, kept = report.to_remove, report.kept
    committed = [item for item in kept if item.state == catalog.COMMITTED and not item.problem]
    shown = [item for item in kept if item not in committed]
    if remove or shown:
        table = [("ACTION", "STEP", "ID", "STATE", "SIZE", "AGE", "REASON")]
        verb = "REMOVED" if not report.dry_run else "REMOVE"
        for item in [*remove, *shown]:
            reason = item.reason + (f" ({item.problem})" if item.problem else "")
            action = verb if item.action == "remove" else "KEEP"
            table.append(
                (action, str(item.step), item.id, item.state, _human_bytes(item.bytes), _human_age(item.age_s), reason)
            )
        _print_table(table)
    size = _human_bytes(sum(item.bytes or 0 for item in remove))
    summary = f"{len(remove)} uncommitted director{'y' if len(remove) == 1 else 'ies'} ({size})"
    if report.dry_run:
        print(
            f"dry run: would remove {summary} older than {grace_minutes:g} min; nothing was deleted"
            + ("; run again with --yes to delete" if remove else "")
        )
    else:
        print(f"removed {summary} older than {grace_minutes:g} min")
    print(f"kept {len(committed)} committed checkpoint(s) untouched")


def _print_diff(result: dict[str, Any]) -> None:
    for side in ("a", "b"):
        head = result[side]
        print(
            f"{side.upper()}  {head['name']}  step {head['step']}  created {_short_time(head['created_at'])}  {head['path']}"
        )
    unrecorded = []
    for name in investigate.SHOWN:
        block = result["blocks"][name]
        print(f"\n{name}: {_diff_status(block)}")
        if block["status"] == investigate.UNRECORDED:
            unrecorded += [name] if block["compared"] else []
            continue
        a, b = _flatten(block["a"]), _flatten(block["b"])
        table = [("  FIELD", "A", "B", "")]
        for key in [*a, *(key for key in b if key not in a)]:
            table.append((f"  {key}", _cell(a.get(key)), _cell(b.get(key)), "*" if a.get(key) != b.get(key) else ""))
        _print_table(table)
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
        investigate.SAME: "same",
        investigate.DIFFERS: "DIFFERS" if compared else "differs",
        investigate.UNRECORDED: "not recorded",
        investigate.ONLY_A: "DIFFERS: recorded in A only" if compared else "recorded in A only",
        investigate.ONLY_B: "DIFFERS: recorded in B only" if compared else "recorded in B only",
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
                _short_time(row["created_at"]),
                _human_bytes(row["bytes"]),
                _timeline_state(row),
                trust,
                _verified(row["verification"]),
                *(f"{recorded[name]:.6g}" if name in recorded else "-" for name in metrics),
                ", ".join(row["identity_changed"]),
            )
        )
    _print_table(table)
    for row in rows:
        if row.get("resume"):
            print(f"step {row['step']}: {_resume_line(row['resume'])}")
        elif row["cause"]:
            print(f"step {row['step']} {row['id'] or '(no id)'}: {row['state']}: {row['cause']}")
    if any(row["state"] == investigate.IN_FLIGHT for row in rows):
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


def _short_time(stamp: str | None) -> str:
    return "-" if stamp is None else stamp[:19].replace("T", " ")


def _verified(verification: dict[str, Any] | None) -> str:
    if not verification:
        return "-"
    return f"{verification.get('mode')} {verification.get('chunks_verified')}/{verification.get('chunks_total')}"


# --- helpers ---


def _open(path: str, storage_options: dict[str, Any]) -> tuple[Location, catalog.CheckpointEntry]:
    """A checkpoint directory, a root (then its latest), or `ROOT/latest`."""
    return investigate.open_path(path, storage_options)


def _ls_row(
    entry: catalog.CheckpointEntry,
    location: Location,
    latest: catalog.CheckpointEntry | None,
    trust: dict[str, str],
    last_good: catalog.CheckpointEntry | None,
) -> dict[str, Any]:
    age = catalog.age_seconds(entry, location)
    return {
        "name": entry.name,
        "path": join(location.url, entry.name),
        "step": entry.step,
        "id": entry.checkpoint_id,
        "state": entry.state,
        "bytes": catalog.size_bytes(entry, location),
        "bytes_referenced": (entry.record or {}).get("bytes_referenced", 0),  # incremental (FORMAT.md §9)
        "age_s": None if age is None else round(age, 3),
        "latest": latest is not None and entry.name == latest.name,
        "trust": trust.get(entry.name),  # committed | drilled | drill-failed | not-drilled (None: not committed)
        "last_good": last_good is not None and entry.name == last_good.name,
        "problem": entry.problem,
        # commit order (docs/FORMAT.md §4): which run wrote it, its place in that run, what it followed
        "run_id": entry.run_id,
        "seq": entry.seq,
        "parent": (entry.record or {}).get("parent"),
    }


def _storage_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. endpoint_url=http://localhost:9000)")
    try:
        return key, json.loads(value)  # true, 3, {"region_name": "x"} keep their types
    except json.JSONDecodeError:
        return key, value


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    common.add_argument(
        "--storage-option",
        dest="storage_option",
        metavar="KEY=VALUE",
        action="append",
        type=_storage_option,
        default=[],
        help="passed to fsspec (repeatable); VALUE is parsed as JSON when it can be, e.g. anon=true",
    )
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = commands.add_parser("ls", parents=[common], help="list the checkpoints under a root")
    ls.add_argument("root", metavar="ROOT")
    cli_tiers.add_arguments(ls)
    ls.set_defaults(run=cmd_ls)
    inspect = commands.add_parser("inspect", parents=[common], help="summarise one checkpoint's manifest")
    inspect.add_argument("path", metavar="PATH", help="a checkpoint directory, or a root (its latest)")
    inspect.set_defaults(run=cmd_inspect)
    verify = commands.add_parser("verify", parents=[common], help="read and checksum every byte of a checkpoint")
    verify.add_argument("path", metavar="PATH", help="a checkpoint directory, a root or ROOT/latest")
    verify.set_defaults(run=cmd_verify)
    diff = commands.add_parser(
        "diff",
        parents=[common],
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
        parents=[common],
        help="every checkpoint and attempt in order: state, cause, identity changes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_TIMELINE_EPILOG,
    )
    timeline.add_argument("root", metavar="ROOT")
    timeline.add_argument(
        "--grace",
        type=float,
        default=investigate.IN_FLIGHT_GRACE_S,
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
    collect = commands.add_parser(
        "gc",
        parents=[common],
        help="remove uncommitted checkpoint directories older than the grace (dry run by default)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_GC_EPILOG,
    )
    collect.add_argument("root", metavar="ROOT")
    collect.add_argument(
        "--grace-minutes",
        type=_non_negative,
        default=gc.DEFAULT_GRACE_S / 60,
        metavar="N",
        help="only directories whose newest file is older than this are removed; a younger one may be a save "
        "in flight (default: %(default).0f)",
    )
    collect.add_argument("--yes", action="store_true", help="delete; without it gc only prints what it would remove")
    collect.set_defaults(run=cmd_gc)
    cli_drill.add_commands(commands, common)
    cli_health.add_commands(commands, common)
    cli_investigate.add_commands(commands, common)
    return parser


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of minutes") from None
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"{text} is negative; use 0 (every uncommitted directory) or more minutes")
    return value


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

_GC_EPILOG = """\
Removes only uncommitted checkpoint directories (no manifest.json: a failed or abandoned save) whose
newest file is older than --grace-minutes, with any stray .manifest.json.<hex>.tmp inside them. Never
touched: committed checkpoints (retention's job), corrupt ones (listed for a person to look at),
anything younger than the grace (a save may be writing it), and every name that is not a checkpoint
directory. An empty directory ages by its own mtime on local storage; on an object store an empty
prefix holds nothing and is removed whatever the grace.
examples:
  shardckpt gc /data/ckpt/run-7                      what would go (dry run)
  shardckpt gc /data/ckpt/run-7 --yes                remove it
  shardckpt gc s3://bucket/run-7 --grace-minutes 240 --yes --json
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


def _human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"
