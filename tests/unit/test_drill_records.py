"""Only well-formed drill records decide trust: a file dropped into ROOT/drills/ by hand never makes a
checkpoint last known-good (issue 25, item 5)."""

from __future__ import annotations

import json
import logging
import os

import pytest

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format import drill_records
from lightning_shardckpt.engine.format.names import DRILLS_DIR
from lightning_shardckpt.engine.storage.fsio import resolve
from tests.helpers.checkpoints import dirname_of, save_checkpoint


@pytest.fixture
def drilled_root(tmp_path):
    """Steps 1 and 2 committed; step 1's drill passed and step 2's failed, both written by the drill writer."""
    root = str(tmp_path / "run")
    good, bad = dirname_of(save_checkpoint(root, step=1)), dirname_of(save_checkpoint(root, step=2))
    location = resolve(root)
    for name, verdict in ((good, drill_records.PASSED), (bad, drill_records.FAILED)):
        cause = None if verdict == drill_records.PASSED else "probe moved"
        record = {"checkpoint": name, "drill_id": drill_records.new_drill_id(), "verdict": verdict, "cause": cause}
        drill_records.write_record(location, record)
    return root, good, bad


def forge(root: str, filename: str, body: str) -> str:
    path = os.path.join(root, DRILLS_DIR, filename)
    with open(path, "w") as handle:
        handle.write(body)
    return filename


def test_a_hand_made_passed_record_does_not_override_a_real_failed_drill(drilled_root, run_cli, caplog):
    root, good, bad = drilled_root
    forged = forge(root, f"{bad}--manual--{drill_records.PASSED}.json", "trust me")
    location = resolve(root)

    with caplog.at_level(logging.WARNING):
        assert [e.name for e in catalog.last_good(location, catalog.list_checkpoints(location))] == [good]
    assert forged in caplog.text
    code, out, _ = run_cli("last-good", root)
    assert code == 0 and out.strip().endswith(good)
    listing = json.loads(run_cli("ls", root, "--json")[1])
    trust = {row["name"]: row["trust"] for row in listing["checkpoints"]}
    assert trust[bad] == drill_records.DRILL_FAILED and listing["last_good"] == good
    assert [line.split(":")[0] for line in listing["malformed_drill_records"]] == [forged]
    assert forged in run_cli("ls", root)[1]


@pytest.mark.parametrize(
    "body",
    ["not json", json.dumps([1]), json.dumps({"verdict": "passed"}), "another checkpoint"],
    ids=["not-json", "not-an-object", "fields-missing", "names-another-checkpoint"],
)
def test_a_well_named_passed_record_whose_body_is_not_that_record_is_not_trusted(drilled_root, run_cli, body):
    root, good, bad = drilled_root
    drill_id = drill_records.new_drill_id()
    if body == "another checkpoint":
        body = json.dumps(
            {"record_version": 1, "checkpoint": good, "drill_id": drill_id, "verdict": drill_records.PASSED}
        )
    forged = forge(root, f"{bad}--{drill_id}--{drill_records.PASSED}.json", body)
    location = resolve(root)
    report = drill_records.trust_report(location, catalog.list_checkpoints(location))
    assert report.states[bad] == drill_records.DRILL_FAILED
    assert [line.split(":")[0] for line in report.malformed] == [forged]
    assert run_cli("last-good", root)[1].strip().endswith(good)
