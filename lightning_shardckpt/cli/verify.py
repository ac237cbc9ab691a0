"""`shardckpt verify`: read every byte of a checkpoint against its checksums; exit 1 names every bad file and tensor."""

from __future__ import annotations

import argparse
from typing import Any

from ..engine.root import open_reference
from . import exit_codes, options
from .output import human_bytes, print_json, print_table


def add_commands(commands: Any) -> None:
    verify = commands.add_parser(
        "verify", parents=[options.common()], help="read and checksum every byte of a checkpoint"
    )
    verify.add_argument("path", metavar="PATH", help="a checkpoint directory, a root or ROOT/latest")
    options.add_public_key(
        verify,
        "verifying",
        help="require a signature by this Ed25519 public key and every file to match the signed SHA-256 digests; "
        "repeat for several accepted keys (rotation)",
    )
    verify.set_defaults(run=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    from ..ops.verify import verify_checkpoint  # here: torch, which --help must not wait for

    location, entry = open_reference("latest", args.path, args.storage_options)
    report = verify_checkpoint(location, entry, public_keys=args.public_key, revoked_keys=args.revoked_key)
    if args.json:
        print_json(report.to_dict())
    elif report.ok:
        print(
            f"OK {report.path}: {report.files} file(s), {report.chunks} chunks, "
            f"{human_bytes(report.bytes_read)} checked in {report.seconds:.2f}s"
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
        print_table(table)
        for problem in report.problems:
            if problem["kind"] == "signature":
                print(f"REFUSED {problem['actual']}")
    return exit_codes.OK if report.ok else exit_codes.FOUND_PROBLEM
