"""Rank functions for the peer-copy tests: simulated nodes (node rank = rank // ranks per node), each with its own
node-local fast root (`base/node{node_rank}`), peer copies on, S3 as the durable tier (no Lightning)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine.collectives import new_checkpoint_group
from lightning_shardckpt.engine.config import LoadConfig
from lightning_shardckpt.engine.load.loader import load_checkpoint
from lightning_shardckpt.engine.tiers.config import PeersConfig, TierConfig, TiersConfig
from lightning_shardckpt.policies import retention
from lightning_shardckpt.policies.tiers.checkpoint_tiers import CheckpointTiers

KEYS = tuple("abcdefgh")  # written spread over the ranks (declared identical): every rank writes a shard


def state(step: int) -> dict[str, Any]:
    return {key: torch.arange(2048, dtype=torch.float32) * (step + 1) + index for index, key in enumerate(KEYS)}


def config(base: str, durable: str, options: dict, per_node: int, scan: bool = True) -> TiersConfig:
    return TiersConfig(
        fast=TierConfig(
            dirpath=f"{base}/node{{node_rank}}",
            peers=PeersConfig(factor=2, jump=per_node, scan_local_roots=scan),
        ),
        durable=TierConfig(dirpath=durable, storage_options=options, every_n_checkpoints=100),
        retry_backoff_s=0.2,
        retry_backoff_max_s=1.0,
        collective_timeout_s=30.0,
    )


def one_rank_per_node(base: str) -> TiersConfig:
    """Each rank a node of its own under `base` (node{r}), peers one node on, every commit copied to `base`/durable."""
    return TiersConfig(
        fast=TierConfig(dirpath=f"{base}/node{{node_rank}}", peers=PeersConfig(factor=2, jump=1)),
        durable=TierConfig(dirpath=f"{base}/durable", every_n_checkpoints=1),
        retry_backoff_s=0.2,
        retry_backoff_max_s=1.0,
        collective_timeout_s=30.0,
    )


def save_with_peers(rank: int, world_size: int, base: str, durable: str, options: dict, per_node: int) -> dict:
    """Save steps 1, 2, 3 on the fast tier with peer copies (and a durable copy at close); node 0 keeps the last 2
    (the retention plug-in's rule, run after each commit as it does)."""
    tiers = CheckpointTiers(config(base, durable, options, per_node), rank // per_node, rank % per_node)
    saver = CheckpointSaver(
        tiers.fast_dirpath, SaveConfig(write_events=False, collective_timeout_s=30.0, node_local=True)
    )
    if rank == 0:
        saver.add_listener(
            lambda record: (
                retention.apply(tiers.fast, 2, None, run_id=saver.run_id, just_committed=record.path.rsplit("/", 1)[-1])
                if record.outcome == "committed"
                else None
            )
        )
    tiers.start(saver, saver.run_id, allow_shared_root=False, is_global_zero=rank == 0)
    for step in (1, 2, 3):
        saver.save(state(step), step=step, identical=lambda key: True)
        saver.wait()
    flushed = tiers.peer_replicator.flush(60.0)
    counters = tiers.peer_replicator.snapshot()
    tiers.close(60.0)
    saver.close()
    return {"flushed": flushed, "counters": counters}


def resume_with_peers(
    rank: int, world_size: int, base: str, durable: str, options: dict, per_node: int, scan: bool
) -> dict:
    """A new world (`per_node` ranks per node) picks `latest` across the tiers and loads it resharded."""
    tiers = CheckpointTiers(config(base, durable, options, per_node, scan), rank // per_node, rank % per_node)
    group = new_checkpoint_group(30.0)
    path, load_config, *_ = tiers.pick("latest", LoadConfig(), group)
    target = {key: torch.zeros(2048) for key in KEYS}
    result = load_checkpoint(target, path, config=load_config, process_group=group)
    expected = state(result.step)
    return {
        "path": path,
        "loaded": result.path,  # where this rank read it: its own node root
        "step": result.step,
        "exact": all(torch.equal(target[key], expected[key]) for key in KEYS),
        "restore": dataclasses.asdict(tiers.peer_restore) if tiers.peer_restore else None,
    }


def exchange_with_a_damaged_range(rank: int, world_size: int, base: str) -> dict:
    """Two ranks swap one file each in 1 KiB pieces (a ring of two); rank 1's file arrives at rank 0 with one
    range that does not match the checksum rank 0 expects (it rotted after its commit, say)."""
    import os

    import fsspec

    from lightning_shardckpt.engine.format.checksum import streaming_checksum
    from lightning_shardckpt.engine.tiers.peer_transfer import Incoming, Outgoing, exchange

    fs = fsspec.filesystem("file")
    data = [bytes((i * 7 + r) % 251 for i in range(5000 + 123 * r)) for r in range(2)]

    def ranges(payload: bytes, spoil: bool) -> list[tuple[int, int, str]]:
        out = []
        for offset in range(0, len(payload), 2000):
            piece = payload[offset : offset + 2000]
            hasher = streaming_checksum()
            hasher.update(piece if not (spoil and offset == 2000) else piece[::-1])
            out.append((offset, len(piece), hasher.hexdigest()))
        return out

    mine = os.path.join(base, f"rank{rank}", "sent.bin")
    fs.makedirs(os.path.dirname(mine), exist_ok=True)
    fs.pipe_file(mine, data[rank])
    other = 1 - rank
    target = os.path.join(base, f"rank{rank}", "received.bin")
    result = exchange(
        [Outgoing(fs, mine, len(data[rank]))],
        other,
        [Incoming(fs, target, len(data[other]), ranges(data[other], spoil=rank == 0))],
        other,
        None,
        piece_bytes=1024,
    )
    return {
        "problems": result.problems,
        "received": fs.cat_file(target) == data[other] if fs.exists(target) else None,
        "part_left": fs.exists(target + ".part"),
    }


def _two_nodes_of_one_rank(rank: int, base: str, timeout_s: float) -> tuple[Any, Any, Any, list[dict]]:
    """Rank r is node r with its own fast root, peer copies on, a local durable tier these tests never copy to;
    (tiers, saver, peer replicator, the `peer_replication` events rank 0's listener collects)."""
    import os

    os.makedirs(f"{base}/durable", exist_ok=True)
    tiers_config = dataclasses.replace(config(base, f"{base}/durable", {}, 1), collective_timeout_s=timeout_s)
    tiers = CheckpointTiers(tiers_config, rank, 0)
    saver = CheckpointSaver(
        tiers.fast_dirpath, SaveConfig(write_events=False, collective_timeout_s=timeout_s, node_local=True)
    )
    tiers.start(saver, saver.run_id, allow_shared_root=False, is_global_zero=rank == 0)
    events: list[dict] = []
    tiers.peer_replicator.listeners.append(events.append)
    return tiers, saver, tiers.peer_replicator, events


def a_dead_peer_stops_replication(rank: int, world_size: int, base: str) -> dict:
    """Two nodes of one rank: step 1 is copied to the peer; then rank 1 dies (its process exits), and rank 0's
    later commits reach a replicator whose group is dead. Rank 0 returns the `peer_replication` events its
    listener saw (what the health rules observe)."""
    import os
    import time

    _, saver, peers, events = _two_nodes_of_one_rank(rank, base, timeout_s=10.0)
    name = saver.save(state(1), step=1, identical=lambda key: True).result(60.0).path.rstrip("/").rsplit("/", 1)[-1]
    assert peers.flush(60.0), "the first copy completes while both ranks live"
    if rank == 1:
        os._exit(0)  # the node is lost: its sockets close mid-run
    peers.submit(name)  # a commit arrives; the copy finds its peer gone
    deadline = time.monotonic() + 30
    while peers.broken is None and time.monotonic() < deadline:
        time.sleep(0.05)
    broken = peers.broken is not None
    for _ in range(2):  # commits after the thread stopped: nobody copies them
        peers.submit(name)
    return {"broken": broken, "stopped": peers.stopped, "events": events, "lag": peers.snapshot()}


def peer_copies_onto_a_full_node_root(rank: int, world_size: int, base: str) -> dict:
    """Two nodes of one rank; node 1's root is a small tmpfs (mounted by the test) with room for its own shard but
    not for rank 0's, which is its peer copy. Two saves; rank 0 returns the `peer_replication` events."""
    tiers, saver, peers, events = _two_nodes_of_one_rank(rank, base, timeout_s=30.0)
    elements = (3 << 20) // 4 if rank == 0 else 16 << 10  # rank 0: 3 MiB of float32, rank 1: 64 KiB
    committed = []
    for step in (1, 2):
        mine = {f"rank{rank}": torch.full((elements,), float(step))}
        committed.append(saver.save(mine, step=step).result(60.0).committed)
        assert peers.flush(60.0), f"rank {rank}: the peer copy of step {step} did not finish"
    counters = peers.snapshot()
    tiers.close(60.0)
    saver.close()
    return {"committed": committed, "events": events, "counters": counters, "broken": peers.broken is not None}


def rollback_and_damage_on_two_nodes(rank: int, world_size: int, base: str) -> dict:
    """Issue 37 items 1, 2 and 7, through the Checkpointer's one resume: 4 ranks as 2 nodes of 2, node-local fast
    roots with peer copies, every commit copied to the durable tier, one DTensor row-sharded over the 4 ranks.

    Run 1 commits steps 4, 8, 10, 12 (the fast tier keeps 3); run 2 resumes step 4 (only the durable tier still
    holds it) and commits step 6, now the newest commit; node 1's root is emptied (a replacement) and `latest`
    resumes. Then 256 bytes of node 1's copy of the resumed checkpoint are flipped (same size) and a directory
    `ls` marks corrupt (its manifest's seq is "x") is added to node 0's root, and `latest` resumes again."""
    import os
    import shutil

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_shardckpt import Checkpointer

    os.environ.update(GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", WORLD_SIZE="4")
    mesh = init_device_mesh("cpu", (world_size,))
    tiers = {
        "fast": {"dirpath": f"{base}/node{{node_rank}}", "keep_last": 3, "peers": {"factor": 2, "jump": 2}},
        "durable": {"dirpath": f"{base}/durable", "every_n_checkpoints": 1},
        "collective_timeout_s": 60.0,
    }

    def value(step: int) -> torch.Tensor:
        return torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16) * (step + 1)

    def state(step: int) -> dict[str, Any]:
        return {"w": distribute_tensor(value(step), mesh, [Shard(0)])}

    def resume(which: Any = "latest") -> dict[str, Any]:
        loaded = state(-1)
        with Checkpointer(tiers=tiers) as ckpt:
            step = ckpt.load(loaded, which=which)
            source = ckpt.last_load.source
            path = ckpt.last_load.path
        return {
            "step": step,
            "exact": torch.equal(loaded["w"].full_tensor(), value(step)),
            "source": source,
            "path": path,
        }

    with Checkpointer(tiers=tiers) as ckpt:  # run 1
        for step in (4, 8, 10, 12):
            assert ckpt.save(step, state(step), blocking=True).result().committed
    out: dict[str, Any] = {}
    with Checkpointer(tiers=tiers) as ckpt:  # run 2: a rollback to step 4, held only by the durable tier
        rolled = state(-1)
        out["rolled_back_to"] = ckpt.load(rolled, which=4)
        out["rolled_back_from"] = ckpt.last_load.source
        assert ckpt.save(6, state(6), blocking=True).result().committed
    dist.barrier()
    if rank == 0:
        shutil.rmtree(f"{base}/node1")  # a replacement node
    dist.barrier()
    out["after_rollback"] = resume()
    dist.barrier()
    if rank == 0:
        name = out["after_rollback"]["path"].rstrip("/").rsplit("/", 1)[-1]
        with open(f"{base}/node1/{name}/__2_0.distcp", "r+b") as shard:
            shard.seek(os.path.getsize(shard.name) // 2)
            middle = shard.read(256)
            shard.seek(-256, 1)
            shard.write(bytes(byte ^ 0xFF for byte in middle))
        corrupt = f"{base}/node0/step-000000020-00000000abcd"
        shutil.copytree(f"{base}/node0/{name}", corrupt)
        with open(f"{corrupt}/manifest.json") as handle:
            manifest = json.load(handle)
        manifest["seq"] = "x"
        with open(f"{corrupt}/manifest.json", "w") as handle:
            json.dump(manifest, handle)
    dist.barrier()
    out["after_damage"] = resume()
    return out


def save_onto_an_aliased_node_root(
    rank: int, world_size: int, base: str, durable: str, options: dict, per_node: int
) -> dict:
    """Steps 1-3 with peer copies where node 1's root is a symlink to node 0's: what the replicator warned and
    reported (rank 0: each copy's event), and the load of the last step from node 1's root."""
    from tests.helpers.log_capture import warnings_of

    tiers = CheckpointTiers(config(base, durable, options, per_node), rank // per_node, rank % per_node)
    saver = CheckpointSaver(
        tiers.fast_dirpath, SaveConfig(write_events=False, collective_timeout_s=30.0, node_local=True)
    )
    events: list[dict] = []
    with warnings_of("lightning_shardckpt.engine.tiers") as warned:
        tiers.start(saver, saver.run_id, allow_shared_root=False, is_global_zero=rank == 0)
        tiers.peer_replicator.listeners.append(events.append)
        for step in (1, 2, 3):
            saver.save(state(step), step=step, identical=lambda key: True)
            saver.wait()
        flushed = tiers.peer_replicator.flush(60.0)
    counters = tiers.peer_replicator.snapshot()
    tiers.close(60.0)
    saver.close()
    return {"flushed": flushed, "counters": counters, "warned": warned, "events": events}


def milestones_on_an_aliased_node_root(
    rank: int, world_size: int, base: str, durable: str, options: dict, per_node: int
) -> list[int] | None:
    """Steps 1-5 on a node-local fast tier (keep_last 1, no unreplicated spares) whose node 1 root is node 0's under
    another name; node 0's retention keeps the newest and every 2nd step (milestones). Rank 0: the steps node 0's
    root holds at the end."""
    import torch.distributed as dist

    from lightning_shardckpt.engine import catalog

    tiers_config = config(base, durable, options, per_node)
    fast = dataclasses.replace(tiers_config.fast, keep_last=1, max_unreplicated=0)
    tiers = CheckpointTiers(dataclasses.replace(tiers_config, fast=fast), rank // per_node, rank % per_node)
    saver = CheckpointSaver(
        tiers.fast_dirpath, SaveConfig(write_events=False, collective_timeout_s=30.0, node_local=True)
    )
    if rank == 0:
        saver.add_listener(
            lambda record: (
                retention.apply(tiers.fast, 1, 2, run_id=saver.run_id, just_committed=record.path.rsplit("/", 1)[-1])
                if record.outcome == "committed"
                else None
            )
        )
    tiers.start(saver, saver.run_id, allow_shared_root=False, is_global_zero=rank == 0)
    for step in range(1, 6):
        saver.save(state(step), step=step, identical=lambda key: True)
        saver.wait()
    tiers.peer_replicator.flush(60.0)
    tiers.close(60.0)
    saver.close()
    dist.barrier()  # every node's pruning after the last commit is done
    if rank != 0:
        return None
    return [entry.step for entry in catalog.list_checkpoints(tiers.fast) if entry.committed]
