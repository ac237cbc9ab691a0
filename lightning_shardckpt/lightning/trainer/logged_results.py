"""`self.log(..., on_epoch=True)` accumulators of the training epoch, merged across ranks at a mid-epoch save.

Lightning keeps the epoch's running sums (and batch counts, maxima, minima) of every logged tensor in the
training epoch loop's result collection, and saves none of them: a resumed epoch would aggregate only
the batches after the resume. At a save every rank's accumulators are gathered (one collective on the
training group, main thread) and merged by the logged reduction: "mean" adds the weighted sums and the
batch sizes, "sum" adds, "max" / "min" take the extreme. On a mid-epoch resume the entries are rebuilt
before the first batch: rank 0 holds the merged values, every other rank the defaults, so the epoch-end
value (with `sync_dist=True`) is the uninterrupted run's on any world size. Without `sync_dist` each rank
logs its own share in both runs; after a resume rank 0's share also holds the saved ranks' batches.

Logged `torchmetrics.Metric` objects are not in here: their states are merged with the module's metrics
(metric_states.py). Entries logged with `sync_dist_group` (a process group cannot be saved) are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync

from ...engine.collectives import all_gather_objects

_REDUCTIONS: dict[str, Callable[..., Any]] = {"mean": torch.mean, "sum": torch.sum, "max": torch.max, "min": torch.min}
_REDUCTIONS.update({"builtins.sum": sum, "builtins.max": max, "builtins.min": min})
_NAMES = {id(fn): name for name, fn in _REDUCTIONS.items()}
_FIELDS: tuple[str, ...] = (
    "fx",
    "name",
    "prog_bar",
    "logger",
    "on_step",
    "on_epoch",
    "enable_graph",
    "add_dataloader_idx",
)
_FIELDS += ("dataloader_idx", "metric_attribute")


def _results(trainer: Any) -> Any:
    return trainer.fit_loop.epoch_loop._results  # the training epoch's collection (Lightning keeps no accessor)


def _saveable(entry: _ResultMetric) -> bool:
    meta = entry.meta
    return (
        entry.is_tensor
        and meta.on_epoch
        and not entry.has_reset
        and meta.sync.group is None
        and id(meta.reduce_fx) in _NAMES
    )


def _local(entry: _ResultMetric) -> dict[str, Any]:
    meta = entry.meta
    saved = {field: getattr(meta, field) for field in _FIELDS}
    saved.update(reduce=_NAMES[id(meta.reduce_fx)], sync_dist=meta.sync.should, rank_zero_only=meta.sync.rank_zero_only)
    saved["value"] = entry.value.detach().to("cpu", copy=True)
    if meta.is_mean_reduction:
        saved["batch_size"] = entry.cumulated_batch_size.detach().to("cpu", copy=True)
    return saved


def capture(trainer: Any) -> dict[str, dict[str, Any]]:
    """Every rank (a collective): {result key: metadata and merged accumulators}, the same on every rank."""
    local = {key: _local(entry) for key, entry in _results(trainer).items() if _saveable(entry)}
    merged: dict[str, dict[str, Any]] = {}
    for share in all_gather_objects("logged-epoch-results", local, None):  # the training group: main thread
        for key, saved in share.items():
            if key not in merged:
                merged[key] = dict(saved)
                continue
            into = merged[key]
            if saved["reduce"] in ("max", "builtins.max"):
                into["value"] = torch.maximum(into["value"], saved["value"])
            elif saved["reduce"] in ("min", "builtins.min"):
                into["value"] = torch.minimum(into["value"], saved["value"])
            else:  # mean: weighted sums and batch sizes add; sum: adds
                into["value"] = into["value"] + saved["value"]
                if "batch_size" in saved:
                    into["batch_size"] = into["batch_size"] + saved["batch_size"]
    return merged


def restore(trainer: Any, saved: dict[str, dict[str, Any]], rank: int) -> None:
    """Every rank, before the first batch of a resumed epoch: the entries rebuilt, rank 0 with the merged
    accumulators, the others at their defaults (zero, -inf, +inf)."""
    results = _results(trainer)
    for key, entry in saved.items():
        meta = _Metadata(**{field: entry[field] for field in _FIELDS}, reduce_fx=_REDUCTIONS[entry["reduce"]])
        # as LightningModule.log builds it, so the next self.log of this key finds its metadata equal
        meta.sync = _Sync(
            fn=trainer.strategy.reduce, _should=entry["sync_dist"], rank_zero_only=entry["rank_zero_only"]
        )
        result = _ResultMetric(meta, is_tensor=True)
        if rank == 0:
            result.value = entry["value"].clone()
            if "batch_size" in entry:
                result.cumulated_batch_size = entry["batch_size"].clone()
        result.to(trainer.strategy.root_device)
        results[key] = result
    if saved:
        # the first resumed batch is not the epoch's first: Lightning must not reset these accumulators on
        # its first self.log (it does so on an epoch's first batch, which it recognises by this flag)
        trainer._logger_connector._first_loop_iter = False
