"""Rank functions for node-local v5 tests: simulated nodes (node rank = rank // ranks per node), each its own
`base/node{node_rank}` fast root, peer copies one node on, every commit copied to the durable tier (no Lightning)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine.config import LoadConfig
from lightning_shardckpt.engine.format import groups
from lightning_shardckpt.engine.load.loader import load_checkpoint
from lightning_shardckpt.policies.tiers.checkpoint_tiers import CheckpointTiers
from tests.helpers.peer_ranks import KEYS, config, state


def start_node_local_saver(
    rank: int,
    base: str,
    durable: str,
    options: dict,
    per_node: int,
    group_size: int | None,
    collective_timeout_s: float,
) -> tuple[CheckpointTiers, CheckpointSaver]:
    """This rank's saver on its node's fast root (`base`/node{n}, `per_node` ranks a node), started with peer copies
    and every commit replicated to the durable tier; groups of `group_size` ranks when set, else the writer's own."""
    if group_size is not None:
        os.environ[groups.GROUP_SIZE_ENV] = str(group_size)  # this rank process only (a tests-only variable)
    tiers_config = config(base, durable, options, per_node)
    durable_tier = dataclasses.replace(tiers_config.durable, every_n_checkpoints=1)
    tiers = CheckpointTiers(dataclasses.replace(tiers_config, durable=durable_tier), rank // per_node, rank % per_node)
    saver = CheckpointSaver(
        tiers.fast_dirpath,
        SaveConfig(write_events=False, collective_timeout_s=collective_timeout_s, node_local=True),
    )
    tiers.start(saver, saver.run_id, allow_shared_root=False, is_global_zero=rank == 0)
    return tiers, saver


def close_flushed(tiers: CheckpointTiers, saver: CheckpointSaver, timeout_s: float) -> dict:
    """Flush the peer copies and the durable replication, close both; whether each flush finished, and the counters."""
    flushed = tiers.peer_replicator.flush(timeout_s)
    durable_flushed = tiers.replicator.flush(timeout_s)
    counters = tiers.counters()
    tiers.close(timeout_s)
    saver.close()
    return {"flushed": flushed, "durable_flushed": durable_flushed, "counters": counters}


def save_v5_with_peers(
    rank: int, world_size: int, base: str, durable: str, options: dict, per_node: int, group_size: int | None
) -> dict:
    """Steps 1 and 2 on node-local fast roots (groups of `group_size` ranks when set, else the writer's own), peer
    copies flushed, each commit replicated to the durable tier before close returns."""
    tiers, saver = start_node_local_saver(rank, base, durable, options, per_node, group_size, 30.0)
    for step in (1, 2):
        saver.save(state(step), step=step, identical=lambda key: True)
        saver.wait()
    return close_flushed(tiers, saver, 60.0)


def load_resharded(rank: int, world_size: int, path: str, options: dict) -> dict:
    """Load one checkpoint directory (the durable copy) on this world; bit-exact against the saved state."""
    target = {key: torch.zeros(2048) for key in KEYS}
    result = load_checkpoint(target, path, config=LoadConfig(storage_options=options))
    expected = state(result.step)
    return {"step": result.step, "exact": all(torch.equal(target[key], expected[key]) for key in KEYS)}


def manifest_of(path: str, options: dict) -> dict[str, Any]:
    import json

    from lightning_shardckpt.engine.storage import fsio

    location = fsio.resolve(path, options)
    return json.loads(location.fs.cat_file(f"{location.path}/manifest.json"))
