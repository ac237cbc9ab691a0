"""`shardckpt ls` and `shardckpt inspect`: which checkpoints a root holds, and what one manifest says."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..engine import catalog
from ..engine.format import drill_records
from ..engine.format import manifest as manifest_format
from ..engine.format.layout import join
from ..engine.storage.fsio import Location
from ..ops import investigate
from . import exit_codes, options, tiers
from .output import human_age, human_bytes, print_json, print_table


def add_commands(commands: Any) -> None:
    ls = commands.add_parser("ls", parents=[options.common()], help="list the checkpoints under a root")
    ls.add_argument("root", metavar="ROOT")
    tiers.add_arguments(ls)
    ls.set_defaults(run=cmd_ls)
    inspect = commands.add_parser("inspect", parents=[options.common()], help="summarise one checkpoint's manifest")
    inspect.add_argument("path", metavar="PATH", help="a checkpoint directory, or a root (its latest)")
    inspect.set_defaults(run=cmd_inspect)


def cmd_ls(args: argparse.Namespace) -> int:
    if args.durable:  # tiers: both side by side (tiers.py)
        return tiers.cmd_ls_tiers(args)
    if "{node_rank}" in args.root:  # a node-local fast tier: on which nodes each checkpoint is complete
        return tiers.cmd_ls_nodes(args)
    location = investigate.open_root(args.root, args.storage_options)
    entries = catalog.list_checkpoints(location)
    latest = catalog.resolve_latest(location, entries)
    report = drill_records.trust_report(location, entries)  # one listing of ROOT/drills/, passed records read
    trust = report.states
    good = catalog.last_good(location, entries)
    rows = [_ls_row(entry, location, latest, trust, good[-1] if good else None) for entry in entries]
    if args.json:
        print_json(
            {
                "root": location.url,
                "latest": latest.name if latest else None,
                "last_good": good[-1].name if good else None,
                "latest_pointer": catalog.read_latest_pointer(location),
                "checkpoints": rows,
                "malformed_drill_records": report.malformed,
            }
        )
        return exit_codes.OK
    if not rows:
        print(f"no checkpoints in {location.url}")
        return exit_codes.OK
    table = [("STEP", "ID", "STATE", "TRUST", "SIZE", "REFERENCED", "AGE", "LATEST", "NAME")]
    for row in rows:
        marks = ("*" if row["latest"] else "") + (" good" if row["last_good"] else "")
        table.append(
            (
                str(row["step"]),
                row["id"],
                row["state"],
                row["trust"] or "-",
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
    )
    for line in report.malformed:
        print(f"NOT TRUSTED: drill record {line}")
    if any(row["bytes_referenced"] for row in rows):
        print(
            "SIZE: the checkpoint's own files; REFERENCED: unchanged chunks it reads from earlier checkpoints (incremental saves)"
        )
    for row in rows:
        if row["problem"]:
            print(f"{row['name']}: {row['problem']}")
    return exit_codes.OK


def cmd_inspect(args: argparse.Namespace) -> int:
    location, entry = investigate.open_path(args.path, args.storage_options)
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
        "files": {"count": len(manifest_format.files_of(manifest)), "bytes": manifest_format.total_bytes(manifest)},
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
