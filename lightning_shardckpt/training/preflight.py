"""Checks every door runs before training, before anything of a checkpoint is written to the root.

- `preflight_on_every_rank`: every rank writes its own shards, so each checks the root; all raise the first problem.
- `refuse_unloadable_saves`: a save configuration whose checkpoints no reader could load (a manifest that lists
  every chunk and outgrows the readers' bound: engine/save/metadata_budget.py) is refused at the door's start, not
  at the first save hours later. The save loop calls it at set-up with the world size alone (`format_version=2`
  past the world size whose per-rank entries alone pass the bound) and at start with the state it will save; the
  resume sequence calls it with the state it loads into (training/resume_sequence.py), which for the Fabric and
  plain-loop doors comes before the first training step. The saver checks again at every save: optimizer state
  may appear after the start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..engine.collectives import all_gather_objects
from ..engine.config import SaveConfig
from ..engine.save import metadata_budget
from ..engine.storage import fsio
from ..errors import StorageUnavailable


def preflight_on_every_rank(location: fsio.Location) -> None:
    try:
        fsio.preflight(location)
        problem = None
    except StorageUnavailable as err:
        problem = str(err)
    problems = all_gather_objects("storage-preflight", problem, None)  # no rank may go on alone
    first = next((p for p in problems if p), None)
    if first is not None:
        raise StorageUnavailable(first)


def refuse_unloadable_saves(config: SaveConfig, world_size: int, state: Callable[[], Mapping[str, Any]] = dict) -> None:
    """ConfigError (metadata_budget.refuse_unloadable's: it names the option that fixes it) when saves under
    `config` of `state()` (what the door will save, as far as it exists now; nested dicts of tensors) by
    `world_size` ranks would write a manifest no reader loads. `state` is built only for a configuration whose
    manifest lists every chunk (format_version=2, signed incremental on v4). No collective: every rank sees the
    same world size and global shapes, so every rank raises alike."""
    if metadata_budget.writes_every_chunk(config):
        metadata_budget.refuse_unloadable(config, world_size, metadata_budget.tensors_of(dict(state())))
