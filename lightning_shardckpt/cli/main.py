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

Each command group is a module here that registers itself with `add_commands(commands)`; this one only builds the
parser from COMMAND_MODULES and dispatches. Exit codes: exit_codes.py (0 ok, 1 found a problem, 2 could not run).
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import ShardCkptError
from . import bisect, compare, drill, exit_codes, export, gc, health, investigate, listing, verify
from .output import PROG

# in `shardckpt --help` order
COMMAND_MODULES = (listing, verify, investigate, gc, drill, health, bisect, compare, export)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help (0) and on bad usage (2)
        return exit_.code if isinstance(exit_.code, int) else exit_codes.CANNOT_RUN
    args.storage_options = dict(args.storage_option)
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        return args.run(args)
    except (ShardCkptError, OSError) as err:
        # one line, no traceback: the message already says what went wrong and what to do
        kind = type(err).__name__
        message = " ".join(str(err).split()) or kind
        print(f"{PROG}: error: {message}" + ("" if isinstance(err, ShardCkptError) else f" ({kind})"), file=sys.stderr)
        return exit_codes.CANNOT_RUN


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.add_commands(commands)
    return parser


if __name__ == "__main__":  # python -m lightning_shardckpt.cli.main, as the installed `shardckpt` script
    sys.exit(main())
