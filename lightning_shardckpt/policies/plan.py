"""CheckpointPlan: where a run's checkpoints go and how they are saved and loaded, handed over in one piece.

A front door builds one plan from its options (training/checkpoint_setup.py), plug-ins shape it (tiers move the
root to this node's fast tier; drills set the fallback), and the door's resume and savers use it: the Trainer's
callback hands it to `ShardedStrategy.use_plan`. Frozen: a later change is a new plan, never an attribute
written from outside. Here, below the plug-ins, so that their `shape_plan` is typed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple, Protocol

from ..engine.config import LoadConfig, SaveConfig
from ..engine.storage import fsio
from ..engine.tiers.config import TiersConfig


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where this process runs: what plug-ins need to shape the plan (a node-local fast tier)."""

    node_rank: int = 0
    local_rank: int = 0
    num_nodes: int = 1


@dataclass(frozen=True)
class Fallback:
    """Another copy of the checkpoint a resume picked, tried when the picked one fails its checks."""

    path: str
    config: LoadConfig
    why: str  # logged when it is tried: which copy, and why
    prepare: Callable[[Any], None] | None = None  # collective over the group, before the load (a repair)


class TierPicked(NamedTuple):
    """What a tier restore picked: the checkpoint to load, its load config, the other copies to try, and the newer
    checkpoints it passed over because the signature policy refused them (names, newest first)."""

    path: str
    config: LoadConfig
    fallbacks: list[Fallback]
    signature_skipped: tuple[str, ...] = ()


class TierRestore(Protocol):
    """Which copy a resume reads when the run has tiers (policies/tiers/checkpoint_tiers.py `CheckpointTiers`).
    Each is collective over `group` (every rank, the same answer)."""

    config: TiersConfig  # where each tier lives (a drill's warning names them)

    def pick(self, which: str | int, base: LoadConfig, group: Any) -> TierPicked | None:
        """(checkpoint path, its load config, the other copies to try, what the signature policy made it pass over)
        for `latest`, `last-good`, a step, an id or a directory name, on either tier; None: neither tier holds it.
        A copy `base`'s signature policy refuses is no candidate."""
        ...

    def last_good(self, base: LoadConfig, group: Any) -> tuple[str, LoadConfig] | None: ...

    def tier_of(self, checkpoint_path: str) -> str:
        """The words a resume line uses for where `checkpoint_path` was read ("fast tier", "durable tier")."""
        ...


@dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    """The checkpoint root of this process and how to save to and load from it."""

    root: str  # this node's checkpoint root: `ckpt_path="latest"`, step numbers and ids are looked up here
    save: SaveConfig = field(default_factory=SaveConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    resume_required: bool = False  # ckpt_path="latest" with nothing committed: fail instead of starting fresh
    fallback_to_last_good: bool = False  # "latest" that fails to load resumes from the last known-good instead
    tier_restore: TierRestore | None = None  # with tiers: every selector considers every tier

    @cached_property
    def location(self) -> fsio.Location:
        """The root, resolved (filesystem and path) with the save's storage options: the one object for it."""
        return fsio.resolve(self.root, self.save.storage_options)

    def owns(self, checkpoint_path: str) -> bool:
        """`checkpoint_path` is a checkpoint directory directly under this root."""
        parent = fsio.resolve(checkpoint_path.rstrip("/").rsplit("/", 1)[0], self.save.storage_options)
        return parent.same_place(self.location)
