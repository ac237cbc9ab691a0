"""`shardckpt bisect`, `compare` and `export`: find where a run went bad, see what changed, take a checkpoint out."""

from __future__ import annotations

import argparse
import re
from typing import Any

from ..engine.load.global_tensors import GlobalTensorReader
from ..ops import investigate
from ..ops.bisect import DEFAULT_TOP, bisect
from ..ops.checks import parse_check
from ..ops.compare import compare_readers, summary
from ..ops.export import DTYPES, ExportOptions, export_checkpoint
from ..ops.export_formats import FORMATS, SAFETENSORS
from .output import human_bytes, print_json, print_table

EXIT_OK, EXIT_FOUND = 0, 1
_SIZE = re.compile(r"^(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]?i?B?)$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def add_commands(commands: Any, common: argparse.ArgumentParser) -> None:
    search = commands.add_parser(
        "bisect",
        parents=[common],
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
        "--top", type=int, default=DEFAULT_TOP, metavar="N", help="changed tensors listed (default: %(default)s)"
    )
    search.set_defaults(run=cmd_bisect)
    compare = commands.add_parser(
        "compare",
        parents=[common],
        help="per-tensor numeric differences of two checkpoints, largest change first; exit 1 if any differ",
    )
    compare.add_argument("a", metavar="A", help="a checkpoint reference, as for diff")
    compare.add_argument("b", metavar="B", help="a checkpoint reference, as for diff")
    compare.add_argument(
        "--root", metavar="ROOT", help="the root in which selectors (references without '/') are resolved"
    )
    compare.add_argument(
        "--top", type=int, default=20, metavar="N", help="tensors listed (default: %(default)s; 0: all)"
    )
    compare.set_defaults(run=cmd_compare)
    export = commands.add_parser(
        "export",
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EXPORT_EPILOG,
        help="write a checkpoint's tensors as one torch or safetensors artifact",
    )
    export.add_argument("checkpoint", metavar="CKPT", help="a checkpoint directory, a root (its latest) or ROOT/latest")
    export.add_argument("out", metavar="OUT", help="the file to write (a directory with --max-shard-size)")
    export.add_argument("--format", choices=FORMATS, default=SAFETENSORS)
    export.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="safetensors shards of at most SIZE (e.g. 5GB, 500MiB) plus model.safetensors.index.json",
    )
    export.add_argument(
        "--model-only", action="store_true", help="only the model's tensors (model.*), no optimizer state"
    )
    export.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors (default: as saved, bit-exact)"
    )
    export.add_argument(
        "--prefix", default=None, help="strip this from every tensor name that starts with it, e.g. model."
    )
    export.set_defaults(run=cmd_export)


def cmd_bisect(args: argparse.Namespace) -> int:
    location = investigate.open_root(args.root, args.storage_options)
    check, kind = parse_check(args.bad, storage_options=args.storage_options)
    report = bisect(
        location, check, kind=kind, linear=args.linear, run_id=args.run_id, top=args.top, check_name=args.bad
    )
    if args.json:
        print_json(report)
    else:
        _print_bisect(report)
    return EXIT_FOUND if report["first_bad"] else EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    a, b = investigate.resolve_pair(args.a, args.b, args.root, args.storage_options)
    with GlobalTensorReader(a.root, a.entry) as reader_a, GlobalTensorReader(b.root, b.entry) as reader_b:
        changes = compare_readers(reader_a, reader_b)
    counts = summary(changes)
    shown = changes if args.top == 0 else changes[: args.top]
    if args.json:
        print_json({"a": a.path, "b": b.path, "summary": counts, "tensors": [change.to_dict() for change in shown]})
    else:
        print(f"A  {a.path}\nB  {b.path}")
        _print_changes([change.to_dict() for change in shown])
        print(", ".join(f"{count} {name.replace('_', ' ')}" for name, count in counts.items()))
    return EXIT_OK if counts["equal"] == len(changes) else EXIT_FOUND


def cmd_export(args: argparse.Namespace) -> int:
    options = ExportOptions(
        format=args.format,
        max_shard_size=args.max_shard_size,
        model_only=args.model_only,
        dtype=args.dtype,
        prefix=args.prefix,
        storage_options=args.storage_options,
    )
    result = export_checkpoint(args.checkpoint, args.out, options)
    if args.json:
        print_json(result.to_dict())
    else:
        print(
            f"exported {result.checkpoint}: {result.tensors} tensors, {human_bytes(result.bytes_written)} "
            f"in {result.seconds:.2f}s ({human_bytes(result.bytes_read)} read and checksummed)"
        )
        for path in result.files:
            print(f"  {path}")
    return EXIT_OK


def parse_size(text: str) -> int:
    """`5GB`, `500MiB`, `1000000` -> bytes (GB = 10^9, GiB = 2^30, as Hugging Face reads them)."""
    match = _SIZE.match(text.strip())
    if match is None or match["unit"].upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 5GB, 500MiB or a number of bytes")
    return int(float(match["number"]) * _UNITS[match["unit"].upper()])


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
    for name in investigate.SHOWN:
        block = identity["blocks"][name]
        if block["status"] in (investigate.SAME, investigate.UNRECORDED):
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
    for item in affected["tensors"][:DEFAULT_TOP]:
        count = f" ({item['nonfinite']} of {item['numel']} elements non-finite)" if item.get("nonfinite") else ""
        print(f"   {item['fqn']}{count} in {', '.join(item.get('files') or []) or '-'}")
    if len(affected["tensors"]) > DEFAULT_TOP:
        print(f"   ... and {len(affected['tensors']) - DEFAULT_TOP} more (--json lists all)")
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
        _print_changes(affected["changes"], indent="   ")


def _print_changes(changes: list[dict[str, Any]], indent: str = "") -> None:
    rows = [(f"{indent}TENSOR", "STATUS", "MAX ABS", "RELATIVE", "NONFINITE A->B", "SHAPE")]
    for change in changes:
        rows.append(
            (
                f"{indent}{change['fqn']}",
                change["status"],
                _number(change["max_abs"]),
                _number(change["relative"]),
                f"{change['nonfinite_a']}->{change['nonfinite_b']}",
                "x".join(map(str, change["shape_b"] or change["shape_a"] or [])),
            )
        )
    print_table(rows)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


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

_EXPORT_EPILOG = """\
Tensors only (model and, without --model-only, optimizer state), by their checkpoint names (model.layer.weight,
optimizers.0.state.layer.weight.exp_avg), minus --prefix. Every byte read is checked against the manifest;
memory stays near the largest tensor. Loads with torch.load(OUT, weights_only=True) or
safetensors.torch.load_file(OUT).
examples:
  shardckpt export /data/ckpt/run-7 model.safetensors --model-only --prefix model.
  shardckpt export s3://bucket/run-7/latest out/ --max-shard-size 5GB --dtype bf16 --model-only --prefix model.
  shardckpt export /data/ckpt/run-7/step-000001000-2f72c10f8c75 full.pt --format torch
"""
