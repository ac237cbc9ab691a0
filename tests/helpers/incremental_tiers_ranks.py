"""Rank functions for incremental saves on tiers (issue 46): simulated nodes (node rank = rank // ranks per node), each
its own `base/node{node_rank}` fast root, peer copies one node on, a durable tier; three saves in which some tensors
stay unchanged, so the later checkpoints reference the earlier ones' files (FORMAT.md §10.6)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig, SignConfig
from lightning_shardckpt.engine.collectives import new_checkpoint_group
from lightning_shardckpt.engine.config import LoadConfig
from lightning_shardckpt.engine.format import groups
from lightning_shardckpt.engine.load.loader import load_checkpoint
from lightning_shardckpt.engine.tiers.config import PeersConfig, TierConfig, TiersConfig
from lightning_shardckpt.policies import retention
from lightning_shardckpt.policies.tiers.checkpoint_tiers import CheckpointTiers

KEYS = tuple("abcdefgh")  # written spread over the ranks (declared identical): every rank writes a shard
STEPS = (1, 2, 3)


def expected(step: int) -> dict[str, torch.Tensor]:
    """The state saved at `step`: `a` changes at every save, `b` once (before step 2), the rest never."""
    changes = {"a": step - 1, "b": min(step, 2) - 1}
    return {
        key: torch.arange(2048, dtype=torch.float32) * 3 + index + changes.get(key, 0) for index, key in enumerate(KEYS)
    }


def tiers_config(
    base: str, durable: str | None, options: dict, per_node: int, *, keep_last: int | None = None, every_n: int = 100
) -> TiersConfig:
    return TiersConfig(
        fast=TierConfig(
            dirpath=f"{base}/node{{node_rank}}",
            peers=PeersConfig(factor=2, jump=per_node, scan_local_roots=False),
            keep_last=keep_last,
        ),
        durable=TierConfig(dirpath=durable, storage_options=options, every_n_checkpoints=every_n, keep_last=keep_last)
        if durable
        else None,
        retry_backoff_s=0.2,
        retry_backoff_max_s=1.0,
        collective_timeout_s=60.0,
    )


def save_incrementally(
    rank: int,
    world_size: int,
    config: TiersConfig,
    per_node: int,
    keep_last: int | None = None,
    key_path: str | None = None,
    group_size: int | None = None,
) -> dict[str, Any]:
    """Steps 1, 2, 3 on node-local fast roots with incremental saves (step 1 full, 2 and 3 referencing the tensors
    that did not change), peer copies flushed after each; rank 0 applies the fast tier's retention after each commit
    (keep_last) as the retention plug-in does; every commit copied to the durable tier when it has one."""
    if group_size is not None:
        os.environ[groups.GROUP_SIZE_ENV] = str(group_size)  # this rank process only (a tests-only variable)
    tiers = CheckpointTiers(config, rank // per_node, rank % per_node)
    sign = SignConfig(key_path=key_path) if key_path else SignConfig()
    saver = CheckpointSaver(
        tiers.fast_dirpath,
        SaveConfig(write_events=False, collective_timeout_s=60.0, node_local=True, incremental=True, sign=sign),
    )
    if rank == 0 and keep_last:
        saver.add_listener(
            lambda record: (
                retention.apply(
                    tiers.fast, keep_last, None, run_id=saver.run_id, just_committed=record.path.rsplit("/", 1)[-1]
                )
                if record.outcome == "committed"
                else None
            )
        )
    tiers.start(saver, saver.run_id, allow_shared_root=False, is_global_zero=rank == 0)
    state = expected(1)
    manifests = []
    for step in STEPS:
        if step > 1:
            state["a"].add_(1)  # in place: the tracker sees `a` (and `b` once) changed, the rest not
            if step == 2:
                state["b"].add_(1)
        result = saver.save(state, step=step, identical=lambda key: True).result(timeout=120)
        assert result.committed, result.error
        manifests.append(result.manifest if rank == 0 else None)
        assert tiers.peer_replicator.flush(120.0), f"rank {rank}: the peer copy of step {step} did not finish"
        if tiers.replicator is not None:
            assert tiers.replicator.flush(120.0), f"rank {rank}: the durable copy of step {step} did not finish"
    counters = tiers.counters()
    tiers.close(120.0)
    saver.close()
    return {"manifests": manifests, "counters": counters}


def resume_from_peers(rank: int, world_size: int, config: TiersConfig, per_node: int, public_key: str | None = None):
    """A new world (`per_node` ranks per node) picks `latest` across the tiers (peer copies first) and loads it."""
    tiers = CheckpointTiers(config, rank // per_node, rank % per_node)
    group = new_checkpoint_group(60.0)
    policy = LoadConfig(require_signature=True, public_keys=[public_key]) if public_key else LoadConfig()
    path, load_config, *_ = tiers.pick("latest", policy, group)
    target = {key: torch.zeros(2048) for key in KEYS}
    result = load_checkpoint(target, path, config=load_config, process_group=group)
    return {
        "loaded": result.path,
        "step": result.step,
        "exact": all(torch.equal(target[key], expected(result.step)[key]) for key in KEYS),
        "restore": dataclasses.asdict(tiers.peer_restore) if tiers.peer_restore else None,
    }


def load_directory(rank: int, world_size: int, path: str, options: dict, public_key: str | None = None) -> dict:
    """Load one checkpoint directory (the durable copy) on this world; bit-exact against the saved state."""
    target = {key: torch.zeros(2048) for key in KEYS}
    policy = {"require_signature": True, "public_keys": [public_key]} if public_key else {}
    result = load_checkpoint(target, path, config=LoadConfig(storage_options=options, **policy))
    return {"step": result.step, "exact": all(torch.equal(target[key], expected(result.step)[key]) for key in KEYS)}
