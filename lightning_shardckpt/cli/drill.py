"""`shardckpt drill` and `shardckpt last-good`: prove a checkpoint restores; find the newest one that did."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..engine.format import drill_records
from ..engine.format.names import parse_dirname
from ..engine.storage import fsio
from ..errors import CheckpointNotFound, ConfigError
from ..ops.roots import list_checkpoints
from . import exit_codes, options
from .options import add_public_key
from .output import print_table

# the drill phases, in the order they run (policies/drills/worker.py times them), as the table shows them
PHASES = (
    ("process_start_s", "start ranks (fork, or hand to the kept ones)"),
    ("init_s", "process group"),
    ("listing_s", "list the root"),
    ("target_s", "destination tensors (NaN-filled)"),
    ("metadata_s", "read the metadata"),
    ("read_s", "read and check the bytes"),
    ("reshard_s", "reshard onto the drill ranks"),
    ("checks_s", "checks (probe, finiteness)"),
    ("time_to_resume_s", "time to resume (spawn to loaded)"),
)


def add_commands(commands: Any) -> None:
    drill = commands.add_parser(
        "drill",
        parents=[options.common()],
        help="restore a checkpoint in fresh processes (another world size by default) and record the result; exit 1 if it fails",
        description="Restore a checkpoint in fresh processes, on another world size by default, and record the "
        "verdict in ROOT/drills/ (the root must be writable).",
    )
    drill.add_argument("path", metavar="ROOT|CKPT", help="a root (drills its latest) or a checkpoint directory")
    drill.add_argument(
        "--world-size",
        type=options.number("--world-size", integer=True, at_least=1),
        default=None,
        help="drill ranks (default: 1, or 2 when the writer had 1)",
    )
    drill.add_argument(
        "--probe",
        default=None,
        metavar="MODULE:FUNCTION",
        help="a function of the model's state dict returning a float, compared with the value saved in the checkpoint",
    )
    drill.add_argument(
        "--tolerance",
        type=options.number("--tolerance", at_least=0),
        default=1e-4,
        help="relative tolerance of the probe comparison (default: %(default)s)",
    )
    drill.add_argument(
        "--timeout",
        type=options.number("--timeout", above=0),
        default=600.0,
        help="seconds before the drill is killed and recorded as failed (default: %(default)s)",
    )
    drill.add_argument(
        "--threads",
        type=options.number("--threads", integer=True, at_least=1),
        default=1,
        help="torch threads per drill rank (default: %(default)s)",
    )
    drill.add_argument(
        "--keep-memory-gib",
        type=options.number("--keep-memory-gib", at_least=0),
        default=2.0,
        help="GiB of destination memory the drill ranks keep between drills, all ranks together (--follow: the "
        "next drill that fits reuses the last one's processes and tensors); 0: fork fresh ranks for every drill "
        "(default: %(default)s)",
    )
    drill.add_argument(
        "--trust",
        action="store_true",
        help="unpickle any class the checkpoint names, as a run with trust_checkpoint=True resumes it (trusted "
        "checkpoints only: unpickling can run code)",
    )
    drill.add_argument(
        "--allow-global",
        dest="safe_globals",
        action="append",
        type=_safe_global,
        default=[],
        metavar="MODULE.CLASS",
        help="also allow this class, as torch.serialization.add_safe_globals does in the run (repeatable; "
        "importable from here)",
    )
    follow = drill.add_argument_group(
        "follow", "a long-running drill service: drill each new checkpoint of ROOT (training runs drill.mode=external)"
    )
    follow.add_argument(
        "--follow", action="store_true", help="keep watching ROOT and drill its newly committed checkpoints"
    )
    follow.add_argument(
        "--every-n-checkpoints",
        type=options.number("--every-n-checkpoints", integer=True, at_least=1),
        default=1,
        help="with --follow: drill the newest checkpoint once N have committed since the last drilled one "
        "(default: %(default)s)",
    )
    follow.add_argument(
        "--interval",
        type=options.number("--interval", above=0),
        default=30.0,
        help="with --follow: seconds between looks at ROOT (default: %(default)s)",
    )
    follow.add_argument(
        "--once", action="store_true", help="with --follow: drill what is due now, then exit (for cron jobs)"
    )
    follow.add_argument(
        "--exit-when-idle",
        type=options.number("--exit-when-idle", above=0),
        default=None,
        metavar="SECONDS",
        help="with --follow: exit once nothing was committed or drilled for this long",
    )
    add_public_key(drill, "drilling")
    drill.set_defaults(run=cmd_drill)
    last_good = commands.add_parser(
        "last-good", parents=[options.common()], help="print the newest drilled (known-good) checkpoint of a root"
    )
    last_good.add_argument("root", metavar="ROOT")
    last_good.set_defaults(run=cmd_last_good)


def cmd_drill(args: argparse.Namespace) -> int:
    from ..policies.drills.runner import DrillOptions, run_drill  # here: torch, which --help must not wait for

    if not args.follow and (args.once or args.exit_when_idle is not None):
        raise ConfigError("--once and --exit-when-idle stop a follower; add --follow, or drop them")
    if args.public_key and not args.follow:  # the one named checkpoint: refused in one line, before any drill
        from ..engine.format.signing import accepted_policy
        from ..engine.root import open_reference

        location, entry = open_reference("latest", args.path, args.storage_options)
        accepted_policy(args.public_key, args.revoked_key).check_manifest(
            location.fs, entry.path, entry.committed_manifest
        )
    # a drill that passes makes a checkpoint known-good: with keys, only one an accepted key signed. The drill checks
    # the manifest's signature before it forks (a refused one, found by a follower, is recorded as a failed drill)
    # and its ranks every file they read against the signed digests, as a resume with the policy does
    options = DrillOptions(
        world_size=args.world_size,
        timeout_s=args.timeout,
        threads=args.threads,
        keep_memory_gib=args.keep_memory_gib,
        probe=args.probe,
        tolerance=args.tolerance,
        trust_checkpoint=args.trust,
        safe_globals=tuple(args.safe_globals),
        storage_options=args.storage_options,
        public_keys=tuple(args.public_key),
        revoked_keys=tuple(args.revoked_key),
    )
    if args.follow:
        return _follow(args, options)
    record = run_drill(args.path, options)
    _print_record(record, args.json)
    return exit_codes.OK if record["verdict"] == drill_records.PASSED else exit_codes.FOUND_PROBLEM


def _follow(args: argparse.Namespace, options: Any) -> int:
    """Drill ROOT's new checkpoints until stopped; SIGTERM (a Kubernetes stop) ends it like Ctrl-C."""
    import signal
    import threading

    from ..policies.drills.follower import DrillFollower

    if parse_dirname(fsio.resolve(args.path, args.storage_options).path) is not None:
        raise ConfigError(f"--follow watches a root; {args.path} is a checkpoint: pass its parent directory")
    follower = DrillFollower(
        args.path,
        options,
        every_n_checkpoints=args.every_n_checkpoints,
        interval_s=args.interval,
        on_record=lambda record: _print_record(record, args.json, compact=True),
    )
    # SIGTERM (a Kubernetes stop) ends the loop like Ctrl-C; the handler found is put back on the way out, so a
    # program that calls `main(["drill", ..., "--follow"])` in its own process keeps its SIGTERM behaviour after
    on_main_thread = threading.current_thread() is threading.main_thread()  # elsewhere Python sets no handler
    previous_sigterm = signal.signal(signal.SIGTERM, _stop_following) if on_main_thread else None
    try:
        warm_s = follower.warm_up()
        print(
            f"following {follower.location.url}: drill workers warm in {warm_s:.1f} s; a drill every "
            f"{args.every_n_checkpoints} checkpoint(s), a look every {args.interval:g} s",
            file=sys.stderr,
            flush=True,
        )
        follower.run(once=args.once, exit_when_idle_s=args.exit_when_idle)
    except KeyboardInterrupt:
        pass  # the lease is released and the warm workers stopped on the way out
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous_sigterm if previous_sigterm is not None else signal.SIG_DFL)
    if follower.malformed_leases:
        print(f"ignored {follower.malformed_leases} malformed drill lease file(s), named above", file=sys.stderr)
    return exit_codes.OK


