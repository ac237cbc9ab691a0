"""Incremental saves on the flat format (FORMAT.md §10.6), in one process: a restarted job's fresh saver writes its
first save full, saying why, and the chain continues from it (lineage and references); a part's reference that
escapes the root, names no shard file, or is not listed by the manifest makes the checkpoint corrupt; and the
manifest's `references` (directories and holder-rank ranges) is what retention pins. Real saves, real files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, LoadConfig, SaveConfig, load_checkpoint
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format import manifest as manifest_format
from lightning_shardckpt.engine.format import references as refs
from lightning_shardckpt.engine.format.chunk_index import ChunkIndex
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.errors import CorruptCheckpoint
from tests.helpers.forgery import forge_manifest, forge_part
from tests.unit.test_incremental import Lora, assert_equal, train_and_save, zeros


def saves(root: Path, steps: range, model: Lora, optimizer) -> tuple[dict, list]:
    """One fresh saver (as a job that starts or restarts) saving `steps` incrementally: (snapshots, results)."""
    saver = CheckpointSaver(str(root), SaveConfig(incremental=True, run_id="inc", write_events=False))
    return train_and_save(saver, steps, model, optimizer)


def manifest_of(result) -> dict:
    return json.loads(Path(result.path, "manifest.json").read_bytes())


def test_a_restarted_saver_writes_its_first_save_full_saying_why_and_the_chain_continues_from_it(tmp_path, caplog):
    model = Lora(256, rank=16)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    _, before = saves(tmp_path, range(2), model, optimizer)  # the job before the restart: full, incremental
    assert "references" in manifest_of(before[1])
    with caplog.at_level(logging.INFO, logger="lightning_shardckpt.engine.save.saver"):
        snapshots, after = saves(tmp_path, range(2, 4), model, optimizer)  # the restarted job: a fresh saver
    why = [r.getMessage() for r in caplog.records if "incremental: step 2 is a full save" in r.getMessage()]
    assert why and "cannot prove a tensor unchanged" in why[0], [r.getMessage() for r in caplog.records]
    restarted, then = manifest_of(after[0]), manifest_of(after[1])
    assert "references" not in restarted  # nothing known unchanged after a restart: nothing referenced
    assert restarted["parent"] == before[1].checkpoint_id and restarted["seq"] == manifest_of(before[1])["seq"] + 1
    # the chain continues from the restarted save: it references only what this saver wrote and proved unchanged
    assert [item["dir"] for item in then["references"]] == [Path(after[0].path).name]
    assert not any("incremental: step 3 is a full save" in r.getMessage() for r in caplog.records)
    for step, result in zip((2, 3), after):
        target = zeros(snapshots[step])
        load_checkpoint(target, result.path)
        assert_equal(target, snapshots[step])


def incremental_pair(tmp_path: Path) -> list:
    model = Lora(256, rank=16)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    return saves(tmp_path, range(2), model, optimizer)[1]


def _chunks(result) -> list[dict]:
    location = fsio.resolve(str(Path(result.path).parent))
    return list(ChunkIndex(location.fs, result.path, manifest_of(result)).all_chunks())


@pytest.mark.parametrize(
    "path",
    [
        "../../elsewhere/__0_0.distcp",  # escapes the root
        "../step-000000000-aaaaaaaaaaaa/../step-000000001-bbbbbbbbbbbb/__0_0.distcp",  # a chain
        "../not-a-checkpoint/__0_0.distcp",
        "../step-000000000-aaaaaaaaaaaa/manifest.json",  # no shard file
        "/etc/passwd",
    ],
)
def test_a_part_whose_reference_escapes_or_names_no_shard_file_makes_the_checkpoint_corrupt(tmp_path, path):
    _, incremental = incremental_pair(tmp_path)

    def redirect(part: dict) -> None:
        part["holders"][0]["file"] = path  # the part's one holder file (FORMAT.md §10.6)

    forge_part(incremental.path, 0, redirect)
    with pytest.raises(CorruptCheckpoint, match="file"):
        _chunks(incremental)


def test_a_part_reference_the_manifest_does_not_list_makes_the_checkpoint_corrupt(tmp_path):
    _, incremental = incremental_pair(tmp_path)

    def unlist(manifest: dict) -> None:
        manifest["references"][0]["ranks"] = [[5, 5]]  # no longer rank 0's file

    forge_manifest(incremental.path, unlist)
    with pytest.raises(CorruptCheckpoint, match="a file the manifest's references do not list"):
        _chunks(incremental)


def test_the_manifest_lists_referenced_files_by_directory_and_rank_ranges_and_retention_pins_them(tmp_path):
    full, incremental = incremental_pair(tmp_path)
    manifest = manifest_of(incremental)
    assert manifest["references"] == [
        {
            "dir": Path(full.path).name,
            "ranks": [[0, 0]],
            "bytes": manifest_format.referenced_bytes(manifest),
            "chunks": manifest["references"][0]["chunks"],
        }
    ]
    referenced = [chunk for _, chunk in _chunks(incremental) if refs.is_reference(chunk["file"])]
    assert manifest["references"][0]["chunks"] == len(referenced) > 0
    assert manifest["references"][0]["bytes"] == sum(chunk["length"] for chunk in referenced)
    location = fsio.resolve(str(tmp_path))
    pinned = refs.pinned_files(location, catalog.list_checkpoints(location))
    assert pinned == {Path(full.path).name: {"__0_0.distcp"}}


def test_references_tables_merge_into_sorted_disjoint_ranges():
    from lightning_shardckpt.engine.format import part_references

    a = part_references.references_table([("step-000000001-aaaaaaaaaaaa", r, 10, 1) for r in (0, 1, 2, 5)])
    b = part_references.references_table([("step-000000001-aaaaaaaaaaaa", r, 10, 1) for r in (3, 7)])
    merged = part_references.merge_tables([a, b])
    assert merged == [
        {"dir": "step-000000001-aaaaaaaaaaaa", "ranks": [[0, 3], [5, 5], [7, 7]], "bytes": 60, "chunks": 6}
    ]
    assert part_references.table_problems({"step": 2, "id": "bbbbbbbbbbbb", "references": merged}) == []
    overlapping = [{**merged[0], "ranks": [[0, 3], [3, 4]]}]
    assert part_references.table_problems({"references": overlapping})


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_a_rank_whose_every_chunk_is_referenced_writes_an_empty_shard_file_and_its_checkpoint_loads(
    tmp_path, storage, request
):
    if storage == "s3":
        s3_root = request.getfixturevalue("s3_root")
        url, options = s3_root.url, s3_root.storage_options
    else:
        url, options = str(tmp_path), {}
    frozen = torch.arange(4096, dtype=torch.float32)  # the whole state: unchanged from the first save on
    config = SaveConfig(incremental=True, run_id="inc", write_events=False, storage_options=options)
    saver = CheckpointSaver(url, config)
    try:
        results = [saver.save({"w": frozen}, step).result(timeout=60) for step in range(2)]
    finally:
        saver.close()
    assert all(result.committed for result in results), [result.error for result in results]
    location = fsio.resolve(url, options)
    newest = catalog.list_checkpoints(location)[-1]
    manifest = catalog.read_manifest(location.fs, newest)
    assert manifest["references"][0]["chunks"] == 1 and manifest["parts"]["file_bytes"] == [0]
    assert location.fs.size(f"{newest.path}/__0_0.distcp") == 0
    target = {"w": torch.zeros(4096)}
    load_checkpoint(target, url, 1, config=LoadConfig(storage_options=options))
    assert torch.equal(target["w"], frozen)
