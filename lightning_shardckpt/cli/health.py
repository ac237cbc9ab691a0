"""`shardckpt health`: is this root healthy by its run's rules? A table, JSON, or a plot; exit 1 while a rule fires."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..engine.root import open_root
from ..errors import ConfigError, ShardCkptError
from ..ops.health_plot import plot
from ..ops.health_report import evaluate_root
from ..policies.health.rules import HealthConfig, load_rules_file
from . import exit_codes, options


def add_commands(commands: Any) -> None:
    health = commands.add_parser(
        "health",
        parents=[options.common()],
        help="evaluate health rules over a root's event history: owner, normal range, firing since, mitigation; exit 1 while one fires",
    )
    health.add_argument("root", metavar="ROOT")
    health.add_argument(
        "--rules",
        metavar="FILE",
        default=None,
        help="a rules file (e.g. conf/health/default.yaml); default: the rules the run recorded in the root",
    )
    health.add_argument(
        "--plot",
        metavar="OUT.png",
        default=None,
        help=(
            "also draw each varying metric over steps with its normal band and firing periods shaded; "
            "constant series and rules without data go into one text panel (matplotlib)"
        ),
    )
    health.set_defaults(run=cmd_health)


def _rules_file(path: str) -> HealthConfig:
    """The rules of `--rules`; a file that does not parse or holds a wrong type is a ConfigError naming it
    (exit 2, could not run), never a crash that exits 1, which means "a rule fires"."""
    try:
        return load_rules_file(path)
    except Exception as err:  # noqa: BLE001 - YAML syntax, a string where a number goes: the file is the problem
        message = " ".join(str(err).split())
        if isinstance(err, ShardCkptError):
            if path in message:
                raise
            raise ConfigError(f"health rules file {path}: {message}") from err
        raise ConfigError(
            f"health rules file {path} cannot be used ({type(err).__name__}: {message}); fix the file "
            "(conf/health/default.yaml shows every field with its type)"
        ) from err


def cmd_health(args: argparse.Namespace) -> int:
    location = open_root(args.root, args.storage_options)
    config = _rules_file(args.rules) if args.rules else None
    report = evaluate_root(location, config)
    if args.plot:
        drawn = plot(report, args.plot)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1, sort_keys=True, default=str))
    else:
        print(f"{location.url}: rules {report.rules_source}")
        rows = [("RULE", "SLICE", "OWNER", "NORMAL", "VALUE", "FIRING SINCE", "MITIGATION")]
        for row in report.rows():
            since = f"step {row['firing_since_step']} ({row['firing_since']})" if row["firing"] else "-"
            mitigation = row["mitigation"] + (f": {row['mitigation_taken']}" if row.get("mitigation_taken") else "")
            value = "-" if row["value"] is None else f"{row['value']:.4g}"
            key = row["slice"] + ("" if row["key"] is None else f"={row['key']}")
            rows.append((row["rule"], key, row["owner"], row["normal"], value, since, mitigation))
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
        for cells in rows:
            print("  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths)).rstrip())
        firing = [row for row in report.rows() if row["firing"]]
        print(
            f"{len(firing)} firing"
            + (": " + ", ".join(f"{r['rule']} ({r['severity']}, owner {r['owner']})" for r in firing) if firing else "")
        )
        if args.plot:
            print(
                f"plot: {args.plot} ({len(drawn.panels)} panels; {len(drawn.constant)} constant series and "
                f"{len(drawn.no_data)} rules without data listed in its text panel)"
            )
    return exit_codes.FOUND_PROBLEM if report.firing else exit_codes.OK
