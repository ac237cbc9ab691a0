"""Follow a training run's checkpoints from another job, through the public API only: what an evaluation job
beside training does. It lists the root (what `shardckpt ls` shows), picks `latest`, `last-good` and any
reference you give, reads latest's manifest summary, then waits for each new commit and prints it where an
evaluation job would load it (`load_checkpoint(state, checkpoint.path)`).

    python recipes/follow_checkpoints.py checkpoints/tinylm --timeout 600
    python recipes/follow_checkpoints.py s3://bucket/run-7 --pick 500 --storage-option endpoint_url=http://127.0.0.1:5077

Exit status: 0 once --timeout seconds pass without a new commit (or after --count commits), 2 when the root
cannot be read (one line naming why). Imports no torch: it starts in well under a second.
"""

from __future__ import annotations

import argparse
import json
import sys

from lightning_shardckpt import (
    CheckpointInfo,
    CheckpointNotFound,
    ShardCkptError,
    follow_checkpoints,
    list_checkpoints,
    read_manifest_summary,
    resolve_checkpoint,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="the checkpoint root training writes (a local path or an fsspec URL)")
    parser.add_argument("--pick", action="append", default=[], metavar="REF", help="also resolve this reference")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds without a new commit before exiting")
    parser.add_argument("--poll", type=float, default=5.0, help="seconds between looks at the root")
    parser.add_argument("--count", type=int, default=None, help="exit after this many new commits")
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec option (repeatable); VALUE is parsed as JSON when it can be",
    )
    return parser.parse_args(argv)


def storage_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def describe(checkpoint: CheckpointInfo) -> str:
    size = "-" if checkpoint.bytes is None else f"{checkpoint.bytes} B"
    return f"step {checkpoint.step:>6}  {checkpoint.state:<11}  {checkpoint.trust or '-':<12}  {size:>10}  {checkpoint.name}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = storage_options(args.storage_option)
    try:
        listing = list_checkpoints(args.root, storage_options=options)
        print(f"root {listing.root}: {len(listing.checkpoints)} checkpoint(s), committed steps {listing.all_steps()}")
        for checkpoint in listing.checkpoints:
            print("  " + describe(checkpoint))
        print(f"latest: {listing.latest.path if listing.latest else 'none (nothing committed yet)'}")
        print(f"last-good: {listing.last_good.path if listing.last_good else 'none (no drill has passed)'}")
        for reference in args.pick:
            try:
                print(f"pick {reference}: {resolve_checkpoint(args.root, reference, storage_options=options).path}")
            except CheckpointNotFound as err:
                print(f"pick {reference}: {err}")
        if listing.latest is not None:
            summary = read_manifest_summary(listing.latest.path, storage_options=options)
            recorded = sorted(block for block, value in summary.identity.items() if value)
            print(
                f"inspect {summary.path}: step {summary.step}, saved on {summary.topology.get('world_size')} rank(s), "
                f"{summary.tensor_count} tensors in {summary.bytes} bytes, identity recorded: {recorded or 'none'}"
            )
        print(f"waiting for new commits (exits after {args.timeout:g} s without one)", flush=True)
        seen = 0
        for checkpoint in follow_checkpoints(
            args.root, timeout_s=args.timeout, poll_s=args.poll, storage_options=options
        ):
            # an evaluation job would load and evaluate it here: load_checkpoint(state, checkpoint.path)
            print(f"new commit: {checkpoint.path} (step {checkpoint.step}, {checkpoint.trust})", flush=True)
            seen += 1
            if args.count is not None and seen >= args.count:
                break
        print(f"done: {seen} new commit(s)")
        return 0
    except ShardCkptError as err:
        print(f"follow_checkpoints: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
