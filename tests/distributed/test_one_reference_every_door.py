"""The doors that need ranks read every spelling of a checkpoint as the one interpreter does (engine/root.py):
`fabric.load(spelling, state)` and `trainer.fit(ckpt_path=spelling)` resume the checkpoint `resolve_checkpoint`
names, or raise the same CheckpointNotFound naming the path. The other entry points' table:
tests/unit/test_one_reference_interpreter.py. One gloo rank: the doors' reference path, not the collectives.

The Trainer saves steps 2 and 4; step 2 is drilled (the last known-good). Fabric is given neither file that is no
checkpoint: a plain file goes to Fabric's own torch loading on purpose (a converted `lit_model.pth`)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_shardckpt import CheckpointNotFound, ShardedFabricStrategy, resolve_checkpoint
from lightning_shardckpt.engine.format import drill_records
from lightning_shardckpt.engine.format.names import MANIFEST
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.fabric_ranks import TrainerShaped
from tests.helpers.lightning_run import fit_on_rank, lightning_env
from tests.helpers.spawn import run_ranks, values

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NOT_FOUND = "not found"
FILES = ("stray file in the root", "file inside a checkpoint")  # no checkpoint: one error, naming the path


def spellings(root: str, good: str, good_id: str) -> dict[str, str]:
    """label -> spelling of a checkpoint of `root` (step 2 is `good`)."""
    return {
        "latest": "latest",
        "last-good": "last-good",
        "step text": "2",
        "step word": "step-2",
        "id": good_id,
        "directory name": good,
        "root": root,
        "ROOT/latest": f"{root}/latest",
        "ROOT/last-good": f"{root}/last-good",
        "checkpoint directory": f"{root}/{good}",
        "stray file in the root": f"{root}/notes.txt",
        "file inside a checkpoint": f"{root}/{good}/{MANIFEST}",
    }


def _answer(call) -> int | str:
    try:
        return call()
    except CheckpointNotFound as err:
        return f"{NOT_FOUND}: {err}"


def _fabric_answers(rank: int, root: str, named: dict[str, str]) -> dict[str, int | str]:
    lightning_env(rank, 1)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=ShardedFabricStrategy(parallelism="ddp", root=root))
    fabric.launch()
    model = fabric.setup_module(TrainerShaped(seed=99))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1.0))

    def load(spelling: str) -> int:
        fabric.load(spelling, {"model": model, "optimizer": optimizer}, strict=False)
        return fabric.strategy.last_load.step

    return {label: _answer(lambda s=spelling: load(s)) for label, spelling in named.items() if label not in FILES}


def _trainer_answers(rank: int, workdir: str, trained: str) -> dict[str, int | str]:
    """Each spelling resumed by a fresh Trainer whose ShardedCheckpoint root is a copy of the trained one (a
    selector names a checkpoint of the callback's root; the resume saves on into the copy)."""
    out = {}
    for index, label in enumerate(spellings(trained, "", "")):
        copy = f"{workdir}/copy-{index}"
        shutil.copytree(trained, copy)
        spelling = _spelled(copy)[label]
        out[label] = _answer(lambda c=copy, s=spelling: fit_on_rank(rank, 1, c, "ddp", 5, s, {"every": 2})["at_start"])
        if isinstance(out[label], dict):
            out[label] = out[label]["global_step"]
    return out


def _spelled(root: str) -> dict[str, str]:
    good = resolve_checkpoint(root, 2)
    return spellings(root, good.name, good.checkpoint_id)


def every_door(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    trained = f"{workdir}/trained"
    fit_on_rank(rank, world_size, trained, "ddp", 4, None, {"every": 2})  # commits steps 2 and 4
    good = resolve_checkpoint(trained, 2).name
    record = {"checkpoint": good, "drill_id": drill_records.new_drill_id(), "verdict": drill_records.PASSED}
    drill_records.write_record(fsio.resolve(trained), {**record, "cause": None})
    with open(os.path.join(trained, "notes.txt"), "w") as handle:
        handle.write("a stray file beside the checkpoints\n")
    named = _spelled(trained)
    resolved = {
        label: _answer(lambda s=spelling: resolve_checkpoint(trained, s).step) for label, spelling in named.items()
    }
    return {
        "named": named,
        "resolve_checkpoint": resolved,
        "fabric.load": _fabric_answers(rank, trained, named),
        "trainer.fit(ckpt_path=...)": _trainer_answers(rank, workdir, trained),
    }


def test_fabric_load_and_ckpt_path_read_every_spelling_as_resolve_checkpoint_does(tmp_path):
    (result,) = values(run_ranks(every_door, 1, str(tmp_path), timeout_s=540))
    expected = {
        "latest": 4,
        "last-good": 2,
        "step text": 2,
        "step word": 2,
        "id": 2,
        "directory name": 2,
        "root": 4,
        "ROOT/latest": 4,
        "ROOT/last-good": 2,
        "checkpoint directory": 2,
        "stray file in the root": NOT_FOUND,
        "file inside a checkpoint": NOT_FOUND,
    }
    for door in ("resolve_checkpoint", "fabric.load", "trainer.fit(ckpt_path=...)"):
        for label, answered in result[door].items():
            if expected[label] == NOT_FOUND:
                assert str(answered).startswith(NOT_FOUND), (door, label, answered)
                assert os.path.basename(result["named"][label]) in str(answered), (door, label, answered)
            else:
                assert answered == expected[label], (door, label, answered)
    assert set(result["trainer.fit(ckpt_path=...)"]) == set(expected)
    assert set(result["fabric.load"]) == set(expected) - set(FILES)
