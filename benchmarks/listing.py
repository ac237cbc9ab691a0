"""Listing at scale: `shardckpt ls`, `shardckpt timeline`, resolving `latest` and one retention pass over many checkpoints.

    python benchmarks/listing.py                         2,000 checkpoints x 600-tensor manifests, format v2
    python benchmarks/listing.py --format v1             the same, without commit records (what v1 costs)
    python benchmarks/listing.py --checkpoints 500 --tensors 100 --root /tmp/listing

The checkpoints are synthetic (no training, no shard bytes): each directory holds a manifest shaped like
the writer's (one chunk per tensor, real-looking checksums) and, for v2, its commit record. Each
operation runs in a fresh process, so its peak RSS above the process's baseline (after imports) is
what the operation itself costs. Prints one JSON line per operation and a summary table.
Targets (docs/BENCHMARKS.md): each operation <= 1 s and <= 100 MiB extra RSS on local disk.
The manifests are the writer's exact bytes (manifest.to_bytes), so `timeline` reads them as it would a real root's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone

OPERATIONS = ("ls", "timeline", "resolve_latest", "retention")
RUN_ID = "listing-bench-run"


def synthetic_manifest(
    step: int, checkpoint_id: str, parent: str | None, seq: int, created_at: str, tensors: int, version: int = 2
) -> dict:
    """A manifest with `tensors` one-chunk tensors in one shard file, as the writer lays them out."""
    table, offset = [], 0
    for index in range(tensors):
        length = 4096 + index
        table.append(
            {
                "fqn": f"model.layers.{index // 6}.block.{index % 6}.weight",
                "shape": [64, 16],
                "dtype": "torch.float32",
                "chunks": [
                    {
                        "offsets": [0, 0],
                        "sizes": [64, 16],
                        "file": "__0_0.distcp",
                        "offset": offset,
                        "length": length,
                        "checksum": f"{(index * 2654435761) % 2**64:016x}",
                    }
                ],
            }
        )
        offset += length
    manifest = {
        "format_version": version,
        "id": checkpoint_id,
        "parent": parent,
        "step": step,
        "epoch": 0,
        "samples_consumed": step * 32,
        "created_at": created_at,
        "writer": {"lightning_shardckpt": "bench", "torch": "bench", "python": "3"},
        "checksum_algorithm": "xxh3_64",
        "topology": {"world_size": 1, "device_type": "cpu", "parallelism": "ddp", "mesh_shape": None},
        "files": [{"path": "__0_0.distcp", "bytes": offset, "checksum": f"{step:016x}"}],
        "tensors": table,
        "objects": [],
        "identity": {"config": None, "data": None, "model": None, "code": None, "run": None},
        "verification": {
            "mode": "sample",
            "chunks_total": tensors,
            "bytes_total": offset,
            "chunks_verified": 1,
            "bytes_verified": 4096,
        },
        "extra": {},
        "run_id": RUN_ID,
    }
    if version >= 2:
        manifest["seq"] = seq
    return manifest


def make_root(root: str, checkpoints: int, tensors: int, version: int = 2) -> list[str]:
    """Write `checkpoints` committed synthetic checkpoints of one run under `root`; return their names."""
    from lightning_shardckpt.engine.format import manifest as manifest_format
    from lightning_shardckpt.engine.format.names import COMMIT_RECORD, MANIFEST, checkpoint_dirname

    os.makedirs(root, exist_ok=True)
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    names, parent = [], None
    for index in range(checkpoints):
        step, checkpoint_id = (index + 1) * 10, f"{index + 1:012x}"
        created_at = (start + timedelta(seconds=index)).isoformat(timespec="milliseconds")
        manifest = synthetic_manifest(step, checkpoint_id, parent, index + 1, created_at, tensors, version)
        name = checkpoint_dirname(step, checkpoint_id)
        directory = os.path.join(root, name)
        os.makedirs(directory)
        # the writer's own bytes: `timeline` reads the fields outside the tensor table by the writer's layout
        data = _manifest_bytes(manifest, tensors, version)
        if version >= 2:
            with open(os.path.join(directory, COMMIT_RECORD), "wb") as handle:
                handle.write(manifest_format.to_bytes(manifest_format.build_commit_record(manifest, data)))
        with open(os.path.join(directory, MANIFEST), "wb") as handle:
            handle.write(data)
        names.append(name)
        parent = checkpoint_id
    return names


_TABLE_CACHE: dict[tuple[int, int], bytes] = {}


def _manifest_bytes(manifest: dict, tensors: int, version: int) -> bytes:
    """manifest.to_bytes(manifest), exactly, with the tensor table (the same in every synthetic manifest)
    encoded once: the writer's indented form is Python-encoded, ~10 ms per 600-tensor manifest."""
    from lightning_shardckpt.engine.format import manifest as manifest_format

    marker = "@@tensors@@"
    key = (tensors, version)
    if key not in _TABLE_CACHE:
        whole = manifest_format.to_bytes(manifest)
        _TABLE_CACHE[key] = _table_of(whole, manifest_format.to_bytes({**manifest, "tensors": marker}), marker)
    text = manifest_format.to_bytes({**manifest, "tensors": marker})
    return text.replace(json.dumps(marker).encode(), _TABLE_CACHE[key], 1)


