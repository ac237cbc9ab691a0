"""Rank functions for the tier tests: a saver on the fast tier, a Replicator to the durable tier (no Lightning)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine import catalog, ownership
from lightning_shardckpt.engine.collectives import new_checkpoint_group
from lightning_shardckpt.engine.format import groups
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.engine.tiers.config import TierConfig, TiersConfig
from lightning_shardckpt.engine.tiers.replicate import Replicator, missing_on_durable
from tests.helpers import quota_fs  # noqa: F401  (registers quota:// in the ranks)

KEYS = ("a", "b", "c", "d")


def state(step: int) -> dict[str, Any]:
    return {key: torch.full((4096,), float(step * 10 + index)) for index, key in enumerate(KEYS)}


def tiers(fast: str, durable: str, options: dict, timeout_s: float = 30.0) -> TiersConfig:
    return TiersConfig(
        fast=TierConfig(dirpath=fast),
        durable=TierConfig(dirpath=durable, storage_options=options),
        retry_backoff_s=0.2,
        retry_backoff_max_s=1.0,
        collective_timeout_s=timeout_s,
    )


def replicate_on_rank(rank: int, world_size: int, fast: str, durable: str, options: dict, scenario: str) -> dict:
    """Save a few steps on the fast tier with a replicator running; `scenario` picks the fault."""
    config = tiers(fast, durable, options, timeout_s=6.0 if scenario == "kill" else 30.0)
    fast_loc, durable_loc = fsio.resolve(fast), fsio.resolve(durable, options)
    owner = ownership.read_owner(fast_loc)  # a later run of the same job continues its run id
    if scenario == "v5":  # format v5 in groups of one rank: two leaders, two group tables to replicate
        os.environ[groups.GROUP_SIZE_ENV] = "1"
    saver = CheckpointSaver(
        fast,
        SaveConfig(
            write_events=False,
            collective_timeout_s=30.0,
            run_id=owner["run_id"] if owner else None,
            format_version=5 if scenario == "v5" else 4,
        ),
    )
    group = new_checkpoint_group(config.collective_timeout_s)
    catch_up = missing_on_durable(fast_loc, durable_loc, saver.run_id) if scenario == "catch_up" else None

    def fault(point: str) -> None:
        if scenario == "kill" and rank == 1 and point == "replicate_mid_upload":
            os._exit(17)  # a rank dying with its upload half done

    replicator = Replicator(config, fast_loc, durable_loc, group=group, fault_hook=fault)
    if catch_up is not None:
        replicator.submit(catch_up)
    saver.add_listener(lambda r: replicator.submit(r.path.rsplit("/", 1)[-1]) if r.outcome == "committed" else None)
    steps = {"ok": (1, 2, 3), "outage": (1, 2, 3, 4), "kill": (1,), "catch_up": (), "v5": (1, 2)}[scenario]
    pauses = []
    for step in steps:
        started = time.perf_counter()
        saver.save(state(step), step=step, identical=lambda key: True)
        pauses.append(time.perf_counter() - started)
        saver.wait()
    flushed = replicator.flush(60.0)
    snapshot = replicator.snapshot()
    if scenario != "kill":
        replicator.close(10.0)
        saver.close()
    fast_names = [e.name for e in catalog.list_checkpoints(fast_loc) if e.committed]
    return {
        "flushed": flushed,
        "counters": snapshot,
        "fast": fast_names,
        "pauses": pauses,
        "broken": repr(replicator.broken) if replicator.broken else None,
    }


def fit_tiers_on_rank(
    rank: int,
    world_size: int,
    tiers_options: dict,
    max_steps: int,
    ckpt_path: Any,
    every: int = 2,
    preempt_at: int | None = None,
    drill: dict | None = None,
    nodes: int = 1,
) -> dict:
    """A Lightning fit with ShardedCheckpoint(tiers=...) (see tests/helpers/lightning_run.py for the module).

    `nodes > 1`: the ranks are spread over that many simulated nodes (one rank each, NODE_RANK = rank), so a
    `{node_rank}` fast tier gives each rank its own node-local directory.
    """
    import lightning.pytorch as pl

    from lightning_shardckpt import ShardedCheckpoint, ShardedStrategy
    from tests.helpers.lightning_run import (
        CaptureAtStart,
        CountingCallback,
        PreemptAt,
        TinyData,
        TinyModule,
        _full,
        lightning_env,
    )

    lightning_env(rank, world_size)
    if nodes > 1:
        node_env(rank, world_size, nodes)
    capture = CaptureAtStart()
    checkpoint = ShardedCheckpoint(tiers=tiers_options, every_n_train_steps=every, log_artifact=False, drill=drill)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size // nodes,
        num_nodes=nodes,
        strategy=ShardedStrategy(parallelism="ddp"),
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint, CountingCallback(), capture, *([PreemptAt(preempt_at)] if preempt_at else [])],
    )
    module = TinyModule(parallelism="ddp")
    trainer.fit(module, datamodule=TinyData(), ckpt_path=ckpt_path)
    loaded = trainer.strategy.last_load
    return {
        "at_start": capture.at_start,
        "final": _full(module, trainer.optimizers[0]),
        "global_step": trainer.global_step,
        "loaded_from": loaded.path if loaded is not None else None,
        "counters": checkpoint.plugins.counters(),  # the tiers plug-in's: replicated, degraded_saves, ...
    }


def node_env(rank: int, world_size: int, nodes: int) -> None:
    """Torchelastic's variables for `world_size // nodes` ranks per node: this rank's node and place on it."""
    per_node = world_size // nodes
    os.environ.update(
        {
            "NODE_RANK": str(rank // per_node),
            "GROUP_RANK": str(rank // per_node),
            "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node),
        }
    )
