"""`shardckpt bisect`: the earliest known-bad checkpoint of a run, the last known-good before it, what changed."""

from __future__ import annotations

import argparse
from typing import Any

from ..engine.root import open_root
from ..ops import diff as checkpoint_diff
from ..ops.choices import BISECT_TOP
from . import exit_codes, options
from .compare import print_changes
from .output import print_json, print_table


def add_commands(commands: Any) -> None:
    search = commands.add_parser(
        "bisect",
        parents=[options.common()],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_BISECT_EPILOG,
        help="find the earliest known-bad checkpoint and the last known-good before it; exit 1 when a bad one is found",
    )
    search.add_argument("root", metavar="ROOT")
    search.add_argument("--bad", required=True, metavar="CHECK", help="what makes a checkpoint bad (below)")
    search.add_argument("--linear", action="store_true", help="check oldest first, for checks that are not monotone")
    search.add_argument(
        "--run-id", default=None, help="bisect this run's lineage (default: the run `latest` comes from)"
    )
    search.add_argument(
        "--top",
        type=options.number("--top", integer=True, at_least=0),
        default=BISECT_TOP,
        metavar="N",
        help="changed tensors listed (default: %(default)s)",
    )
    search.set_defaults(run=cmd_bisect)


def cmd_bisect(args: argparse.Namespace) -> int:
    from ..ops.bisect import bisect  # here: it imports torch, which `shardckpt --help` must not wait for
    from ..ops.checks import parse_check

    location = open_root(args.root, args.storage_options)
    check, kind = parse_check(args.bad, storage_options=args.storage_options)
    report = bisect(
        location, check, kind=kind, linear=args.linear, run_id=args.run_id, top=args.top, check_name=args.bad
    )
    if args.json:
        print_json(report)
    else:
        _print_bisect(report)
    return exit_codes.FOUND_PROBLEM if report["first_bad"] else exit_codes.OK


# --- printing ---


def _print_bisect(report: dict[str, Any]) -> None:
    print(
        f"bisect {report['root']} --bad {report['check']}: {report['lineage']} committed checkpoint(s) of run "
        f"{report['run_id'] or '-'}, {report['checks_run']} checked ({report['mode']}; at most {report['max_checks']})"
    )
    print_table(
        [
            ("STEP", "SEQ", "VERDICT", "WHY"),
            *(
                (str(row["step"]), str(row["seq"] or "-"), "BAD" if row["bad"] else "good", row["summary"])
                for row in sorted(report["checked"], key=lambda row: (row["seq"] or 0, row["step"]))
            ),
        ]
    )
    bad, good = report["first_bad"], report["last_good"]
    if bad is None:
        print(
            "\nno bad checkpoint: the newest one passes the check"
            + (" (and so, for a monotone check, every one)" if report["mode"] == "binary" else "")
        )
        return
    print(f"\n1. earliest known-bad: step {bad['step']} {bad['name']}, committed {bad['created_at']}")
    print(f"   {bad['path']}")
    if good is None:
        print("   last known-good: none (the run's first checkpoint is already bad)")
    else:
        print(f"   last known-good:     step {good['step']} {good['name']}, committed {good['created_at']}")
        print(f"   {good['path']}")
        _print_identity(report["identity"])
    _print_affected(report["affected"])
    print("\n4. mitigation (not a root cause): resume the last known-good")
    if report["resume"] is None:
        print("   no known-good checkpoint in this lineage to resume")
    else:
        print(f"   Trainer:      {report['resume']['python']}")
        print(f"   Hydra recipe: {report['resume']['hydra']}")


def _print_identity(identity: dict[str, Any]) -> None:
    print("\n2. identity across the boundary (good -> bad):")
    for name in checkpoint_diff.SHOWN:
        block = identity["blocks"][name]
        if block["status"] in (checkpoint_diff.SAME, checkpoint_diff.UNRECORDED):
            continue
        print(f"   {name}: {block['status']}" + ("" if block["compared"] else " (position/run: shown, not compared)"))
        for line in block["lines"]:
            print(f"     {line}")
    verdict = "identical" if identity["identical"] else f"changed: {', '.join(identity['differs'])}"
    print(
        f"   config/data/model/code/topology {verdict}; full table: shardckpt diff {identity['a']['path']} {identity['b']['path']}"
    )


def _print_affected(affected: dict[str, Any]) -> None:
    print(f"\n3. smallest affected slice: {affected['summary']}")
    for item in affected["tensors"][:BISECT_TOP]:
        count = f" ({item['nonfinite']} of {item['numel']} elements non-finite)" if item.get("nonfinite") else ""
        print(f"   {item['fqn']}{count} in {', '.join(item.get('files') or []) or '-'}")
    if len(affected["tensors"]) > BISECT_TOP:
        print(f"   ... and {len(affected['tensors']) - BISECT_TOP} more (--json lists all)")
    if affected["files"]:
        print(
            f"   files: {', '.join(affected['files'])}; written by rank(s): {', '.join(map(str, affected['ranks'])) or '-'}"
        )
    if affected["changes"] is not None:
        counts = affected["change_summary"]
        print(
            f"   against the known-good: {counts['changed']} tensor(s) changed, {counts['equal']} equal, "
            f"{counts['became_nonfinite']} became non-finite; largest changes:"
        )
        print_changes(affected["changes"], indent="   ")


_BISECT_EPILOG = """\
CHECK is one of:
  nonfinite              a NaN/Inf in any model or optimizer tensor (every tensor read, one at a time)
  nonfinite:recorded     the same from the finite flags the writer recorded (no tensor read where recorded)
  verify                 every byte against its checksum
  drill                  the newest recorded restore drill's verdict, or a fresh drill when none is recorded
  metric:NAME>VALUE      a metric recorded at save time (trainer.callback_metrics); also <, >=, <=; NaN is bad
  module:function        your function of a CheckpointHandle (lightning_shardckpt.ops.checks) returning True when bad
Order is commit order along the run's lineage. Binary search (the default) assumes good then bad;
--linear checks oldest first and stops at the first bad one. Exit 1: a bad checkpoint was found.
examples:
  shardckpt bisect /data/ckpt/run-7 --bad nonfinite
  shardckpt bisect /data/ckpt/run-7 --bad 'metric:train/loss>4.0' --json
"""
