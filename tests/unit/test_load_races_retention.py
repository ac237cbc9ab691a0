"""A load that races another job's retention on the same root: reported as deleted, `latest` re-resolves once (issue 9, item 7).

The other job is real: a second saver of the same run commits a newer checkpoint and applies
keep_last=1, which really deletes the files the load is reading. Only the moment is arranged: right
after the load read DCP's `.metadata` (so the shard files vanish under it), or right after it listed.
"""

from __future__ import annotations

import pytest
import torch

from lightning_shardckpt import load_checkpoint
from lightning_shardckpt.engine import catalog, commit_index
from lightning_shardckpt.engine.format.names import parse_dirname
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.engine.storage.writer import ShardReader
from lightning_shardckpt.errors import CheckpointDeleted
from lightning_shardckpt.policies import retention
from tests.helpers.checkpoints import dirname_of
from tests.unit.test_retention_lineage import RUN, save, state


def other_job_commits_and_retains(root: str, step: int) -> None:
    manifest = save(root, step)
    retention.apply(resolve(root), 1, None, run_id=RUN, just_committed=dirname_of(manifest))


@pytest.fixture
def retention_after_metadata_read(monkeypatch):
    """On the first `.metadata` read of a load, the other job commits step 4 and deletes the rest."""
    real = ShardReader.read_metadata
    fired: list[str] = []

    def read_then_race(self, *args, **kwargs):
        metadata = real(self, *args, **kwargs)
        if not fired:
            fired.append(self.path)
            other_job_commits_and_retains(self.path.rsplit("/", 1)[0], 4)
        return metadata

    monkeypatch.setattr(ShardReader, "read_metadata", read_then_race)
    return fired


def test_latest_deleted_mid_load_re_resolves_to_the_new_latest(tmp_path, retention_after_metadata_read):
    root = str(tmp_path / "run")
    for step in (1, 2, 3):
        save(root, step)
    target = state(0)
    result = load_checkpoint(target, root, "latest")
    assert retention_after_metadata_read and parse_dirname(retention_after_metadata_read[0]).step == 3
    assert result.step == 4 and torch.equal(target["weights"], torch.full((32,), 4.0))


def test_an_explicit_checkpoint_deleted_mid_load_is_reported_deleted_not_corrupt(
    tmp_path, retention_after_metadata_read
):
    root = str(tmp_path / "run")
    for step in (1, 2, 3):
        save(root, step)
    with pytest.raises(CheckpointDeleted, match="was deleted while it was being loaded") as err:
        load_checkpoint(state(0), root, 2)
    assert "replica" not in str(err.value) and "corrupt" in str(err.value)  # "nothing is corrupt"


def test_latest_deleted_between_listing_and_opening_re_resolves(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    for step in (1, 2, 3):
        save(root, step)
    real_listing, real_index = catalog.list_checkpoints, commit_index.newest_of_run_by_index
    calls: list[int] = []

    def race_after(resolve):
        # the other job commits and retains right after `latest` was first resolved, by the commit index or a listing
        def resolved_then_race(*args):
            found = resolve(*args)
            calls.append(1)
            if len(calls) == 1:
                other_job_commits_and_retains(root, 4)
            return found

        return resolved_then_race

    monkeypatch.setattr(catalog, "list_checkpoints", race_after(real_listing))
    monkeypatch.setattr(commit_index, "newest_of_run_by_index", race_after(real_index))
    target = state(0)
    assert load_checkpoint(target, root, "latest").step == 4
    assert int(target["weights"][0]) == 4
