"""`shardckpt ls` and `shardckpt inspect`: which checkpoints a root holds, and what one manifest says."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..ops.roots import CheckpointInfo, CheckpointListing, list_checkpoints, read_manifest_summary
from . import exit_codes, options, tiers
from .output import human_age, human_bytes, print_json, print_table


def add_commands(commands: Any) -> None:
    ls = commands.add_parser("ls", parents=[options.common()], help="list the checkpoints under a root")
    ls.add_argument("root", metavar="ROOT")
    options.add_public_key(
        ls,
        "listing",
        help="show each committed checkpoint's signature against this Ed25519 public key (signed by its key id, "
        "refused and why, unsigned) and star the `latest` a resume requiring it loads; repeat for several keys",
    )
    tiers.add_arguments(ls)
    ls.set_defaults(run=cmd_ls)
    inspect = commands.add_parser("inspect", parents=[options.common()], help="summarise one checkpoint's manifest")
    inspect.add_argument("path", metavar="PATH", help="a checkpoint directory, or a root (its latest)")
    inspect.set_defaults(run=cmd_inspect)


def cmd_ls(args: argparse.Namespace) -> int:
    if args.public_key and "{node_rank}" in args.root and not args.durable:
        print("shardckpt ls: --public-key lists one root; list a node's root on its own", file=sys.stderr)
        return exit_codes.CANNOT_RUN
    if args.durable:  # tiers: both side by side (tiers.py)
        return tiers.cmd_ls_tiers(args)
    if "{node_rank}" in args.root:  # a node-local fast tier: on which nodes each checkpoint is complete
        return tiers.cmd_ls_nodes(args)
    listing = list_checkpoints(
        args.root, storage_options=args.storage_options, public_keys=args.public_key, revoked_keys=args.revoked_key
    )
    rows = [_ls_row(info, listing) for info in listing.checkpoints]
    if args.json:
        print_json(
            {
                "root": listing.root,
                "latest": listing.latest.name if listing.latest else None,
                "last_good": listing.last_good.name if listing.last_good else None,
                "latest_pointer": listing.latest_pointer,
                "checkpoints": rows,
                "malformed_drill_records": list(listing.malformed_drill_records),
            }
        )
        return exit_codes.OK
    if not rows:
        print(f"no checkpoints in {listing.root}")
        return exit_codes.OK
    signed = bool(args.public_key)
    table = [("STEP", "ID", "STATE", "TRUST", *(("SIGNATURE",) if signed else ()), "SIZE", "REFERENCED", "AGE")]
    table[0] += ("LATEST", "NAME")
    for row in rows:
        marks = ("*" if row["latest"] else "") + (" good" if row["last_good"] else "")
        table.append(
            (
                str(row["step"]),
                row["id"],
                row["state"],
                row["trust"] or "-",
                *((_signature_cell(row),) if signed else ()),
                human_bytes(row["bytes"]),
                human_bytes(row["bytes_referenced"]) if row["bytes_referenced"] else "-",
                human_age(row["age_s"]),
                marks.strip(),
                row["name"],
            )
        )
    print_table(table)
    print(
        "LATEST: * = what ckpt_path='latest' resumes; good = the last known-good (newest drilled), ckpt_path='last-good'"
        + (" (with require_signature and these keys)" if signed else "")
    )
    if signed:
        print("SIGNATURE: signed:KEY-ID (an accepted key signed the manifest; verify --public-key checks the files)")
    for line in listing.malformed_drill_records:
        print(f"NOT TRUSTED: drill record {line}")
    if any(row["bytes_referenced"] for row in rows):
        print(
            "SIZE: the checkpoint's own files; REFERENCED: unchanged chunks it reads from earlier checkpoints (incremental saves)"
        )
    for row in rows:
        if row["problem"]:
            print(f"{row['name']}: {row['problem']}")
        if row["signature"] == "refused":  # unsigned says it all; a refusal says which key, or what changed
            print(f"{row['name']}: refused: {row['signature_problem']}")
    return exit_codes.OK


def _signature_cell(row: dict[str, Any]) -> str:
    if row["signature"] == "signed":
        return f"signed:{row['signed_by'][:16]}"
    return row["signature"] or "-"


def cmd_inspect(args: argparse.Namespace) -> int:
    manifest = read_manifest_summary(args.path, storage_options=args.storage_options)
    identity = manifest.identity
    summary: dict[str, Any] = {
        "path": manifest.path,
        "id": manifest.checkpoint_id,
        "parent": manifest.parent,
        "run_id": manifest.run_id,
        "step": manifest.step,
        "epoch": manifest.epoch,
        "samples_consumed": manifest.samples_consumed,
        "created_at": manifest.created_at.isoformat(timespec="milliseconds"),
        "format_version": manifest.format_version,
        "writer": manifest.writer,
        "topology": manifest.topology,
        "files": {"count": manifest.file_count, "bytes": manifest.bytes},
        "referenced": {"files": manifest.referenced_file_count, "bytes": manifest.bytes_referenced},
        "tensors": manifest.tensor_count,
        "objects": manifest.object_count,
        "verification": manifest.verification,
        "identity": {"keys": sorted(identity), "filled": sorted(key for key, value in identity.items() if value)},
    }
    if args.json:
        print_json(summary)
        return exit_codes.OK
    files = summary["files"]
    summary["files"] = f"{files['count']} ({human_bytes(files['bytes'])}, {files['bytes']} bytes)"
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
    return exit_codes.OK


def _ls_row(info: CheckpointInfo, listing: CheckpointListing) -> dict[str, Any]:
    return {
        "name": info.name,
        "path": info.path,
        "step": info.step,
        "id": info.checkpoint_id,
        "state": info.state,
        "bytes": info.bytes,
        "bytes_referenced": info.bytes_referenced,  # incremental (FORMAT.md §9)
        "age_s": None if info.age_s is None else round(info.age_s, 3),
        "latest": listing.latest is not None and info.name == listing.latest.name,
        "trust": info.trust,  # committed | drilled | drill-failed | not-drilled (None: not committed)
        "last_good": listing.last_good is not None and info.name == listing.last_good.name,
        "problem": info.problem,
        # commit order (docs/FORMAT.md §4): which run wrote it, its place in that run, what it followed
        "run_id": info.run_id,
        "seq": info.seq,
        "parent": info.parent,
        # with --public-key: signed (signed_by: the key id) | unsigned | refused (signature_problem: why); else None
        "signature": info.signature,
        "signed_by": info.signed_by,
        "signature_problem": info.signature_problem,
    }
