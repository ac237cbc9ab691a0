"""The checkpoint process group and the few named collectives the engine runs itself.

Background saves must not share the training group: a collective from a background thread on the
group the main thread also uses hangs (measured with DCP's thread-mode async save on gloo). So the
engine creates one dedicated gloo group per run, with a timeout, and every checkpoint collective runs
on it: a dead rank makes the others fail after the timeout instead of hanging.
"""

from __future__ import annotations

import logging
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)


def is_distributed() -> bool:
    # No process group exists before torch.distributed is imported, so this asks nothing of a process that
    # never imported it: the `shardckpt` command lists and inspects checkpoints without importing torch.
    loaded = sys.modules.get("torch.distributed")
    return loaded is not None and loaded.is_available() and loaded.is_initialized()


def _dist() -> dist:
    """torch.distributed, which every caller below only asks for once is_distributed() said it is in use."""
    return sys.modules["torch.distributed"]


def rank_and_world(group: Any = None) -> tuple[int, int]:
    if not is_distributed():
        return 0, 1
    return _dist().get_rank(group), _dist().get_world_size(group)


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
