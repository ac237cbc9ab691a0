"""Incremental saves on the flat format (FORMAT.md §10.6), on real gloo ranks in groups of 2: a chain (full, incr,
incr) of a model with a frozen base is written as v5 whose parts reference the unchanged chunks (no collective path,
no chunk in the manifest: it lists only which sibling shard files are read); the last checkpoint resumes bit-exact
on another world size; retention keeps exactly the referenced shard files of a retired base; and a signed chain
resumes under require_signature while a forged referenced chunk (every checksum of its holder recomputed) is
refused, through the digest the referencing part copied when it was written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from lightning_shardckpt import CheckpointSaver, SaveConfig, SignConfig, load_checkpoint
from lightning_shardckpt.engine.catalog import list_checkpoints
from lightning_shardckpt.engine.config import LoadConfig
from lightning_shardckpt.engine.format import groups, signing
from lightning_shardckpt.engine.format.names import shard_filename
from lightning_shardckpt.engine.format.parts import parse as parse_part
from lightning_shardckpt.engine.format.parts import part_filename
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.errors import SignatureRefused
from lightning_shardckpt.ops import gc
from lightning_shardckpt.ops.verify import verify_checkpoint
from lightning_shardckpt.policies import retention
from tests.distributed.test_incremental_sharded import build, train
from tests.helpers import training_state as ts
from tests.helpers.forgery import forge_tensor_values
from tests.helpers.spawn import run_ranks
from tests.unit.test_signing import make_key

pytestmark = pytest.mark.slow

GROUP_SIZE = "2"  # 4 ranks make two groups: v5 (one group, unsigned, is written as v4)
FROZEN = "model.0.weight"  # the frozen base's largest tensor: referenced by every incremental save


def chain_worker(rank, world_size, root, key_path):
    os.environ[groups.GROUP_SIZE_ENV] = GROUP_SIZE  # this rank process only (a tests-only variable)
    model, optimizer = build("fsdp", seed=1, world_size=world_size)
    sign = SignConfig(key_path=key_path) if key_path else SignConfig()
    config = SaveConfig(incremental=True, parallelism="fsdp", run_id="inc", write_events=False, sign=sign)
    saver = CheckpointSaver(root, config)
    manifests = []
    for step in range(3):
        train(model, optimizer, seed=step)
        result = saver.save(ts.sharded_state(model, optimizer), step=step).result(timeout=60)
        assert result.committed, result.error
        manifests.append(result.manifest)
    saver.close()
    full = ts.full_state(model, optimizer)
    return {"full": full, "manifests": manifests} if rank == 0 else None


def load_worker(rank, world_size, root, step, public_key):
    model, optimizer = build("fsdp", seed=99, world_size=world_size)
    train(model, optimizer, seed=0)  # optimizer state exists to load into
    state = ts.sharded_state(model, optimizer)
    policy = {"require_signature": True, "public_keys": [public_key]} if public_key else {}
    try:
        result = load_checkpoint(state, root, step, config=LoadConfig(**policy))
    except SignatureRefused as err:
        return {"refused": str(err)}
    ts.apply_state(model, optimizer, state)
    return {"full": ts.full_state(model, optimizer), "step": result.step}


def _chain(directory: Path, key_path: str | None) -> tuple[str, dict]:
    root = str(directory / "root")
    saved = run_ranks(chain_worker, 4, root, key_path)[0].value
    return root, saved


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """An unsigned chain (full, incr, incr) saved on 4 ranks in groups of 2: (root, rank 0's outcome)."""
    return _chain(tmp_path_factory.mktemp("incremental-v5"), None)


@pytest.fixture(scope="module")
def signed_chain(tmp_path_factory):
    directory = tmp_path_factory.mktemp("incremental-v5-signed")
    private, public, _ = make_key(directory, "writer")
    root, saved = _chain(directory, private)
    return root, saved, public


def _dirs(root: str) -> dict[int, Path]:
    return {entry.step: Path(entry.path) for entry in list_checkpoints(resolve(root))}


def _assert_incremental_v5(directory: Path) -> None:
    """What the test is about: a v5 checkpoint whose parts reference (not DCP's v3 with a per-chunk manifest)."""
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["format_version"] == 5 and "references" in manifest and "files" not in manifest


def test_an_incremental_chain_is_v5_whose_parts_reference_the_unchanged_chunks_and_the_manifest_lists_no_chunk(chain):
    root, saved = chain
    full, *incremental = saved["manifests"]
    dirs = _dirs(root)
    assert full["format_version"] == 5 and "references" not in full
    for manifest in incremental:
        assert manifest["format_version"] == 5
        assert "files" not in manifest and all("chunks" not in tensor for tensor in manifest["tensors"])
        # only which sibling files are read: every rank's own file of the full save, one range, never a chain
        [entry] = manifest["references"]
        assert entry["dir"] == dirs[0].name and entry["ranks"] == [[0, 3]] and entry["bytes"] > 0
        # its size does not grow with what it references: within a few hundred bytes of the full save's
        assert abs(len(json.dumps(manifest)) - len(json.dumps(full))) < 400
    for rank in range(4):
        part = json.loads((dirs[2] / part_filename(rank)).read_text())
        [frozen] = [chunk for chunk in part["chunks"] if chunk["fqn"] == FROZEN]
        held = part["holders"][frozen["holder"]]  # each holder file once per part, its chunks point to it
        assert held["file"] == f"../{dirs[0].name}/{shard_filename(rank)}"  # the holder, not step 1 (no chain)
        assert held["file_bytes"] == len((dirs[0] / shard_filename(rank)).read_bytes())
    assert verify_checkpoint(root, 2).ok


@pytest.mark.parametrize("loaded_on", [3, 2])
def test_the_last_incremental_checkpoint_resumes_bit_exact_on_another_world_size(chain, loaded_on):
    root, saved = chain
    _assert_incremental_v5(_dirs(root)[2])
    loaded = run_ranks(load_worker, loaded_on, root, 2, None)
    assert loaded[0].value["step"] == 2
    ts.assert_bit_exact(saved["full"], loaded[0].value["full"])


def test_retention_keeps_the_referenced_shard_files_of_a_retired_base_and_removes_the_rest(chain, tmp_path):
    root = str(tmp_path / "root")
    shutil.copytree(chain[0], root)
    location = resolve(root)
    retention.apply(location, 1, None, just_committed=None, keep_last_drilled=0)
    dirs = {entry.step: entry for entry in list_checkpoints(location)}
    assert [step for step, entry in dirs.items() if entry.committed] == [2]
    _assert_incremental_v5(Path(dirs[2].path))
    assert 1 not in dirs  # step 1's files are referenced by nothing kept: gone
    left = sorted(path.name for path in Path(dirs[0].path).iterdir())
    # the base: its shard files (step 2 reads its frozen chunks there) and the retirement marker, nothing else
    assert left == sorted([*(shard_filename(rank) for rank in range(4)), "RETIRED"]), left
    assert gc.collect(location, 0, dry_run=False).to_remove == []  # gc keeps what is referenced
    assert verify_checkpoint(root, 2).ok
    loaded = run_ranks(load_worker, 3, root, 2, None)
    ts.assert_bit_exact(chain[1]["full"], loaded[0].value["full"])


def test_a_signed_incremental_chain_is_v5_and_resumes_under_require_signature(signed_chain):
    root, saved, public = signed_chain
    for manifest in saved["manifests"]:
        assert manifest["format_version"] == 5 and manifest[signing.DIGEST_FIELD] == "blake3"
    dirs = _dirs(root)
    holder = (dirs[0] / shard_filename(1)).read_bytes()
    part = parse_part((dirs[2] / part_filename(1)).read_bytes(), part_filename(1))  # digests from its column
    [frozen] = [chunk for chunk in part["chunks"] if chunk["fqn"] == FROZEN]
    piece = holder[frozen["offset"] : frozen["offset"] + frozen["length"]]
    assert frozen["digest"] == signing.digest_of(piece, "blake3")  # the referenced chunk's own digest, copied
    loaded = run_ranks(load_worker, 3, root, 2, public)
    assert all("refused" not in outcome.value for outcome in loaded), [o.value for o in loaded]
    ts.assert_bit_exact(saved["full"], loaded[0].value["full"])
    assert verify_checkpoint(root, 2, public_keys=[public]).ok


def test_a_forged_referenced_chunk_is_refused_by_the_signed_referencing_checkpoint(signed_chain, tmp_path):
    root = str(tmp_path / "root")
    shutil.copytree(signed_chain[0], root)
    public = signed_chain[2]
    dirs = _dirs(root)
    # the base's frozen chunk replaced, and every checksum and digest of the base recomputed: all but its signature
    forge_tensor_values(resolve(root), str(dirs[0]), FROZEN, 7.0)
    loaded = run_ranks(load_worker, 3, root, 2, public)
    refusals = [outcome.value.get("refused", "") for outcome in loaded]
    # the referencing part's copy of the chunk's digest refuses the forged bytes in the base's file
    named = [r for r in refusals if f"{dirs[0].name}/__" in r and "differs from the one its part records" in r]
    assert named, refusals
    report = verify_checkpoint(root, 2, public_keys=[public])
    assert not report.ok and dirs[0].name in report.problems[0]["actual"], report.problems
