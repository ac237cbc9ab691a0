"""The checkpoint process group and the few named collectives the engine runs itself.

Background saves must not share the training group: a collective from a background thread on the
group the main thread also uses hangs (measured with DCP's thread-mode async save on gloo). So the
engine creates one dedicated gloo group per run, with a timeout, and every checkpoint collective runs
on it: a dead rank makes the others fail after the timeout instead of hanging.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from datetime import timedelta
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)


def is_distributed() -> bool:
    # No process group exists before torch.distributed is imported, so this asks nothing of a process that
    # never imported it: the `shardckpt` command lists and inspects checkpoints without importing torch.
    loaded = sys.modules.get("torch.distributed")
    return loaded is not None and loaded.is_available() and loaded.is_initialized()


def _dist() -> ModuleType:
    """torch.distributed, which every caller below only asks for once is_distributed() said it is in use (a module
    object: mypy cannot name a module as a type, so its functions are unchecked here)."""
    return sys.modules["torch.distributed"]


def rank_and_world(group: Any = None) -> tuple[int, int]:
    if not is_distributed():
        return 0, 1
    return _dist().get_rank(group), _dist().get_world_size(group)


def may_be_coordinator() -> bool:
    """Whether this process can be rank 0, also before the process group exists (a door is built first): torchrun
    sets RANK, launchers set NODE_RANK / GROUP_RANK and LOCAL_RANK. A lone process is its own coordinator."""
    if is_distributed():
        return rank_and_world()[0] == 0
    names = ("RANK", "GROUP_RANK", "NODE_RANK", "LOCAL_RANK")
    return all(os.environ.get(name, "0").strip() in ("", "0") for name in names)


def new_checkpoint_group(timeout_s: float) -> Any:
    """A gloo group over all ranks, created once; must be called by every rank at the same point."""
    if not is_distributed():
        return None
    log.debug("creating the checkpoint gloo group (timeout %.0fs)", timeout_s)
    return _dist().new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def broadcast_from_coordinator(name: str, value: Any, group: Any) -> Any:
    """Collective `name`: every rank returns the coordinator's (rank 0 of `group`) `value`."""
    if not is_distributed():
        return value
    payload = [value]
    log.debug("collective %s: broadcast", name)
    dist = _dist()
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return payload[0]


def broadcast_from(name: str, value: Any, src: int, group: Any) -> Any:
    """Collective `name`: every rank returns rank `src`'s (of `group`) `value`."""
    if not is_distributed():
        return value
    payload = [value]
    log.debug("collective %s: broadcast from %d", name, src)
    dist = _dist()
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    return payload[0]


def all_gather_objects(name: str, value: Any, group: Any) -> list[Any]:
    """Collective `name`: every rank returns every rank's `value`, in rank order."""
    if not is_distributed():
        return [value]
    dist = _dist()
    out: list[Any] = [None] * dist.get_world_size(group)
    log.debug("collective %s: all_gather", name)
    dist.all_gather_object(out, value, group=group)
    return out


def group_ranks_of(global_ranks: tuple[int, ...], group: Any) -> tuple[int, ...]:
    """The ranks within `group` of processes known by their global ranks (DTensor meshes name global ranks;
    a checkpoint's files are named by the rank in its own group)."""
    if group is None or not is_distributed():
        return tuple(global_ranks)
    dist = _dist()
    return tuple(dist.get_group_rank(group, rank) for rank in global_ranks)


def agree(name: str, coordinator_value: int, local_digest: str, group: Any) -> tuple[int, bool]:
    """Collective `name`, one all-reduce: every rank gets the coordinator's `coordinator_value` (an integer
    below 2**62) and whether every rank's `local_digest` (16 hex characters) is the same."""
    if not is_distributed():
        return coordinator_value, True
    import torch

    dist = _dist()
    rank = dist.get_rank(group)
    high, low = int(local_digest[:8], 16), int(local_digest[8:], 16)
    # MAX of (value, digest) and of (-digest): equal digests iff max == min on both halves
    values = torch.tensor([coordinator_value if rank == 0 else -1, high, low, -high, -low], dtype=torch.int64)
    log.debug("collective %s: all_reduce", name)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    value, max_high, max_low, neg_min_high, neg_min_low = (int(v) for v in values.tolist())
    return value, max_high == -neg_min_high and max_low == -neg_min_low


def gather_to_coordinator(name: str, value: Any, group: Any) -> list[Any] | None:
    """Collective `name`: the coordinator (rank 0 of `group`) gets every rank's `value` in rank order; the
    others get None. Each rank sends one object: O(ranks) on the coordinator, O(1) elsewhere."""
    if not is_distributed():
        return [value]
    dist = _dist()
    rank = dist.get_rank(group)
    out: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
    log.debug("collective %s: gather", name)
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    dist.gather_object(value, out, dst=dst, group=group)
    return out


def gather_to(name: str, value: Any, dst: int, sources: Sequence[int], group: Any) -> list[Any] | None:
    """Point-to-point collective `name` among `sources` (ranks of `group`, `dst` among them): rank `dst` gets
    each source's `value` in rank order, the other sources send theirs and get None; ranks outside `sources`
    take no part. Unlike gather_to_coordinator, no rank outside `sources` sends anything (torch's gather_object
    pads every rank's object to the largest one): a group leader hears only its group, and rank 0 only the
    leaders."""
    if not is_distributed():
        return [value]
    dist = _dist()
    rank = dist.get_rank(group)
    if rank not in sources:
        return None
    log.debug("collective %s: point-to-point gather to %d from %d ranks", name, dst, len(sources))
    if rank != dst:
        dist.send_object_list([value], group_dst=dst, group=group)
        return None
    out = []
    for src in sources:
        if src == dst:
            out.append(value)
            continue
        payload: list[Any] = [None]
        dist.recv_object_list(payload, group_src=src, group=group)
        out.append(payload[0])
    return out
