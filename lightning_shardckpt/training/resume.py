"""A resume under a checkpoint plan, framework-free: which checkpoint, from which tier, and what if it fails.

`latest` (or `last-good`) is looked up in the plan's root, or across the tiers when the plan has them
(policies/tiers/plugin.py); with nothing committed a resume starts fresh (None), unless `resume_required`. A
checkpoint that fails its checksums loads again from the other tier's copy, then, with
`drill.fallback_to_last_good`, from the last known-good. Every rank decides alike: rank 0 lists, and
the others get its answer on `group`. ShardedStrategy.load_checkpoint walks the same steps for Lightning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..engine import catalog
from ..engine.collectives import broadcast_from_coordinator, rank_and_world
from ..engine.config import LoadConfig
from ..engine.format.layout import join, parse_dirname
from ..engine.load.loader import LoadResult, load_checkpoint
from ..engine.storage import fsio
from ..errors import CheckpointNotFound, CorruptCheckpoint
from .plan import CheckpointPlan

log = logging.getLogger(__name__)


Target = dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]]  # or shaped by the picked manifest


def resume(
    plan: CheckpointPlan, target: Target, which: str | int, group: Any, *, strict: bool = True
) -> LoadResult | None:
    """Load `which` into `target` in place ("latest", "last-good", a step, an id, or a path); None: nothing to
    resume from (a `latest` of an empty root). `strict=False`: what the checkpoint lacks keeps its value.
    Collective over `group`."""
    which = str(which) if isinstance(which, int) else which
    root, config, fallbacks = plan.root, plan.load, []
    if "/" in which or which == plan.root:  # a path: it must hold a checkpoint, never "start fresh"
        root, which = which, "latest"
        if not _agreed_has_committed(root, config, group):
            raise CheckpointNotFound(
                f"{root} holds no committed checkpoint; pass a checkpoint root or directory that holds one "
                "(`shardckpt ls ROOT` lists them), or load(state) to resume from the Checkpointer's root"
            )
    elif plan.tier_restore is not None and which in ("latest", catalog.LAST_GOOD):
        root, config, fallbacks = plan.tier_restore.pick(which, plan.load, group)  # collective
        which = "latest"
    if which == "latest" and not _agreed_has_committed(root, config, group):
        if plan.resume_required:
            raise CheckpointNotFound(
                f"load(state) found no committed checkpoint in {root} and resume_required=True; check the root, "
                "or set resume_required=False to start fresh"
            )
        log.info("no committed checkpoint in %s: starting fresh", root)
        return None
    try:
        return load_checkpoint(target, root, which, config=config, strict=strict, process_group=group)
    except CorruptCheckpoint as err:  # every rank raises it alike (DCP gathers failures)
        for path, other, message in fallbacks:
            log.warning("%s (%s)", message, err)
            try:
                return load_checkpoint(target, path, config=other, strict=strict, process_group=group)
            except CorruptCheckpoint as again:
                err = again
        return _last_good(plan, err, target, which, group, strict)


def _last_good(
    plan: CheckpointPlan, err: CorruptCheckpoint, target: Target, which: str, group: Any, strict: bool
) -> LoadResult:
    if which != "latest":
        raise err
    if plan.tier_restore is not None:
        good = plan.tier_restore.last_good(plan.load, group)  # collective
        path, config = good if good is not None else (None, plan.load)
    else:
        path, config = broadcast_from_coordinator("last-good", _last_good_path(plan), group), plan.load
    if path is None or not plan.fallback_to_last_good:
        hint = (
            f"the last known-good checkpoint is {path}: load(state, which='last-good'), or set "
            "drill={'fallback_to_last_good': True} to do so automatically"
            if path
            else "no checkpoint of this root has passed a restore drill; pick an older one with `shardckpt ls`"
        )
        raise CorruptCheckpoint(f"{err}\n{hint}", problems=err.problems) from err
    log.warning("the latest checkpoint did not load (%s); fallback_to_last_good: resuming from %s", err, path)
    return load_checkpoint(target, path, config=config, strict=strict, process_group=group)


def _last_good_path(plan: CheckpointPlan) -> str | None:
    if rank_and_world()[0] != 0:
        return None
    try:
        good = catalog.last_good(plan.location, catalog.list_checkpoints(plan.location))
    except Exception:  # noqa: BLE001 - a hint for an error being raised; never a second error
        log.debug("could not look up the last known-good checkpoint of %s", plan.root, exc_info=True)
        return None
    return join(plan.location.url, good[-1].name) if good else None


def _agreed_has_committed(root: str, config: LoadConfig, group: Any) -> bool:
    """Rank 0 lists `root` (a checkpoint directory itself counts: the loader opens it or says why not)."""
    answer = None
    if rank_and_world(group)[0] == 0:
        answer = parse_dirname(root.rstrip("/").rsplit("/", 1)[-1]) is not None or (
            catalog.newest_committed(catalog.list_checkpoints(fsio.resolve(root, config.storage_options))) is not None
        )
    return bool(broadcast_from_coordinator("has-committed", answer, group))
