"""Swap Lightning's injected DistributedSampler for ResumableDistributedSampler, and find it again.

Users keep writing plain DataLoaders: Lightning injects a DistributedSampler (use_distributed_sampler
=True), and the strategy's `process_dataloader` replaces it with ours, same arguments, same order at
position 0. Samplers of other types (custom ones, Lightning's wrappers) are left alone.

While a fit resumed through our sampler runs, Lightning's "your dataloader is not resumable" warning is
silenced (that message only, until the strategy's teardown): the position it misses is the one
`restore_position` restored.
"""

from __future__ import annotations

import logging
import math
import re
import warnings
from typing import Any, cast

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader, DistributedSampler

from ...training.data import ResumableDistributedSampler, replacing

log = logging.getLogger(__name__)

# lightning/pytorch/loops/training_epoch_loop.py, at a mid-epoch resume whose loader has no state_dict
NOT_RESUMABLE_WARNING = (
    "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable"
)
_quieted: list[Any] = []  # the warnings filter entry installed for the running fit (one at most)


def use_resumable_sampler(dataloader: Any) -> Any:
    if not isinstance(dataloader, DataLoader) or type(dataloader.sampler) is not DistributedSampler:
        return dataloader
    return _update_dataloader(dataloader, replacing(dataloader.sampler), mode=RunningStage.TRAINING)


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


def restore_position(trainer: Any, dataloader: Any, state: dict[str, Any]) -> bool:
    """Put the training loader's sampler at the saved position, and Lightning's count of the epoch's
    batches where that position stands, before Lightning sizes the epoch (call from process_dataloader).

    The epoch keeps its full length on this world size (`len(sampler)`), and its batch count starts at
    (full - remaining) batches, so the rest of the epoch runs like an uninterrupted one: K micro-batches
    per optimizer step, a step on the epoch's last batch, validation at its end. On the saved world size
    the count is Lightning's own (the batches applied before the save). False: no resumable sampler.
    """
    sampler = _sampler_of(dataloader)
    if sampler is None:
        log.warning("the training loader has no resumable sampler: its position in the epoch is not restored")
        return False
    sampler.load_state_dict(state)
    _quiet_not_resumable_warning()
    if sampler.global_position == 0:
        return True  # at an epoch start: Lightning's restored counters are right as they are
    batch_size = getattr(dataloader, "batch_size", None) or 1
    drop_last = bool(getattr(dataloader, "drop_last", False))
    done = _batches(len(sampler), batch_size, drop_last) - _batches(sampler.num_samples, batch_size, drop_last)
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = done - progress.ready
    # all four counters move together, so Lightning's restart logic (which tells a save at batch end by
    # completed == processed - 1) reads them as it would have
    progress.ready += shift
    progress.started += shift
    progress.processed += shift
    progress.completed += shift
    log.info(
        "resuming epoch %d at global sample %d of %d: batch %d of %d on this rank",
        sampler.epoch,
        sampler.global_position,
        sampler.dataset_length,
        done,
        _batches(len(sampler), batch_size, drop_last),
    )
    return True


def _sampler_of(dataloader: Any) -> ResumableDistributedSampler | None:
    sampler = getattr(dataloader, "sampler", None)
    if not isinstance(sampler, ResumableDistributedSampler):
        sampler = getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)
    return sampler if isinstance(sampler, ResumableDistributedSampler) else None


def _batches(samples: int, batch_size: int, drop_last: bool) -> int:
    return samples // batch_size if drop_last else math.ceil(samples / batch_size)


def _quiet_not_resumable_warning() -> None:
    """Lightning sees a plain DataLoader and warns that the epoch's position is lost; ours was restored."""
    if not _quieted:
        warnings.filterwarnings("ignore", message=re.escape(NOT_RESUMABLE_WARNING), category=PossibleUserWarning)
        _quieted.append(warnings.filters[0])


def end_of_fit() -> None:
    """The strategy's teardown: the next fit may have no resumable sampler, and then the warning is right."""
    while _quieted:
        entry = _quieted.pop()
        filters = cast(list[Any], warnings.filters)  # a list (typeshed: a Sequence), which filterwarnings edits too
        if entry in filters:  # a caller's catch_warnings may have restored the list meanwhile
            filters.remove(entry)
