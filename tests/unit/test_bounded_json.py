"""JSON read from storage is parsed within a size and a depth bound (issue 25, item 2).

One hostile file (a 6 KB `[[[...]]]` nested 3000 deep, or an oversized one) in one checkpoint directory,
the drill records, the event log or the owner marker is a problem of that one file: it is reported, named,
and every other checkpoint lists, verifies, resumes, and new commits go on. Real files on disk; nothing is
mocked.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

from lightning_shardckpt import (
    CheckpointSaver,
    ConfigError,
    CorruptCheckpoint,
    SaveConfig,
    load_checkpoint,
    read_events,
)
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format import bounded_json, drill_records
from lightning_shardckpt.engine.format.checksum import checksum
from lightning_shardckpt.engine.format.names import (
    COMMIT_RECORD,
    DRILLS_DIR,
    EVENTS_DIR,
    LATEST,
    MANIFEST,
    OWNER,
    checkpoint_dirname,
)
from lightning_shardckpt.engine.storage.fsio import resolve
from tests.helpers.checkpoints import RUN_ID, dirname_of, fresh_state, save_checkpoint

NESTED = b"[" * 3000 + b"]" * 3000  # 6 KB: deeper than the parser's recursion limit
NESTED_OBJECT = b'{"a":' * 3000 + b"1" + b"}" * 3000


def overwrite(path: str, data: bytes) -> None:
    os.chmod(path, 0o644)  # committed files are read-only
    with open(path, "wb") as handle:
        handle.write(data)


def assert_the_root_still_works(run_cli, root: str, bad_name: str, good_name: str, reason: str) -> None:
    """The listing names the bad checkpoint corrupt with a reason; ls, verify, timeline, gc, resume and a new
    commit all work around it."""
    entries = {e.name: e for e in catalog.list_checkpoints(resolve(root))}
    assert entries[bad_name].state == catalog.CORRUPT
    assert reason in entries[bad_name].problem and bad_name in entries[bad_name].problem
    assert entries[good_name].state == catalog.COMMITTED
    code, out, err = run_cli("ls", root, "--json")
    assert code == 0, err
    rows = {row["name"]: row for row in json.loads(out)["checkpoints"]}
    assert rows[bad_name]["state"] == "corrupt" and reason in rows[bad_name]["problem"]
    assert rows[good_name]["latest"]
    code, out, err = run_cli("verify", os.path.join(root, good_name))
    assert code == 0, err
    assert run_cli("verify", root)[0] == 0
    assert run_cli("timeline", root, "--json")[0] == 0
    assert run_cli("gc", root)[0] == 0
    code, _, err = run_cli("verify", os.path.join(root, bad_name))
    assert code == 2 and "Traceback" not in err and bad_name in err, err
    assert load_checkpoint(fresh_state(seed=0), root, "latest").path.endswith(good_name)
    new = save_checkpoint(root, step=7)  # a new commit lists the root (seq, latest) with the bad file present
    assert catalog.find(resolve(root), "latest").name == dirname_of(new)


@pytest.mark.parametrize("hostile", [NESTED, NESTED_OBJECT], ids=["nested-array", "nested-object"])
def test_a_deeply_nested_commit_record_makes_only_its_checkpoint_corrupt(tmp_path, run_cli, hostile):
    root = str(tmp_path / "run")
    good = dirname_of(save_checkpoint(root, step=1))
    bad = dirname_of(save_checkpoint(root, step=2))
    overwrite(os.path.join(root, bad, COMMIT_RECORD), hostile)
    assert_the_root_still_works(run_cli, root, bad, good, "nested deeper than")


def test_an_oversized_commit_record_makes_only_its_checkpoint_corrupt(tmp_path, run_cli):
    root = str(tmp_path / "run")
    good = dirname_of(save_checkpoint(root, step=1))
    bad = dirname_of(save_checkpoint(root, step=2))
    padded = b'{"pad": "' + b"x" * (bounded_json.SMALL_MAX_BYTES + 1) + b'"}'
    overwrite(os.path.join(root, bad, COMMIT_RECORD), padded)
    assert_the_root_still_works(run_cli, root, bad, good, "bytes")


def test_a_deeply_nested_manifest_without_a_commit_record_makes_only_its_checkpoint_corrupt(tmp_path, run_cli):
    """A v1 directory has no commit record: listing parses the manifest itself."""
    root = str(tmp_path / "run")
    good = dirname_of(save_checkpoint(root, step=1))
    bad = dirname_of(save_checkpoint(root, step=2))
    os.remove(os.path.join(root, bad, COMMIT_RECORD))
    overwrite(os.path.join(root, bad, MANIFEST), NESTED)
    assert_the_root_still_works(run_cli, root, bad, good, "nested deeper than")


def test_a_deeply_nested_manifest_behind_a_matching_commit_record_is_corrupt_when_opened(tmp_path):
    """The record's checksum matches the hostile manifest: listing trusts the record, opening it must not crash."""
    root = str(tmp_path / "run")
    good = dirname_of(save_checkpoint(root, step=1))
    bad = dirname_of(save_checkpoint(root, step=2))
    record_path = os.path.join(root, bad, COMMIT_RECORD)
    with open(record_path) as handle:
        record = json.load(handle)
    overwrite(os.path.join(root, bad, MANIFEST), NESTED)
    overwrite(record_path, json.dumps({**record, "manifest_checksum": checksum(NESTED)}).encode())
    location = resolve(root)
    assert catalog.find(location, "latest").name == good  # `latest` skips it, naming why in the log
    entries = {e.name: e for e in catalog.list_checkpoints(location)}
    with pytest.raises(CorruptCheckpoint, match="nested deeper than") as caught:
        catalog.find(location, 2)
    assert bad in str(caught.value)
    assert entries[good].committed