def _stop_following(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through the follower's finally blocks: lease released, workers stopped


def _print_record(record: dict[str, Any], as_json: bool, *, compact: bool = False) -> None:
    if as_json:
        print(json.dumps(record, indent=None if compact else 1, sort_keys=True, default=str), flush=True)
        return
    print(
        f"{record['checkpoint']}: {record['verdict']} on {record['world_size']} rank(s) "
        f"(written on {record['writer_world_size']})" + (f": {record['cause']}" if record.get("cause") else ""),
        flush=True,
    )
    if compact:
        return
    _print_timings(record)
    probe = (record.get("checks") or {}).get("probe")
    if probe and "value" in probe:
        print(f"probe {probe['name']}: {probe['value']!r} restored, {probe['saved']!r} at save")


def cmd_last_good(args: argparse.Namespace) -> int:
    listing = list_checkpoints(args.root, storage_options=args.storage_options)
    good = listing.last_good
    if good is None:
        drilled_any = any(info.trust not in (None, drill_records.COMMITTED) for info in listing.checkpoints)
        raise CheckpointNotFound(
            f"no drilled checkpoint in {listing.root}"
            + (
                "; every drill so far failed, see `shardckpt ls`"
                if drilled_any
                else f"; drill one: shardckpt drill {listing.root}"
            )
        )
    if args.json:
        print(
            json.dumps(
                {
                    "root": listing.root,
                    "last_good": good.name,
                    "path": good.path,
                    "step": good.step,
                    "checkpoint_id": good.checkpoint_id,
                },
                indent=1,
            )
        )
    else:
        print(good.path)
    return exit_codes.OK


def _safe_global(name: str) -> str:
    from ..policies.drills import trust as drill_trust  # here: torch, which --help must not wait for

    try:
        return drill_trust.spec_of(name)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _print_timings(record: dict[str, Any]) -> None:
    """Where the drill's time went, one phase a row (rank 0's clock); --json has the raw record."""
    timings = record.get("timings") or {}
    rows = [(label, f"{timings[key]:.2f} s") for key, label in PHASES if timings.get(key) is not None]
    if not rows:
        return
    print_table([("PHASE", "TIME"), *rows])
    if record.get("bytes_read"):
        print(f"read {record['bytes_read'] / 1e6:.1f} MB at {record.get('read_gbps') or 0:.2f} GB/s")
