"""The module's torchmetrics, merged across ranks at a save and handed back so the next sync adds up.

Each rank accumulates its own share of a `torchmetrics.Metric`; a plain checkpoint keeps none of it
(states are not persistent by default) or rank 0's share only (`persistent(True)`: the model state dict
is rank 0's copy). At a save every rank syncs each metric of the LightningModule (the metric's own
`sync`: its process group, its `dist_sync_fn`, its reductions), the merged states are stored (the pickled
Lightning state is rank 0's copy) and the live states are put back (unsync): the run goes on unchanged.

On load, by each state's reduction, so that the next sync over any world size gives the totals of an
uninterrupted run:
- "sum" and "cat": rank 0 gets the merged state, every other rank the state's default (zero, empty);
  a sum is exact, a concatenation holds the same elements (in another order: the saved ranks' first);
- "max" and "min": every rank gets the merged state (exact: they are idempotent);
- "mean": every rank gets the merged mean (exact when the ranks' states agree; otherwise the next sync
  averages per rank, not per sample, as the metric itself does);
- no reduction or a custom one: the merged state has the saved world size's shape, so nothing is merged:
  rank 0 gets saved rank 0's own state, the others the default, and the save warns once naming it.

torchmetrics is optional: without it there is nothing to merge. Runs on the main thread, where Lightning
dumps the checkpoint: the training process group is free there (background saves use their own group).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

SUM, CAT, MAX, MIN, MEAN, UNMERGED = "sum", "cat", "max", "min", "mean", "unmerged"
_ON_RANK_ZERO = (SUM, CAT, UNMERGED)  # the others get the default
_warned: set[tuple[str, str]] = set()


def _torchmetrics() -> Any:
    try:
        import torchmetrics
        from torchmetrics.utilities import data
    except ImportError:  # optional: a module without torchmetrics has no metric to merge
        return None, {}
    kinds = {data.dim_zero_sum: SUM, data.dim_zero_cat: CAT, data.dim_zero_max: MAX, data.dim_zero_min: MIN}
    return torchmetrics.Metric, {**kinds, data.dim_zero_mean: MEAN}


def _metrics(module: nn.Module) -> list[tuple[str, Any]]:
    metric_type, _ = _torchmetrics()
    if metric_type is None:
        return []
    return [(name, m) for name, m in module.named_modules() if isinstance(m, metric_type) and _reductions(m)]


def _reductions(metric: Any) -> dict[str, Any]:
    # torchmetrics keeps each state's dist_reduce_fx only here (no public accessor in 1.x)
    return dict(getattr(metric, "_reductions", {}) or {})


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return [_detached(item) for item in value]


def capture(module: nn.Module, rank: int) -> dict[str, dict[str, dict[str, Any]]]:
    """Every rank, same order (each metric's sync is a collective): {metric name: {state: kind, value}}."""
    _, kinds = _torchmetrics()
    saved: dict[str, dict[str, dict[str, Any]]] = {}
    for name, metric in _metrics(module):
        reductions = _reductions(metric)
        local = {state: _detached(getattr(metric, state)) for state in reductions}
        with metric.sync_context(dist_sync_fn=metric.dist_sync_fn):  # unsyncs on exit: the live run is unchanged
            merged = {state: _detached(getattr(metric, state)) for state in reductions}
        states = {}
        for state, reduction in reductions.items():
            kind = kinds.get(reduction, UNMERGED)
            states[state] = {"kind": kind, "value": local[state] if kind == UNMERGED else merged[state]}
            if kind == UNMERGED and rank == 0 and (name, state) not in _warned:
                _warned.add((name, state))
                log.warning(
                    "metric %r state %r has no sum/cat/max/min/mean reduction (%r): a resume restores rank 0's "
                    "own share of it, not every rank's; give it one of those reductions to have it merged",
                    name,
                    state,
                    reduction,
                )
        saved[name] = states
    return saved


def restore(module: nn.Module, saved: dict[str, dict[str, dict[str, Any]]], rank: int) -> list[str]:
    """Every rank: each saved metric reset, then given its merged states by the rules above. Returns the
    names restored (metrics the checkpoint lacks are left as they are)."""
    restored = []
    for name, metric in _metrics(module):
        if name not in saved:
            continue
        metric.reset()  # the defaults, on every rank
        for state, entry in saved[name].items():
            if not hasattr(metric, state) or (rank != 0 and entry["kind"] in _ON_RANK_ZERO):
                continue
            setattr(metric, state, _placed(entry["value"], getattr(metric, state), metric.device))
        restored.append(name)
    return restored


def _placed(value: Any, current: Any, device: torch.device) -> Any:
    """The saved value on the metric's device, as a list where the live state is one (a cat state)."""
    if isinstance(current, list):
        items = value if isinstance(value, list) else ([value] if value.numel() else [])
        return [item.to(device) for item in items]
    return value.to(device) if isinstance(value, torch.Tensor) else value