def test_a_hostile_drill_record_is_ignored_and_named(tmp_path, run_cli, caplog):
    root = str(tmp_path / "run")
    good = dirname_of(save_checkpoint(root, step=1))
    location = resolve(root)
    name = drill_records.RecordName(good, "20260101-000000-abcdef", drill_records.PASSED)
    os.makedirs(os.path.join(root, DRILLS_DIR), exist_ok=True)
    with open(os.path.join(root, DRILLS_DIR, name.filename), "wb") as handle:
        handle.write(NESTED)
    with caplog.at_level(logging.WARNING):
        assert drill_records.read_record(location, name) is None
    assert name.filename in caplog.text and "nested deeper than" in caplog.text
    code, out, err = run_cli("ls", root, "--json")
    assert code == 0, err


def test_a_hostile_event_file_is_skipped_and_named_and_the_other_events_read(tmp_path, run_cli, caplog):
    root = str(tmp_path / "run")
    saver = CheckpointSaver(root, SaveConfig(async_save=False, run_id=RUN_ID))
    saver.save(fresh_state(), step=1)
    saver.close()
    hostile = os.path.join(root, EVENTS_DIR, f"{checkpoint_dirname(2, 'abcdef012345')}-committed-000000.json")
    with open(hostile, "wb") as handle:
        handle.write(NESTED)
    with caplog.at_level(logging.WARNING):
        events = read_events(root)
    assert [event["step"] for event in events] == [1]
    assert os.path.basename(hostile) in caplog.text and "nested deeper than" in caplog.text
    code, _, err = run_cli("timeline", root, "--json")
    assert code == 0, err


def test_a_hostile_owner_marker_is_refused_naming_the_file_and_the_fix(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / OWNER).write_bytes(NESTED)
    with pytest.raises(ConfigError, match="nested deeper than") as caught:
        CheckpointSaver(str(root), SaveConfig(async_save=False, run_id=RUN_ID))
    assert OWNER in str(caught.value) and "Delete it" in str(caught.value)


def test_a_long_latest_pointer_is_ignored_and_latest_comes_from_the_listing(tmp_path):
    root = str(tmp_path / "run")
    good = dirname_of(save_checkpoint(root, step=1))
    overwrite(os.path.join(root, LATEST), b"x" * (bounded_json.SMALL_MAX_BYTES + 1))
    location = resolve(root)
    assert catalog.read_latest_pointer(location) is None
    assert catalog.find(location, "latest").name == good


def test_documents_within_the_bounds_parse_and_those_beyond_name_the_bound():
    deep_but_fine = b"[" * 50 + b"]" * 50
    assert bounded_json.loads(deep_but_fine, bounded_json.SMALL_MAX_BYTES) == eval("[" * 50 + "]" * 50)
    with pytest.raises(bounded_json.UnreadableJson, match=f"nested deeper than {bounded_json.MAX_DEPTH}"):
        bounded_json.loads(b"[" * (bounded_json.MAX_DEPTH + 1) + b"]" * (bounded_json.MAX_DEPTH + 1), 10**6)
    with pytest.raises(bounded_json.UnreadableJson, match="over the 10 bytes"):
        bounded_json.loads(b'{"a": 12345678}', 10)
    with pytest.raises(bounded_json.UnreadableJson, match="not valid JSON"):
        bounded_json.loads(b"{not json", 100)
