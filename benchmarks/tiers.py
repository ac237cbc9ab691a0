"""Single-tier S3 against local+S3 tiers: the pause, the time to the fast commit and the time until durable, in one run.

Run from the repository root:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/tiers.py                     # 0.5 GiB per rank, 2 ranks, 3 repeats
    PYTHONPATH=$PWD .venv/bin/python benchmarks/tiers.py --size-gib 1 --repeats 1

2 gloo CPU ranks each hold --size-gib GiB of float32 tensors of their own (each rank writes its own
shard file). The durable tier is moto's S3 server on loopback (tests/helpers/s3_server.py), in this
process's memory; the local tier is a directory under --workdir. Per repeat, three saves, each from a
barrier, each rank timing its own (the slowest rank counts); the order of the three turns every repeat:

  local      CheckpointSaver(local).save(): pause (save() returns), commit (result() returns)
  s3         CheckpointSaver(s3://...).save(): pause, commit = durable
  tiers      CheckpointSaver(local) + Replicator(local -> s3): pause, fast commit (result()),
             durable (the replicator's flush returns: the S3 copy is committed)

Every saver's staging memory is allocated and touched before its timed save (saver.prepare), as in a
training run's steady state. Targets: tiers pause ~ local pause; tiers fast commit <= 1.2x local
commit; the durable copy adds no training-thread time (tiers pause ~ local pause: the copy runs on the
replicator's thread, after the fast commit).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.helpers.spawn import run_ranks  # noqa: E402

TENSORS = 8


def make_state(rank: int, size_gib: float) -> dict[str, torch.Tensor]:
    elements = int(size_gib * 2**30 / 4 / TENSORS)
    return {f"rank{rank}.t{i}": torch.full((elements,), float(rank * 100 + i)) for i in range(TENSORS)}


def _prepared(saver, state) -> None:
    saver.prepare(state)
    while saver._free_slots.empty():  # the allocation runs on the saver's thread: wait until its slot is back
        time.sleep(0.01)


def bench_rank(rank: int, world_size: int, size_gib: float, workdir: str, s3_url: str, options: dict, tag: str) -> dict:
    from lightning_shardckpt import CheckpointSaver, SaveConfig
    from lightning_shardckpt.engine.collectives import new_checkpoint_group
    from lightning_shardckpt.engine.storage import fsio
    from lightning_shardckpt.engine.tiers.config import TierConfig, TiersConfig
    from lightning_shardckpt.engine.tiers.replicate import Replicator

    torch.set_num_threads(1)
    state = make_state(rank, size_gib)
    config = SaveConfig(write_events=False, allow_shared_root=True)
    out: dict[str, float] = {}

    def timed(saver, name: str, replicator=None) -> None:
        _prepared(saver, state)
        dist.barrier()
        started = time.perf_counter()
        pending = saver.save(state, step=1)
        out[f"{name}_pause"] = time.perf_counter() - started
        result = pending.result()
        assert result.committed, result.error
        out[f"{name}_commit"] = time.perf_counter() - started
        if replicator is not None:
            assert replicator.flush(3600)
            out[f"{name}_durable"] = time.perf_counter() - started
        dist.barrier()

    def run_local() -> None:
        local = CheckpointSaver(f"{workdir}/local-{tag}", config)
        timed(local, "local")
        local.close()

    def run_s3() -> None:
        s3 = CheckpointSaver(
            f"{s3_url}/single-{tag}", SaveConfig(write_events=False, allow_shared_root=True, storage_options=options)
        )
        timed(s3, "s3")
        s3.close()

    def run_tiers() -> None:
        fast_url, durable_url = f"{workdir}/fast-{tag}", f"{s3_url}/durable-{tag}"
        tiers = TiersConfig(
            fast=TierConfig(dirpath=fast_url), durable=TierConfig(dirpath=durable_url, storage_options=options)
        )
        fast = CheckpointSaver(fast_url, config)
        replicator = Replicator(
            tiers, fsio.resolve(fast_url), fsio.resolve(durable_url, options), group=new_checkpoint_group(600)
        )
        fast.add_listener(lambda r: replicator.submit(r.path.rsplit("/", 1)[-1]) if r.outcome == "committed" else None)
        timed(fast, "tiers", replicator)
        replicator.close(60)
        fast.close()

    # the order turns every repeat: no method always follows the S3 upload (moto frees its memory afterwards)
    methods = [run_local, run_tiers, run_s3]
    shift = int(tag[1:]) % len(methods)
    for method in methods[shift:] + methods[:shift]:
        method()
        time.sleep(2)  # let the S3 server settle between methods
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    from tests.helpers.s3_server import S3Server

    server = S3Server()
    server.create_bucket("bench")
    workdir = args.workdir or tempfile.mkdtemp(prefix="shardckpt-tiers-")
    rows: list[dict[str, float]] = []
    try:
        for repeat in range(args.repeats):
            outcomes = run_ranks(
                bench_rank,
                2,
                args.size_gib,
                workdir,
                "s3://bench/run",
                server.storage_options(),
                f"r{repeat}",
                timeout_s=3600,
                pg_timeout_s=900,
            )
            row = {key: max(o.value[key] for o in outcomes) for key in outcomes[0].value}
            rows.append(row)
            print(f"repeat {repeat + 1}: " + "  ".join(f"{k}={v:.2f}s" for k, v in row.items()), flush=True)
            shutil.rmtree(workdir, ignore_errors=True)
            os.makedirs(workdir, exist_ok=True)
            server.fs.rm("bench/run", recursive=True)  # moto keeps objects in this process's memory
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\n{args.size_gib} GiB per rank, 2 ranks, {len(rows)} repeats (slowest rank per repeat): min / median / max seconds"
    )
    for key in rows[0]:
        values = sorted(row[key] for row in rows)
        print(f"  {key:<16} {values[0]:7.2f} {statistics.median(values):7.2f} {values[-1]:7.2f}")
    medians = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    print(
        f"targets (medians): tiers pause / local pause = {medians['tiers_pause'] / medians['local_pause']:.2f} (~1); "
        f"tiers fast commit / local commit = {medians['tiers_commit'] / medians['local_commit']:.2f} (<= 1.2); "
        f"time until durable: s3 {medians['s3_commit']:.1f}s, tiers {medians['tiers_durable']:.1f}s"
    )


if __name__ == "__main__":
    main()
