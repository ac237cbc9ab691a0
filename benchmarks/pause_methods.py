"""The methods `benchmarks/pause.py` times, and the state they save.

Each method is a pair: start() returns when the training loop could go on (the pause), finish() waits
until the checkpoint is complete (the total). The docstring of pause.py says what each one is.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from common import COLUMNS, tensor_rows
from torch.distributed.tensor import DTensor

from lightning_shardckpt import CheckpointSaver

METHODS = ("copy", "ours", "pl_sync", "pl_async", "dcp", "dcp_async")
LABELS = {
    "copy": "raw copy",
    "ours": "ours (async)",
    "ours_cold": "ours, 1st save",
    "pl_sync": "Lightning sync",
    "pl_async": "Lightning AsyncCheckpointIO",
    "dcp": "dcp.save",
    "dcp_async": "dcp.async_save",
}
OUR_PHASES = ("pause_s", "stage_s", "write_s", "verify_s", "commit_s", "total_s")  # CheckpointRecord fields


@dataclass(frozen=True)
class BenchConfig:
    size_gib: float  # per rank
    tensors: int
    repeats: int
    warmup: int
    threads: int
    workdir: str
    out_dir: str
    profile: bool
    profile_saves: int


@dataclass
class RankContext:
    """What the methods of one rank share."""

    rank: int
    world_size: int
    config: BenchConfig
    state: dict[str, DTensor]  # this rank's shards
    copy_buffers: list[torch.Tensor]  # the raw copy's preallocated destination
    full_state: dict[str, torch.Tensor] | None  # rank 0: the whole state, for the Lightning methods
    saver: CheckpointSaver
    dcp_group: Any  # dedicated gloo group for dcp.async_save
    lightning_async: Any  # one AsyncCheckpointIO for the run, as a Trainer holds one
    round: int = 0
    step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # per-sample details (our saver's record)


# --- the state ---


def state_rows(config: BenchConfig, world_size: int) -> list[int]:
    """Global rows of each tensor: --size-gib GiB per rank, N x --size-gib GiB in all (see common.tensor_rows)."""
    return tensor_rows(config.tensors, world_size, config.size_gib, per_rank=True)


def make_full_state(config: BenchConfig, state: dict[str, DTensor], world_size: int) -> dict[str, torch.Tensor]:
    """Rank 0's copy of the whole state (what DDP replicates and Lightning saves from rank 0)."""
    if world_size == 1:
        return {name: value.to_local() for name, value in state.items()}  # the same memory: nothing to gather
    generator = torch.Generator().manual_seed(1234)
    full = {}
    for (name, value), rows in zip(state.items(), state_rows(config, world_size)):
        tensor = torch.empty(rows, COLUMNS).uniform_(generator=generator)
        local = value.to_local()
        tensor[: local.shape[0]].copy_(local)
        full[name] = tensor
    return full


def bytes_per_rank(config: BenchConfig, world_size: int) -> int:
    """Bytes of the state each rank holds (its shards)."""
    return sum(state_rows(config, world_size)) // world_size * COLUMNS * 4


def lightning_checkpoint(ctx: RankContext) -> dict[str, Any]:
    """The shape of the dict Trainer.save_checkpoint hands to the CheckpointIO (model weights only)."""
    import lightning

    return {
        "epoch": 0,
        "global_step": ctx.step,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": ctx.full_state,
        "loops": {},
        "callbacks": {},
        "optimizer_states": [],
        "lr_schedulers": [],
    }


# --- the methods: start() returns after the blocking part, with a handle that finish() waits on ---


def start_copy(ctx: RankContext, directory: str) -> Any:
    for source, target in zip(ctx.state.values(), ctx.copy_buffers):
        target.copy_(source.to_local())
    return None


def start_ours(ctx: RankContext, directory: str) -> Any:
    return ctx.saver.save(ctx.state, step=ctx.step)


def finish_ours(ctx: RankContext, pending: Any) -> str:
    result = pending.result()
    records = ctx.saver.poll_records()
    if records:
        ctx.extra["phases"] = {phase: getattr(records[-1], phase) for phase in OUR_PHASES}
    if not result.committed:
        raise RuntimeError(f"not committed: {result.error}")
    return result.path


def start_pl_sync(ctx: RankContext, directory: str) -> Any:
    if ctx.rank == 0:
        from lightning.fabric.plugins.io import TorchCheckpointIO

        TorchCheckpointIO().save_checkpoint(lightning_checkpoint(ctx), os.path.join(directory, f"step={ctx.step}.ckpt"))
    return None


def start_pl_async(ctx: RankContext, directory: str) -> Any:
    if ctx.rank == 0:
        ctx.lightning_async.save_checkpoint(lightning_checkpoint(ctx), os.path.join(directory, f"step={ctx.step}.ckpt"))
    return None


def finish_pl_async(ctx: RankContext, handle: Any) -> None:
    if ctx.rank == 0:
        ctx.lightning_async.teardown()  # waits for the executor; the next save_checkpoint makes a new one


def start_dcp(ctx: RankContext, directory: str) -> Any:
    dcp.save(ctx.state, checkpoint_id=directory)
    return None


def start_dcp_async(ctx: RankContext, directory: str) -> Any:
    return dcp.async_save(ctx.state, checkpoint_id=directory, process_group=ctx.dcp_group)


def finish_dcp_async(ctx: RankContext, future: Any) -> None:
    future.result()


def _nothing(ctx: RankContext, handle: Any) -> None:
    return None


STARTS: dict[str, Callable[[RankContext, str], Any]] = {
    "copy": start_copy,
    "ours": start_ours,
    "pl_sync": start_pl_sync,
    "pl_async": start_pl_async,
    "dcp": start_dcp,
    "dcp_async": start_dcp_async,
}
FINISHES: dict[str, Callable[[RankContext, Any], Any]] = {
    "copy": _nothing,
    "ours": finish_ours,
    "pl_sync": _nothing,
    "pl_async": finish_pl_async,
    "dcp": _nothing,
    "dcp_async": finish_dcp_async,
}
