"""Swap Lightning's injected DistributedSampler for ResumableDistributedSampler, and find it again.

Users keep writing plain DataLoaders: Lightning injects a DistributedSampler (use_distributed_sampler
=True), and the strategy's `process_dataloader` replaces it with ours, same arguments, same order at
position 0. Samplers of other types (custom ones, Lightning's wrappers) are left alone.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, DistributedSampler

from .data import ResumableDistributedSampler


def use_resumable_sampler(dataloader: Any) -> Any:
    if not isinstance(dataloader, DataLoader) or type(dataloader.sampler) is not DistributedSampler:
        return dataloader
    plain = dataloader.sampler
    sampler = ResumableDistributedSampler(
        plain.dataset, num_replicas=plain.num_replicas, rank=plain.rank, shuffle=plain.shuffle, seed=plain.seed, drop_last=plain.drop_last
    )
    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)


def train_sampler(trainer: Any) -> tuple[ResumableDistributedSampler | None, int | None]:
    """The training loader's resumable sampler and its batch size (None, None when there is none)."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    for loader in getattr(combined, "flattened", []) or []:
        sampler = getattr(loader, "sampler", None)
        if not isinstance(sampler, ResumableDistributedSampler):
            sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        if isinstance(sampler, ResumableDistributedSampler):
            return sampler, getattr(loader, "batch_size", None)
    return None, None
