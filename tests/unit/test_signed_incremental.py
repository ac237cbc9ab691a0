"""Signed incremental saves (issue 39 item 3): an incremental checkpoint's manifest carries the digest of every file
it references, taken from the manifest that wrote it as this process committed it, so its own signature covers
the bytes it borrows. A referenced file changed afterwards is refused by load and verify of every checkpoint that
references it, even where no checksum can see the change and even when the holder's manifest was rewritten to
match before the next save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, LoadConfig, SaveConfig, SignatureRefused, load_checkpoint
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.config import SignConfig
from lightning_shardckpt.engine.format import references as refs
from lightning_shardckpt.engine.format.listed_digests import DIGEST
from lightning_shardckpt.engine.format.signing import DIGEST_FIELD, digest_of
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.ops.verify import SIGNATURE_PROBLEM, verify_checkpoint
from tests.helpers.checkpoints import fresh_state
from tests.helpers.forgery import forge_manifest, replace_file
from tests.unit.test_incremental import Lora, assert_equal, train_and_save, zeros
from tests.unit.test_signing import make_key


def signed_saves(root: Path, private: str, saves: int, between=None) -> tuple[dict, list]:
    """`saves` signed incremental saves of a LoRA-style model (a frozen base, trainable adapters)."""
    model = Lora(256, rank=16)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    # format_version=2: the collective path's v3, whose manifest lists each referenced file's digest (the parts
    # format's signed incremental checkpoints, each chunk's digest in its part: test_incremental_parts.py)
    config = SaveConfig(
        incremental=True, run_id="inc", sign=SignConfig(key_path=private), write_events=False, format_version=2
    )
    return train_and_save(CheckpointSaver(str(root), config), range(saves), model, optimizer, between)


def manifest_of(result) -> dict:
    return json.loads(Path(result.path, "manifest.json").read_bytes())


def load_step(root: Path, step: int, public: str | None, like: dict) -> dict:
    state = zeros(like)
    options = {"require_signature": True, "public_keys": [public]} if public else {}
    load_checkpoint(state, str(root), step, config=LoadConfig(**options))
    return state


def append_to(path: Path, data: bytes) -> None:
    """After every chunk of the file: no xxh3 checksum covers these bytes, the file's digest does."""
    replace_file(str(path), path.read_bytes() + data)


def test_signed_incremental_checkpoints_record_every_own_and_referenced_digest_and_load_with_the_policy(tmp_path):
    private, public, _ = make_key(tmp_path, "writer")
    root = tmp_path / "root"
    snapshots, results = signed_saves(root, private, 3)
    base = manifest_of(results[0])
    for result in results[1:]:
        manifest = manifest_of(result)
        assert manifest["format_version"] == 3 and manifest[DIGEST_FIELD] == "blake3"
        assert manifest[refs.REFERENCES_FIELD], "the frozen base is referenced, not written again"
        for item in manifest["files"]:
            assert item[DIGEST] == digest_of(Path(result.path, item["path"]).read_bytes(), "blake3")
        holder = {f"../{Path(results[0].path).name}/{item['path']}": item[DIGEST] for item in base["files"]}
        for item in manifest[refs.REFERENCES_FIELD]:
            assert item[DIGEST] == holder[item["path"]]  # carried from the manifest that wrote the file
    for step in range(3):
        assert_equal(load_step(root, step, public, snapshots[step]), snapshots[step])
        assert verify_checkpoint(str(root), step, public_keys=[public]).ok


def test_a_referenced_file_changed_after_the_fact_is_refused_through_the_referencing_manifest(tmp_path):
    private, public, _ = make_key(tmp_path, "writer")
    root = tmp_path / "root"
    snapshots, results = signed_saves(root, private, 2)
    holder = Path(results[0].path, "__0_0.distcp")
    append_to(holder, b"appended by someone without the key")

    assert_equal(load_step(root, 1, None, snapshots[1]), snapshots[1])  # no checksum sees it: without a policy it loads
    with pytest.raises(SignatureRefused, match=r"__0_0\.distcp: this referenced file's blake3 digest differs"):
        load_step(root, 1, public, snapshots[1])
    report = verify_checkpoint(str(root), 1, public_keys=[public])
    assert [problem["kind"] for problem in report.problems] == [SIGNATURE_PROBLEM]


def test_the_digest_carried_is_the_one_committed_not_what_storage_says_at_the_next_save(tmp_path):
    """Between two saves someone changes the base's file and rewrites the base's manifest to match (its signature
    breaks, but nothing reads it then): the next incremental save still records the digest it committed."""
    private, public, _ = make_key(tmp_path, "writer")
    root = tmp_path / "root"

    def forge_base(step: int, result) -> None:
        if step != 0:
            return
        append_to(Path(result.path, "__0_0.distcp"), b"forged")

        def vouch_for_the_forgery(manifest: dict) -> None:  # and the commit record for the manifest: all but the key
            for item in manifest["files"]:
                item[DIGEST] = digest_of(Path(result.path, item["path"]).read_bytes(), "blake3")

        forge_manifest(result.path, vouch_for_the_forgery)

    snapshots, results = signed_saves(root, private, 2, between=forge_base)
    assert refs.REFERENCES_FIELD in manifest_of(results[1])
    with pytest.raises(SignatureRefused, match="referenced file's blake3 digest differs"):
        load_step(root, 1, public, snapshots[1])
    entries = {entry.step: entry for entry in catalog.list_checkpoints(fsio.resolve(str(root)))}
    assert entries[0].committed  # the forged base is refused by its own signature too (its manifest changed)
    with pytest.raises(SignatureRefused, match="does not verify"):
        load_step(root, 0, public, snapshots[0])


def test_a_signed_format_v2_save_lists_its_files_digests_and_a_changed_file_is_refused(tmp_path):
    """The collective path's full saves (format_version=2, and an incremental run's full ones) are signed whole too."""
    private, public, _ = make_key(tmp_path, "writer")
    root = str(tmp_path / "root")
    config = SaveConfig(format_version=2, async_save=False, write_events=False, sign=SignConfig(key_path=private))
    saver = CheckpointSaver(root, config)
    try:
        result = saver.save(fresh_state(seed=1), step=1).result(timeout=60)
    finally:
        saver.close()
    assert result.committed, result.error
    manifest = manifest_of(result)
    assert manifest["format_version"] == 2 and all(len(item[DIGEST]) == 64 for item in manifest["files"])
    policy = LoadConfig(require_signature=True, public_keys=[public])
    load_checkpoint(fresh_state(seed=9), root, 1, config=policy)
    append_to(Path(result.path, "__0_0.distcp"), b"x")
    with pytest.raises(SignatureRefused, match=r"__0_0\.distcp: this file's blake3 digest differs"):
        load_checkpoint(fresh_state(seed=9), root, 1, config=policy)
