"""Which checkpoint `fabric.load(path, ...)` opens: a root's latest, a checkpoint directory, or a selector.

The rules are the Trainer's `ckpt_path` (lightning/trainer/strategy.py): "latest", "last-good", a step number, an id or
a directory name are relative to the strategy's `root=`; anything else is a path. "latest" relative to the root
starts fresh when the root holds nothing committed (unless resume is required); an explicit path that holds
nothing committed is an error naming what is there: a typo'd path must not train from scratch and exit 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ...engine import catalog
from ...engine.collectives import broadcast_from_coordinator, rank_and_world
from ...engine.format.layout import join, parse_dirname
from ...engine.storage import fsio
from ...errors import CheckpointNotFound, ConfigError, ShardCkptError
from ..lightning_state import LIGHTNING_KEY
from .state import FABRIC_KEY

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Picked:
    """The checkpoint a load opens, as rank 0 found it (broadcast to every rank)."""

    path: str  # the checkpoint directory
    step: int
    blob_key: str | None  # "fabric", the Trainer's "lightning", or None (tensors only)
    root_path: str  # its root, normalised: a save into it continues the run
    run_id: str | None


class NothingCommitted(CheckpointNotFound):
    """A root with no committed checkpoint: "latest" relative to the strategy's root starts fresh on it."""


def resolve_source(text: str, root: str | None) -> tuple[str, str, bool]:
    """(root, which, fresh_if_empty) for `fabric.load`'s path: a selector relative to `root`, or a path."""
    is_selector = "/" not in text and (
        text in ("latest", catalog.LAST_GOOD)
        or text.isdigit()
        or parse_dirname(text) is not None
        or (len(text) == 12 and all(c in "0123456789abcdef" for c in text))
    )
    if not is_selector:
        return text, "latest", False
    if root is None:
        raise ConfigError(
            f"fabric.load({text!r}) names a checkpoint relative to a root, but the strategy has none; "
            f"pass ShardedFabricStrategy(root=...) or a path"
        )
    return root, text, text == "latest"


def pick(
    root: str, which: str, *, fresh_if_empty: bool, resume_required: bool, storage_options: dict, group: Any
) -> Picked | None:
    """Collective "fabric-pick": the checkpoint to load, every rank alike; None: start fresh. Rank 0 lists;
    what it raises is raised on every rank."""
    is_coordinator = rank_and_world(group)[0] == 0
    picked = broadcast_from_coordinator(
        "fabric-pick", _pick_here(root, which, storage_options) if is_coordinator else None, group
    )
    if isinstance(picked, ShardCkptError):
        if isinstance(picked, NothingCommitted) and fresh_if_empty:
            if resume_required:
                raise CheckpointNotFound(
                    f"fabric.load('latest') but {root} holds no committed checkpoint and resume_required=True; "
                    "check the strategy's root=, or set resume_required=False to start fresh"
                )
            log.warning("no committed checkpoint in %s: starting fresh", root)
            return None
        raise picked
    return picked


def _pick_here(root: str, which: str, storage_options: dict) -> Picked | ShardCkptError:
    try:
        location = fsio.resolve(root, storage_options)
        if parse_dirname(location.path) is None and which == "latest":
            if catalog.newest_committed(catalog.list_checkpoints(location)) is None:
                return NothingCommitted(
                    f"{root} holds no committed checkpoint: found {catalog.describe_contents(location)}; pass a "
                    "checkpoint root or directory that holds one (`shardckpt ls ROOT` lists them), or load "
                    "'latest' with the strategy's root= set, which starts fresh on an empty root"
                )
        location, entry = catalog.open_checkpoint(root, which, storage_options)
    except ShardCkptError as err:  # sent to every rank, raised everywhere
        return err
    objects = {item["fqn"] for item in entry.manifest.get("objects", [])}
    blob_key = next((key for key in (FABRIC_KEY, LIGHTNING_KEY) if key in objects), None)
    return Picked(join(location.url, entry.name), entry.step, blob_key, location.path, entry.run_id)
