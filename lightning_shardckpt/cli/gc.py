"""`shardckpt gc`: list (by default) or remove uncommitted checkpoint directories older than the grace."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..engine import catalog
from ..engine.root import open_root
from ..ops.gc import DEFAULT_GRACE_S, GcReport, collect
from . import exit_codes, options
from .output import PROG, human_age, human_bytes, print_json, print_table


def add_commands(commands: Any) -> None:
    gc = commands.add_parser(
        "gc",
        parents=[options.common()],
        help="remove uncommitted checkpoint directories older than the grace (dry run by default)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_GC_EPILOG,
    )
    gc.add_argument("root", metavar="ROOT")
    gc.add_argument(
        "--grace-minutes",
        type=options.number(
            "--grace-minutes", at_least=0, too_small="is negative", hint="0: every uncommitted directory"
        ),
        default=DEFAULT_GRACE_S / 60,
        metavar="N",
        help="only directories whose newest file is older than this are removed; a younger one may be a save "
        "in flight (default: %(default).0f)",
    )
    gc.add_argument("--yes", action="store_true", help="delete; without it gc only prints what it would remove")
    gc.set_defaults(run=cmd_gc)


def cmd_gc(args: argparse.Namespace) -> int:
    location = open_root(args.root, args.storage_options)
    report = collect(location, args.grace_minutes * 60.0, dry_run=not args.yes)
    if args.json:
        print_json(report.to_dict())
    else:
        _print_gc(report, args.grace_minutes)
    for item in report.failed:
        print(f"{PROG}: warning: could not remove {item.path}: {item.problem}", file=sys.stderr)
    return exit_codes.FOUND_PROBLEM if report.failed else exit_codes.OK


def _print_gc(report: GcReport, grace_minutes: float) -> None:
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
                (action, str(item.step), item.id, item.state, human_bytes(item.bytes), human_age(item.age_s), reason)
            )
        print_table(table)
    size = human_bytes(sum(item.bytes or 0 for item in remove))
    summary = f"{len(remove)} uncommitted director{'y' if len(remove) == 1 else 'ies'} ({size})"
    if report.dry_run:
        print(
            f"dry run: would remove {summary} older than {grace_minutes:g} min; nothing was deleted"
            + ("; run again with --yes to delete" if remove else "")
        )
    else:
        print(f"removed {summary} older than {grace_minutes:g} min")
    print(f"kept {len(committed)} committed checkpoint(s) untouched")


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
