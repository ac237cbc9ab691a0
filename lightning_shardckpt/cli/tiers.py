"""`shardckpt ls FAST --durable URL`: the fast and the durable tier side by side, one row per checkpoint."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..engine.format import drill_records, signing
from ..engine.format.names import checkpoint_dirname_parts
from ..engine.root import open_root
from ..engine.tiers.restore import choose_signed
from ..ops.roots import CheckpointInfo, list_checkpoints
from . import exit_codes, options
from .output import print_table


def add_arguments(ls: argparse.ArgumentParser) -> None:
    ls.add_argument(
        "--durable",
        metavar="URL",
        default=None,
        help="also list this durable tier (tiers): one row per checkpoint, which tier holds it, which one latest resumes",
    )
    ls.add_argument(
        "--durable-storage-option",
        dest="durable_storage_option",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="fsspec option of the durable tier (repeatable), like --storage-option",
    )


def cmd_ls_nodes(args: argparse.Namespace) -> int:
    """`shardckpt ls '/nvme/ckpt/node{node_rank}'`: per checkpoint, on which nodes' fast roots it is complete."""
    from ..engine.tiers.peers import complete_on, node_roots  # here: torch, which --help must not wait for
    from ..engine.tiers.root_identity import distinct

    roots = distinct(node_roots(args.root, args.storage_options))  # a symlinked root is no second copy
    if not roots:
        print(f"no node roots match {args.root}; give the fast tier's dirpath with {{node_rank}} in it")
        return exit_codes.CANNOT_RUN
    held = complete_on(roots)
    rows: list[dict[str, Any]] = [
        {"step": checkpoint_dirname_parts(name).step, "name": name, "complete_on": nodes}
        for name, nodes in sorted(held.items(), key=lambda item: checkpoint_dirname_parts(item[0]).step)
    ]
    if args.json:
        print(json.dumps({"nodes": {n: r.url for n, r in roots.items()}, "checkpoints": rows}, indent=1))
        return exit_codes.OK
    table = [("STEP", "COMPLETE ON NODES", "NAME")]
    table += [(str(r["step"]), ",".join(map(str, r["complete_on"])) or "none", r["name"]) for r in rows]
    print_table(table)
    print(f"nodes: {', '.join(f'{n}={r.url}' for n, r in roots.items())}; complete: the manifest and every file")
    return exit_codes.OK


def cmd_ls_tiers(args: argparse.Namespace) -> int:
    durable_options = dict(options.storage_option(o) for o in args.durable_storage_option)
    fast, durable = open_root(args.root, args.storage_options), open_root(args.durable, durable_options)
    keys = list(getattr(args, "public_key", None) or [])  # --public-key: each copy's signature, latest as signed
    revoked = list(getattr(args, "revoked_key", None) or [])
    entries = {
        tier: list_checkpoints(root, storage_options=opts, public_keys=keys, revoked_keys=revoked).checkpoints
        for tier, root, opts in (
            ("fast", args.root, args.storage_options),
            ("durable", args.durable, durable_options),
        )
    }
    signatures = {tier: {e.name: _signature_cell(e) for e in listing} for tier, listing in entries.items()}
    drilled = {e.name for listing in entries.values() for e in listing if e.trust == drill_records.DRILLED}
    names = sorted(
        {e.name for listing in entries.values() for e in listing},
        key=lambda n: next(e.step for listing in entries.values() for e in listing if e.name == n),
    )
    state = {tier: {e.name: e.state for e in listing} for tier, listing in entries.items()}
    policy = signing.accepted_policy(keys, revoked) if keys else None
    # what this machine would resume (every rank: the same check, agreed); with keys, as require_signature would
    choices = choose_signed(fast, durable, "latest", None, policy).choices
    latest = (choices[0].tier, choices[0].name) if choices else None
    rows = []
    for name in names:
        entry = next(e for listing in entries.values() for e in listing if e.name == name)
        rows.append(
            {
                "step": entry.step,
                "id": entry.checkpoint_id,
                "name": name,
                "fast": state["fast"].get(name),
                "durable": state["durable"].get(name),
                "drilled": name in drilled,
                "latest": latest[0] if latest and latest[1] == name else None,
                # with --public-key: signed:KEY-ID | unsigned | refused per copy (None: no keys, or no copy there)
                "fast_signature": signatures["fast"].get(name) if keys else None,
                "durable_signature": signatures["durable"].get(name) if keys else None,
            }
        )
    if args.json:
        print(
            json.dumps(
                {
                    "fast": fast.url,
                    "durable": durable.url,
                    "checkpoints": rows,
                    "latest": {"tier": latest[0], "name": latest[1], "why": choices[0].reason} if latest else None,
                },
                indent=1,
                sort_keys=True,
            )
        )
        return exit_codes.OK
    table = [("STEP", "ID", "FAST", "DURABLE", *(("FAST-SIG", "DURABLE-SIG") if keys else ()), "DRILLED")]
    table[0] += ("LATEST", "NAME")
    for row in rows:
        table.append(
            (
                str(row["step"]),
                row["id"],
                row["fast"] or "-",
                row["durable"] or "-",
                *((row["fast_signature"] or "-", row["durable_signature"] or "-") if keys else ()),
                "yes" if row["drilled"] else "-",
                row["latest"] or "",
                row["name"],
            )
        )
    print_table(table)
    print(f"fast: {fast.url}   durable: {durable.url}")
    if latest:
        print(
            f"LATEST: ckpt_path='latest' on this machine resumes the {latest[0]} copy of {latest[1]} ({choices[0].reason})"
        )
    return exit_codes.OK


def _signature_cell(info: CheckpointInfo) -> str | None:
    """`signed:KEY-ID` (16 hex digits), `unsigned` or `refused`; None without keys or unless committed."""
    if info.signature == signing.SIGNED:
        return f"signed:{(info.signed_by or '')[:16]}"
    return info.signature
