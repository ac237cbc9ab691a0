"""Checkpoints Lightning itself wrote, as `fit(ckpt_path=...)` under ShardedStrategy meets them.

A run checkpointed by Lightning's own `ModelCheckpoint` (or `trainer.save_checkpoint` under another strategy)
left either a `.ckpt` file (torch.save's zip of Lightning's whole dict: DDP, single device) or a DCP directory
(ModelParallelStrategy: `.metadata`, the shards and Lightning's `meta.pt`). Neither is a checkpoint root of ours,
so the resume of every door (training/resume.py) would find nothing committed there. Such a run continues here:
the strategy hands the path to Lightning's own loader (the parent strategy's `load_checkpoint`: weights,
optimizers, and the dict Lightning's restore hooks take loops, global step and callbacks' state from), and the
next save goes to ShardedCheckpoint's root in this package's format, at the step the file left off.

Only a path that is one of these is Lightning's: a file that is not a torch.save zip (a typo'd or torn path)
and any checkpoint root of ours keep the one resume's answer.
"""

from __future__ import annotations

from typing import Any

from ...engine.format.safe_pickle import ZIP_MAGIC
from ...engine.storage import fsio

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a DCP directory
LIGHTNING_DCP_METADATA = "meta.pt"  # Lightning's pickled rest beside it (lightning.fabric.utilities.load)


def written_by_lightning(path: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether `path` is a checkpoint Lightning's own strategies wrote: a torch.save zip file, or a DCP directory
    holding Lightning's `meta.pt`. Reads at most 4 bytes; a path that does not exist is not one."""
    location = fsio.resolve(path, storage_options)
    fs = location.fs
    if fs.isfile(location.path):
        with fs.open(location.path, "rb") as file:
            return file.read(len(ZIP_MAGIC)) == ZIP_MAGIC
    if fs.isdir(location.path):
        inside = location.path.rstrip("/")
        return fs.isfile(f"{inside}/{DCP_METADATA}") and fs.isfile(f"{inside}/{LIGHTNING_DCP_METADATA}")
    return False
