"""Small committed checkpoints made in this process (no torch.distributed), for unit tests."""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine.format.chunk_index import ChunkIndex
from lightning_shardckpt.engine.format.names import checkpoint_dirname, join, parse_dirname
from lightning_shardckpt.engine.storage import fsio

SHARD = "__0_0.distcp"  # the only shard file a single-process save writes
PART = "__0_0.part.json"  # its part (format v4): the record of its chunks
RUN_ID = "unit-test-run"  # every helper save is one run: a root saved into twice is not refused as shared


def fresh_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))
    return {"model": model.state_dict(), "progress": {"global_step": 3}}


def save_checkpoint(root: str, step: int = 3, state: dict | None = None, format_version: int = 4) -> dict:
    """Commit one checkpoint of `state` (default: a fresh small model) under `root` in `format_version` (4: the
    writer's default; 2: every chunk in the manifest, as before format v4); return its manifest in the v2 shape
    (a v4 manifest with each tensor's chunks and the files read from its parts: tests find bytes by it)."""
    config = SaveConfig(async_save=False, write_events=False, run_id=RUN_ID, format_version=format_version)
    saver = CheckpointSaver(root, config)
    try:
        result = saver.save(fresh_state(seed=step) if state is None else state, step=step).result(timeout=60)
    finally:
        saver.close()
    assert result.committed, result.error
    location = fsio.resolve(root)
    return ChunkIndex(location.fs, join(location.path, dirname_of(result.manifest)), result.manifest).expanded()


class Committed(NamedTuple):
    """A checkpoint committed by `commit_checkpoint`: its root, its own directory, its manifest
    (a tuple, so `root, directory, manifest = committed_checkpoint()` reads well)."""

    root: str
    directory: str
    manifest: dict


def commit_checkpoint(root: str, step: int = 3, state: dict | None = None, format_version: int = 4) -> Committed:
    """Commit one checkpoint of `state` (default: a fresh small model) under the local `root`."""
    manifest = save_checkpoint(root, step=step, state=state, format_version=format_version)
    return Committed(root, os.path.join(root, dirname_of(manifest)), manifest)


def dirname_of(manifest: dict) -> str:
    """The directory name of the checkpoint `manifest` describes, as the layout module names it."""
    return checkpoint_dirname(manifest["step"], manifest["id"])


def dirnames_at_step(names: list[str], step: int) -> list[str]:
    """The checkpoint directory names among `names` (base names or paths) that hold `step`, sorted."""
    return sorted(name for name in names if (parsed := parse_dirname(name)) is not None and parsed.step == step)


ANY_ID = "0123456789ab"  # stands for any checkpoint id in dirname_regex


def dirname_regex(step: int) -> str:
    """A regular expression matching the directory name of any checkpoint of `step` (in a path or URL)."""
    return re.escape(checkpoint_dirname(step, ANY_ID)).replace(ANY_ID, "[0-9a-f]+")


def chunk_of(manifest: dict, fqn: str, directory: str | None = None) -> dict:
    """The (first) chunk of tensor `fqn`: file, offset, length, checksum. A format-v4 manifest as committed lists
    no chunk: give the checkpoint's `directory`, whose parts do (a manifest in the v2 shape needs none)."""
    tensor = next(t for t in manifest["tensors"] if t["fqn"] == fqn)
    if "chunks" in tensor:
        return tensor["chunks"][0]
    location = fsio.resolve(directory)
    return ChunkIndex(location.fs, location.path, manifest).tensor_chunks(fqn)[0]
