"""The `shardckpt` command: list, inspect, verify, diff and trace checkpoints on any fsspec storage.

    shardckpt ls ROOT                      committed, uncommitted and corrupt checkpoints; which is latest
    shardckpt inspect ROOT|DIR             one manifest, summarised
    shardckpt verify ROOT/latest|DIR       full checksum pass; exit 1 names every bad file and tensor
    shardckpt diff A B                     config / data / model / code identity and topology, side by side
    shardckpt timeline ROOT                every checkpoint, attempt and resume in order: state, cause, identity changes
    shardckpt gc ROOT [--yes]              uncommitted directories older than the grace: list (default) or remove
    shardckpt health ROOT [--plot OUT.png] health rules over the root's events: owner, normal range, firing, mitigation
    shardckpt drill ROOT|DIR               restore drill: load in fresh processes on another world size, record the verdict
    shardckpt last-good ROOT               the newest checkpoint that passed a restore drill
    shardckpt bisect ROOT --bad CHECK      the earliest known-bad checkpoint, the last known-good, what changed
    shardckpt compare A B                  per-tensor numeric differences of two checkpoints (any world sizes)
    shardckpt export CKPT OUT              one torch or safetensors file (or shards) of the global tensors

`shardckpt` alone prints this list. Building the parser imports no torch (the commands import what they
need when they run), so `--help` and `ls` answer in well under a second (benchmarks/cli_startup.py).

Each command group is a module here that registers itself with `add_commands(commands)`; this one only builds the
parser from COMMAND_MODULES and dispatches. Exit codes: exit_codes.py (0 ok, 1 found a problem, 2 could not run),
shown in every command's --help. Any error while a command runs is one line on stderr and exit 2, never a
traceback (SHARDCKPT_DEBUG=1 or --debug adds it) and never exit 1, which means "found a problem".
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from ..errors import ShardCkptError
from . import bisect, compare, drill, examples, exit_codes, export, gc, health, investigate, listing, verify
from .output import PROG

# in `shardckpt --help` order
COMMAND_MODULES = (listing, verify, investigate, gc, drill, health, bisect, compare, export)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # a newcomer's first try: the list of commands, not a usage error
        parser.print_help()
        return exit_codes.OK
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help (0) and on bad usage (2)
        return exit_.code if isinstance(exit_.code, int) else exit_codes.CANNOT_RUN
    args.storage_options = dict(args.storage_option)
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        return args.run(args)
    except Exception as err:  # noqa: BLE001 - whatever it is, the command could not run: one line, exit 2
        if args.debug or os.environ.get("SHARDCKPT_DEBUG", "") not in ("", "0"):
            traceback.print_exc()
        print(f"{PROG}: error: {explain(err)}", file=sys.stderr)
        return exit_codes.CANNOT_RUN


def explain(err: BaseException) -> str:
    """One line: what went wrong and the fix. The project's own errors already name the fix."""
    message = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, ShardCkptError):
        return message
    kinds = {cls.__name__ for cls in type(err).__mro__}
    if kinds & {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}:
        return (
            f"{message}: the storage needs credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE), or pass --storage-option key=... --storage-option secret=..."
        )
    if isinstance(err, PermissionError):
        return (
            f"{message} (PermissionError): the storage refused access; check the credentials (AWS_* variables, "
            "--storage-option key=/secret=) and that they may read this path"
        )
    if isinstance(err, FileNotFoundError):
        return f"{message} (FileNotFoundError): no such path; check the root or checkpoint path (`shardckpt ls ROOT`)"
    if isinstance(err, OSError) or kinds & {"BotoCoreError", "ClientError"}:
        return f"{message} ({type(err).__name__}): the storage could not be reached or read; check the path and --storage-option"
    return f"{message} ({type(err).__name__}, unexpected: not a finding; SHARDCKPT_DEBUG=1 prints the traceback)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="\n\n".join(__doc__.split("\n\n")[:2]),  # the line above and the table of every command
        epilog=exit_codes.__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error (or SHARDCKPT_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.add_commands(commands)
    for name, command in commands.choices.items():  # each command's --help ends with what its exit codes mean
        command.formatter_class = argparse.RawDescriptionHelpFormatter
        parts = (command.epilog, examples.epilog(name), exit_codes.epilog(name))
        command.epilog = "\n\n".join(part for part in parts if part)
    return parser


if __name__ == "__main__":  # python -m lightning_shardckpt.cli.main, as the installed `shardckpt` script
    sys.exit(main())
