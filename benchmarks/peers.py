"""Peer copies of the fast tier: resume after a node loss from peers vs from S3, the training slowdown, the space.

Run from the repository root:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/peers.py                    # 64 MiB per rank, 3 repeats
    PYTHONPATH=$PWD .venv/bin/python benchmarks/peers.py --size-mib 256 --repeats 1

Per repeat:

  train    4 gloo CPU ranks as 2 simulated nodes × 2 (each node its own fast root, `base/node{node_rank}`),
           S3 (moto on loopback, behind a request-counting proxy) as the durable tier, a training loop of
           --steps steps (matmuls) with an async save every 4 steps: once without peer copies, once with
           (factor 2, jump 2); the loop's wall time per step and the median pause of a save (the training
           thread's wait in `save()`; slowest rank), and the bytes each node root holds
  peers    node 0's root deleted, then 1 node × 3 ranks resume `latest` (tier choice, peer assembly, DCP load
           resharded 4 -> 3): seconds from the first collective to the loaded state, object GETs on S3
  durable  both roots deleted (a clique lost), the same resume from S3: seconds, object GETs on S3

Each rank's tensors are its own (--size-mib MiB per rank), so every rank writes (and every peer copies) a shard.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from tests.helpers.spawn import run_ranks  # noqa: E402

TENSORS = 4
OBJECT_GET = r"/step-\d+-[0-9a-f]+/"


def make_state(rank: int, size_mib: float, world: int = 4) -> dict[str, torch.Tensor]:
    elements = int(size_mib * 2**20 / 4 / TENSORS)
    return {f"r{r}.t{i}": torch.full((elements,), float(r * 100 + i)) for r in range(world) for i in range(TENSORS)}


def _tiers(base: str, durable: str, options: dict, per_node: int, peers: bool):
    from lightning_shardckpt.engine.tiers.config import PeersConfig, TierConfig, TiersConfig

    return TiersConfig(
        fast=TierConfig(
            dirpath=f"{base}/node{{node_rank}}", peers=PeersConfig(factor=2, jump=per_node) if peers else None
        ),
        durable=TierConfig(dirpath=durable, storage_options=options, every_n_checkpoints=1000),
        collective_timeout_s=600,
    )


def train_rank(rank: int, world: int, base: str, durable: str, options: dict, size_mib: float, steps: int) -> dict:
    import torch.distributed as dist

    from lightning_shardckpt import CheckpointSaver, SaveConfig
    from lightning_shardckpt.policies.tiers.checkpoint_tiers import CheckpointTiers

    torch.set_num_threads(1)
    mine = {k: v for k, v in make_state(rank, size_mib).items() if k.startswith(f"r{rank}.")}
    out = {}
    for mode in ("off", "peers"):
        root = f"{base}/{mode}"
        tiers = CheckpointTiers(_tiers(root, f"{durable}/{mode}", options, 2, mode == "peers"), rank // 2, rank % 2)
        saver = CheckpointSaver(tiers.fast_dirpath, SaveConfig(write_events=False, node_local=True))
        tiers.start(saver, saver.run_id, allow_shared_root=False, is_global_zero=rank == 0)
        a = torch.randn(384, 384)
        pauses: list[float] = []
        dist.barrier()
        started = time.perf_counter()
        for step in range(1, steps + 1):
            for _ in range(6):
                a = torch.tanh(a @ a)
            if step % 4 == 0:
                asked = time.perf_counter()
                saver.save(mine, step=step)
                pauses.append(time.perf_counter() - asked)  # what the training thread waits for
        saver.wait()
        out[f"{mode}_loop_s"] = time.perf_counter() - started
        out[f"{mode}_pause_s"] = statistics.median(pauses)
        tiers.close(600)
        saver.close()
        dist.barrier()
    return out


def resume_rank(rank: int, world: int, base: str, durable: str, options: dict, size_mib: float) -> dict:
    from lightning_shardckpt.engine.collectives import new_checkpoint_group
    from lightning_shardckpt.engine.config import LoadConfig
    from lightning_shardckpt.engine.load.loader import load_checkpoint
    from lightning_shardckpt.policies.tiers.checkpoint_tiers import CheckpointTiers

    torch.set_num_threads(1)
    tiers = CheckpointTiers(_tiers(f"{base}/peers", f"{durable}/peers", options, 3, True), 0, rank)
    group = new_checkpoint_group(600)
    target = {k: torch.zeros_like(v) for k, v in make_state(rank, size_mib).items()}
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    path, config, _ = tiers.pick("latest", LoadConfig(storage_options=options), group)
    load_checkpoint(target, path, config=config, process_group=group)
    seconds = time.perf_counter() - started
    expected = make_state(rank, size_mib)
    assert all(torch.equal(target[k], expected[k]) for k in target), "not bit-exact"
    return {"seconds": seconds, "path": path}


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=float, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from tests.helpers.s3_server import FaultProxy, S3Server

    server = S3Server()
    server.create_bucket("bench")
    proxy = FaultProxy(server.host, server.port)
    options = server.storage_options(proxy.endpoint)
    rows = []
    try:
        for repeat in range(args.repeats):
            base = Path(tempfile.mkdtemp(prefix="shardckpt-peers-"))
            durable = f"s3://bench/run{repeat}"
            trained = run_ranks(
                train_rank, 4, str(base), durable, options, args.size_mib, args.steps, timeout_s=3600, pg_timeout_s=900
            )
            row = {key: max(o.value[key] for o in trained) for key in trained[0].value}  # the slowest rank
            row.update({key: row[key] / args.steps for key in row if key.endswith("_loop_s")})  # per step
            row["space_off_mib"] = _bytes(base / "off") / 2**20
            row["space_peers_mib"] = _bytes(base / "peers") / 2**20
            shutil.rmtree(base / "peers" / "node0")  # node 0 lost with its disk: resume on 1 node × 3 ranks
            proxy.clear()
            resumed = run_ranks(resume_rank, 3, str(base), durable, options, args.size_mib, timeout_s=3600)
            row["peers_resume_s"] = max(o.value["seconds"] for o in resumed)
            row["peers_object_gets"] = len(proxy.requests("GET", OBJECT_GET))
            shutil.rmtree(base / "peers")  # both nodes of the clique lost: only S3 holds it
            proxy.clear()
            resumed = run_ranks(resume_rank, 3, str(base), durable, options, args.size_mib, timeout_s=3600)
            assert resumed[0].value["path"].startswith("s3://"), resumed[0].value["path"]
            row["durable_resume_s"] = max(o.value["seconds"] for o in resumed)
            row["durable_object_gets"] = len(proxy.requests("GET", OBJECT_GET))
            rows.append(row)
            print(f"repeat {repeat + 1}: " + "  ".join(f"{k}={v:.3f}" for k, v in row.items()), flush=True)
            shutil.rmtree(base, ignore_errors=True)
            server.fs.rm(f"bench/run{repeat}", recursive=True)
    finally:
        proxy.stop()
        server.stop()
    print(f"\n{args.size_mib} MiB per rank, 4 ranks (2 nodes × 2) -> 3 ranks, {len(rows)} repeats: min / median / max")
    for key in rows[0]:
        values = sorted(row[key] for row in rows)
        print(f"  {key:<20} {values[0]:9.3f} {statistics.median(values):9.3f} {values[-1]:9.3f}")


if __name__ == "__main__":
    main()
