"""The `shardckpt` command: list, inspect and verify checkpoints on any fsspec storage.

    shardckpt ls ROOT                      committed, uncommitted and corrupt checkpoints; which is latest
    shardckpt inspect ROOT|DIR             one manifest, summarised
    shardckpt verify ROOT/latest|DIR       full checksum pass; exit 1 names every bad file and tensor

Exit codes: 0 success (verify: sound), 1 verify found problems, 2 the command could not run
(no such checkpoint, unreachable storage, bad arguments).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from . import catalog, fsio, manifest as manifest_format
from .errors import CheckpointNotFound, ConfigError, ShardCkptError
from .fsio import Location
from .layout import LATEST, join, parse_dirname
from .verify import verify_checkpoint

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR = 0, 1, 2
PROG = "shardckpt"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help (0) and on bad usage (2)
        return exit_.code if isinstance(exit_.code, int) else EXIT_ERROR
    args.storage_options = dict(args.storage_option)
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        return args.run(args)
    except (ShardCkptError, OSError) as err:
        # one line, no traceback: the message already says what went wrong and what to do
        kind = type(err).__name__
        message = " ".join(str(err).split()) or kind
        print(f"{PROG}: error: {message}" + ("" if isinstance(err, ShardCkptError) else f" ({kind})"), file=sys.stderr)
        return EXIT_ERROR


# --- subcommands ---

def cmd_ls(args: argparse.Namespace) -> int:
    location = fsio.resolve(args.root, args.storage_options)
    if parse_dirname(location.path) is not None:
        parent = location.path.rstrip("/").rsplit("/", 1)[0]
        raise ConfigError(f"{args.root} is a checkpoint directory; ls takes the root that holds it: {PROG} ls {parent}")
    if not location.fs.exists(location.path):
        raise CheckpointNotFound(f"{args.root} does not exist; check the path (and --storage-option for remote storage)")
    entries = catalog.list_checkpoints(location)
    latest = catalog.resolve_latest(location, entries)
    rows = [_ls_row(entry, location, latest) for entry in entries]
    if args.json:
        _print_json({"root": location.url, "latest": latest.name if latest else None,
                     "latest_pointer": catalog.read_latest_pointer(location), "checkpoints": rows})
        return EXIT_OK
    if not rows:
        print(f"no checkpoints in {location.url}")
        return EXIT_OK
    table = [("STEP", "ID", "STATE", "SIZE", "AGE", "LATEST", "NAME")]
    for row in rows:
        table.append((str(row["step"]), row["id"], row["state"], _human_bytes(row["bytes"]), _human_age(row["age_s"]),
                      "*" if row["latest"] else "", row["name"]))
    _print_table(table)
    for row in rows:
        if row["problem"]:
            print(f"{row['name']}: {row['problem']}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    location, entry = _open(args.path, args.storage_options)
    manifest = entry.manifest
    identity = manifest.get("identity") or {}
    summary = {
        "path": join(location.url, entry.name),
        "id": manifest["id"],
        "parent": manifest.get("parent"),
        "step": manifest["step"],
        "epoch": manifest.get("epoch"),
        "samples_consumed": manifest.get("samples_consumed"),
        "created_at": manifest["created_at"],
        "format_version": manifest["format_version"],
        "writer": manifest.get("writer"),
        "topology": manifest["topology"],
        "files": {"count": len(manifest["files"]), "bytes": manifest_format.total_bytes(manifest)},
        "tensors": len(manifest["tensors"]),
        "objects": len(manifest["objects"]),
        "verification": manifest.get("verification"),
        "identity": {"keys": sorted(identity), "filled": sorted(key for key, value in identity.items() if value)},
    }
    if args.json:
        _print_json(summary)
        return EXIT_OK
    files = summary["files"]
    summary["files"] = f"{files['count']} ({_human_bytes(files['bytes'])}, {files['bytes']} bytes)"
    summary["identity"] = ", ".join(f"{key}{'' if key in summary['identity']['filled'] else ' (empty)'}"
                                    for key in summary["identity"]["keys"])
    width = max(len(key) for key in summary)
    for key, value in summary.items():
        text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value
        print(f"{key:<{width}}  {'-' if text is None else text}")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    location, entry = _open(args.path, args.storage_options)
    report = verify_checkpoint(location, entry)
    if args.json:
        _print_json(report.to_dict())
    elif report.ok:
        print(f"OK {report.path}: {report.files} file(s), {report.chunks} chunks, "
              f"{_human_bytes(report.bytes_read)} checked in {report.seconds:.2f}s")
    else:
        print(f"CORRUPT {report.path}: {len(report.problems)} problem(s) in {report.files} file(s), {report.chunks} chunks")
        table = [("KIND", "FILE", "TENSOR", "EXPECTED", "ACTUAL")]
        for problem in report.problems:
            table.append((problem["kind"], problem["file"], problem["tensor"] or "-",
                          str(problem["expected"]), str(problem["actual"])))
        _print_table(table)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


# --- helpers ---

def _open(path: str, storage_options: dict[str, Any]) -> tuple[Location, catalog.CheckpointEntry]:
    """A checkpoint directory, a root (then its latest), or `ROOT/latest`."""
    head, sep, tail = path.rstrip("/").rpartition("/")
    if sep and head and tail == LATEST:
        location = fsio.resolve(path, storage_options)
        # `ROOT/latest` names the pointer file; it means the root's latest, checked against the manifests
        if not location.fs.isdir(location.path):
            return catalog.open_checkpoint(head, LATEST, storage_options)
    return catalog.open_checkpoint(path, LATEST, storage_options)


def _ls_row(entry: catalog.CheckpointEntry, location: Location, latest: catalog.CheckpointEntry | None) -> dict[str, Any]:
    age = catalog.age_seconds(entry, location)
    return {
        "name": entry.name,
        "path": join(location.url, entry.name),
        "step": entry.step,
        "id": entry.checkpoint_id,
        "state": entry.state,
        "bytes": catalog.size_bytes(entry, location),
        "age_s": None if age is None else round(age, 3),
        "latest": latest is not None and entry.name == latest.name,
        "problem": entry.problem,
    }


def _storage_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. endpoint_url=http://localhost:9000)")
    try:
        return key, json.loads(value)  # true, 3, {"region_name": "x"} keep their types
    except json.JSONDecodeError:
        return key, value


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    common.add_argument(
        "--storage-option", dest="storage_option", metavar="KEY=VALUE", action="append", type=_storage_option, default=[],
        help="passed to fsspec (repeatable); VALUE is parsed as JSON when it can be, e.g. anon=true",
    )
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = commands.add_parser("ls", parents=[common], help="list the checkpoints under a root")
    ls.add_argument("root", metavar="ROOT")
    ls.set_defaults(run=cmd_ls)
    inspect = commands.add_parser("inspect", parents=[common], help="summarise one checkpoint's manifest")
    inspect.add_argument("path", metavar="PATH", help="a checkpoint directory, or a root (its latest)")
    inspect.set_defaults(run=cmd_inspect)
    verify = commands.add_parser("verify", parents=[common], help="read and checksum every byte of a checkpoint")
    verify.add_argument("path", metavar="PATH", help="a checkpoint directory, a root or ROOT/latest")
    verify.set_defaults(run=cmd_verify)
    return parser


def _print_json(document: Any) -> None:
    print(json.dumps(document, indent=1, sort_keys=True, default=str))


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _human_bytes(count: int | None) -> str:
    if count is None:
        return "-"
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{count} B"


def _human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"
