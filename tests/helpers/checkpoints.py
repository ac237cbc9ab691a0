"""Small committed checkpoints made in this process (no torch.distributed), for unit tests."""

from __future__ import annotations

import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig

SHARD = "__0_0.distcp"  # the only shard file a single-process save writes
RUN_ID = "unit-test-run"  # every helper save is one run: a root saved into twice is not refused as shared


def fresh_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))
    return {"model": model.state_dict(), "progress": {"global_step": 3}}


def save_checkpoint(root: str, step: int = 3, state: dict | None = None) -> dict:
    """Commit one checkpoint of `state` (default: a fresh small model) under `root`; return its manifest."""
    saver = CheckpointSaver(root, SaveConfig(async_save=False, write_events=False, run_id=RUN_ID))
    try:
        result = saver.save(fresh_state(seed=step) if state is None else state, step=step).result(timeout=60)
    finally:
        saver.close()
    assert result.committed, result.error
    return result.manifest


def chunk_of(manifest: dict, fqn: str) -> dict:
    """The (first) chunk of tensor `fqn` as the manifest lists it: file, offset, length, checksum."""
    return next(t for t in manifest["tensors"] if t["fqn"] == fqn)["chunks"][0]
