"""The commit point (commit.publish): record, manifest by create-if-absent, `latest`; a committed directory stays as committed."""

from __future__ import annotations

import json

import pytest

from lightning_shardckpt.engine.format import manifest as manifest_format
from lightning_shardckpt.engine.format.names import COMMIT_RECORD, LATEST, MANIFEST, checkpoint_dirname, join
from lightning_shardckpt.engine.save.commit import publish
from lightning_shardckpt.engine.storage import fsio


def _files(root, name: str) -> dict[str, bytes]:
    return {file: root.fs.cat_file(join(root.path, name, file)) for file in (COMMIT_RECORD, MANIFEST)}


def test_committing_an_already_committed_directory_is_refused_before_its_commit_record_changes(tmp_path):
    root = fsio.resolve(str(tmp_path))
    name = checkpoint_dirname(1, "aaaaaaaaaaaa")
    fsio.makedirs(root.fs, join(root.path, name))
    publish(root.fs, root.path, name, {"step": 1, "checkpoint_id": "aaaaaaaaaaaa", "files": [], "writer": "first"})
    committed = _files(root, name)
    assert root.fs.cat_file(join(root.path, LATEST)).decode().strip() == name

    with pytest.raises(FileExistsError, match=f"{name} is already committed"):
        publish(root.fs, root.path, name, {"step": 1, "checkpoint_id": "aaaaaaaaaaaa", "files": [], "writer": "second"})

    after = _files(root, name)
    assert after == committed and json.loads(after[MANIFEST])["writer"] == "first"
    # the record still names the manifest that is there: readers do not see an edited checkpoint
    manifest_format.check_matches_record(after[MANIFEST], json.loads(after[COMMIT_RECORD]), name)
