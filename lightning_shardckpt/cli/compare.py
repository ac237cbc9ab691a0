"""`shardckpt compare`: per-tensor numeric differences of two checkpoints (any world sizes), largest change first."""

from __future__ import annotations

import argparse
from typing import Any

from ..ops import references
from . import exit_codes, options
from .output import print_json, print_table


def add_commands(commands: Any) -> None:
    compare = commands.add_parser(
        "compare",
        parents=[options.common()],
        help="per-tensor numeric differences of two checkpoints, largest change first; exit 1 if any differ",
    )
    compare.add_argument("a", metavar="A", help="a checkpoint reference, as for diff")
    compare.add_argument("b", metavar="B", help="a checkpoint reference, as for diff")
    compare.add_argument(
        "--root", metavar="ROOT", help="the root in which selectors (references without '/') are resolved"
    )
    compare.add_argument(
        "--top",
        type=options.number("--top", integer=True, at_least=0),
        default=20,
        metavar="N",
        help="tensors listed (default: %(default)s; 0: all)",
    )
    options.add_public_key(compare, "comparing")
    compare.set_defaults(run=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    from ..engine.load.global_tensors import GlobalTensorReader  # here: torch, which --help must not wait for
    from ..ops.compare import compare_readers, summary

    a, b = references.resolve_pair(args.a, args.b, args.root, args.storage_options)
    for side in (a, b):
        options.require_signed(side.root, side.entry, args.public_key, args.revoked_key)
    with GlobalTensorReader(a.root, a.entry) as reader_a, GlobalTensorReader(b.root, b.entry) as reader_b:
        changes = compare_readers(reader_a, reader_b)
    counts = summary(changes)
    shown = changes if args.top == 0 else changes[: args.top]
    if args.json:
        print_json({"a": a.path, "b": b.path, "summary": counts, "tensors": [change.to_dict() for change in shown]})
    else:
        print(f"A  {a.path}\nB  {b.path}")
        print_changes([change.to_dict() for change in shown])
        print(", ".join(f"{count} {name.replace('_', ' ')}" for name, count in counts.items()))
    return exit_codes.OK if counts["equal"] == len(changes) else exit_codes.FOUND_PROBLEM


def print_changes(changes: list[dict[str, Any]], indent: str = "") -> None:
    """One row per changed tensor (`TensorChange.to_dict()`); bisect prints its boundary with it too."""
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