def _table_of(whole: bytes, with_marker: bytes, marker: str) -> bytes:
    start = with_marker.index(json.dumps(marker).encode())
    tail = len(with_marker) - start - len(json.dumps(marker))
    return whole[start : len(whole) - tail]


def run_operation(operation: str, root: str) -> dict:
    """Run one operation in this process; report seconds and peak RSS above the post-import baseline."""
    from lightning_shardckpt.cli import main as cli
    from lightning_shardckpt.engine import catalog
    from lightning_shardckpt.engine.storage import fsio
    from lightning_shardckpt.policies import retention

    location = fsio.resolve(root)
    baseline_kib = _reset_peak_rss()
    started = time.perf_counter()
    if operation == "ls":
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(["ls", root])
        detail = {"exit": code}
    elif operation == "timeline":
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(["timeline", root])
        detail = {"exit": code}
    elif operation == "resolve_latest":
        entry = catalog.find(location, "latest")  # what a resume does: list, pick, read that one manifest
        detail = {"latest": entry.name}
    elif operation == "retention":
        count = sum(1 for e in catalog.list_checkpoints(location) if e.committed)
        baseline_kib = _reset_peak_rss()  # the count above is setup: one pass of apply is what is measured
        started = time.perf_counter()
        deleted = retention.apply(location, count - 1, None, run_id=RUN_ID)  # the oldest one goes
        detail = {"deleted": deleted}
    else:
        raise SystemExit(f"unknown operation {operation!r}; one of {OPERATIONS}")
    seconds = time.perf_counter() - started
    extra_mib = (_status_kib("VmHWM") - baseline_kib) / 1024
    return {"operation": operation, "seconds": round(seconds, 3), "extra_rss_mib": round(extra_mib, 1), **detail}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> int:
    """Reset the peak-RSS mark (Linux: clear_refs 5) and return the current RSS in KiB: the baseline.

    ru_maxrss alone would hide an operation under the import's own earlier peak.
    """
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return _status_kib("VmRSS")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", type=int, default=2000)
    parser.add_argument("--tensors", type=int, default=600)
    parser.add_argument("--format", choices=("v1", "v2"), default="v2")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per operation (min/median/max)")
    parser.add_argument("--root", help="where to build the synthetic root (default: a temp dir, removed after)")
    parser.add_argument("--child", metavar="OPERATION", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_operation(args.child, args.root)))
        return 0
    workdir = args.root or tempfile.mkdtemp(prefix="listing-bench-")
    root = os.path.join(workdir, "root")
    try:
        started = time.perf_counter()
        make_root(root, args.checkpoints, args.tensors, version=int(args.format[1]))
        print(
            f"built {args.checkpoints} checkpoints x {args.tensors} tensors ({args.format}) in "
            f"{time.perf_counter() - started:.1f}s at {root}",
            file=sys.stderr,
        )
        results: dict[str, list[dict]] = {operation: [] for operation in OPERATIONS}
        for repeat in range(args.repeats):
            for operation in OPERATIONS:  # rotated order would not matter: each is its own process
                out = subprocess.run(
                    [sys.executable, __file__, "--child", operation, "--root", root],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                result = json.loads(out.stdout.strip().splitlines()[-1])
                print(json.dumps({"repeat": repeat, **result}))
                results[operation].append(result)
        print(
            f"\n{args.checkpoints} checkpoints x {args.tensors}-tensor manifests, format {args.format}, local disk; "
            f"{args.repeats} fresh processes each: min / median / max"
        )
        print(f"{'operation':<16}{'seconds':<26}{'extra RSS (MiB)'}")
        for operation, rows in results.items():
            print(
                f"{operation:<16}{_spread([r['seconds'] for r in rows], '.3f'):<26}"
                f"{_spread([r['extra_rss_mib'] for r in rows], '.1f')}"
            )
    finally:
        if not args.root:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _spread(values: list[float], fmt: str) -> str:
    ordered = sorted(values)
    return " / ".join(format(v, fmt) for v in (ordered[0], ordered[len(ordered) // 2], ordered[-1]))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
