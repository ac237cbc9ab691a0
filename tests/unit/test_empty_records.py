"""A chunk holding no element has no record (FORMAT.md §10.1): the writer writes nothing for it, every reader
(resume, a plain DCP load, verify, export) does without it, and a checkpoint of an older writer, whose parts hold
such records, still verifies and loads."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from lightning_shardckpt import CheckpointSaver, SaveConfig, load_checkpoint
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format import chunk_layout
from lightning_shardckpt.engine.load.global_tensors import GlobalTensorReader
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.ops.verify import verify_checkpoint


def _save(root: Path) -> dict:
    state = {"empty": torch.zeros(0, 4), "w": torch.arange(6.0).reshape(3, 2), "note": {"epoch": 3}}
    saver = CheckpointSaver(str(root), SaveConfig(async_save=False, write_events=False))
    result = saver.save(state, step=1).result(timeout=60)
    saver.close()
    assert result.committed, result.error
    [entry] = catalog.list_checkpoints(resolve(str(root)))
    return json.loads((Path(entry.path) / "__0_0.part.json").read_bytes())


def _loads_everywhere(root: Path) -> None:
    target = {"empty": torch.ones(0, 4), "w": torch.zeros(3, 2), "note": {"epoch": 0}}
    load_checkpoint(target, str(root))
    assert torch.equal(target["w"], torch.arange(6.0).reshape(3, 2)) and target["note"] == {"epoch": 3}
    assert target["empty"].shape == (0, 4)
    [entry] = catalog.list_checkpoints(resolve(str(root)))
    plain = {"empty": torch.ones(0, 4), "w": torch.zeros(3, 2), "note": {"epoch": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(plain, checkpoint_id=entry.path, no_dist=True)  # DCP's own reader, from .metadata
    assert torch.equal(plain["w"], target["w"]) and plain["note"] == {"epoch": 3}
    location = resolve(str(root))
    with GlobalTensorReader(location, catalog.find(location)) as reader:  # what export and compare read through
        assert reader.read("empty").shape == (0, 4) and torch.equal(reader.read("w"), target["w"])
    report = verify_checkpoint(str(root))
    assert report.ok, report.problems


def test_a_tensor_chunk_of_no_element_gets_no_record_and_every_reader_does_without_it(tmp_path):
    part = _save(tmp_path / "ckpt")
    assert sorted(chunk["fqn"] for chunk in part["chunks"]) == ["w"]  # none for `empty`
    _loads_everywhere(tmp_path / "ckpt")


def test_a_checkpoint_whose_parts_hold_records_of_no_element_still_verifies_and_loads(tmp_path, monkeypatch):
    """Writers before issue 46 wrote a record for every cell, empty ones included: readers accept it."""
    with monkeypatch.context() as older:  # the older writer's rule: every cell is a record
        older.setattr(chunk_layout, "holds_elements", lambda sizes: True)
        part = _save(tmp_path / "ckpt")
    assert sorted(chunk["fqn"] for chunk in part["chunks"]) == ["empty", "w"]
    _loads_everywhere(tmp_path / "ckpt")


def test_the_layout_vectors_empty_cells_are_the_ones_no_rank_records():
    """FORMAT.md §11's 4 x 2 mesh: ranks 6 and 7 hold the empty piece's cells, which have no record."""
    from tests.unit.test_format_vectors import vectors

    lines = [json.loads(line) for line in vectors()["layout cells"].splitlines()]
    mesh = next(case for case in lines if case["shape"] == [5, 3])
    layout = chunk_layout.from_json(mesh["layout"])
    stored = [c.rank for c in chunk_layout.stored_cells(layout, mesh["shape"])]
    assert stored == [0, 1, 2, 3, 4, 5]
    assert chunk_layout.stored_ranks_within(layout, mesh["shape"], 3, 8) == [3, 4, 5]
