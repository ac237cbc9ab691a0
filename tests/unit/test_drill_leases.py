"""Drill leases: of two followers claiming one checkpoint exactly one holds it; a dead holder's lease is
taken over once, by one claimant; leases never count as drill records; a lease file no follower wrote is
logged once, counted and taken over as stale, never an error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_shardckpt.engine.format import drill_records
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.policies.drills.leases import DrillLeases

CHECKPOINT = "step-000000004-0123456789ab"


def test_of_two_followers_claiming_one_checkpoint_exactly_one_holds_it(tmp_path):
    location = resolve(str(tmp_path))
    first, second = DrillLeases(location), DrillLeases(location)
    lease = first.claim(CHECKPOINT)
    assert lease is not None and second.claim(CHECKPOINT) is None
    assert second.claim(CHECKPOINT, []) is None  # even from a listing taken before the first claim
    first.release(lease)
    assert second.claim(CHECKPOINT) is not None


def test_a_dead_holders_lease_is_taken_over_once_and_an_expired_one_too(tmp_path):
    location = resolve(str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    first = DrillLeases(location)
    lease = first.claim(CHECKPOINT)
    body = json.loads(open(lease.path).read())
    with open(lease.path, "w") as handle:  # as if a follower on this host had claimed it and been killed
        json.dump({**body, "pid": int(dead.stdout)}, handle)
    generations = first.held()[CHECKPOINT]
    taker, late = DrillLeases(location), DrillLeases(location)
    assert taker.claim(CHECKPOINT, generations) is not None
    assert late.claim(CHECKPOINT, generations) is None  # the same stale view: the next generation is taken
    expiring = DrillLeases(location, ttl_s=-1.0)  # claims that are expired at once
    assert expiring.claim("step-000000006-0123456789ab") is not None
    assert DrillLeases(location).claim("step-000000006-0123456789ab") is not None


def test_leases_are_not_drill_records(tmp_path):
    location = resolve(str(tmp_path))
    DrillLeases(location).claim(CHECKPOINT)
    listing = drill_records.list_records(location)
    assert listing.records == {} and listing.malformed == []


MALFORMED = {  # what someone with write access to the root could leave (body bytes), and what the log says of it
    "expires-soon": (b'{"checkpoint": "%s", "expires_at": "soon", "host": "h", "pid": 1}', "expires_at='soon'"),
    "pid-abc": (b'{"checkpoint": "%s", "expires_at": 1e12, "host": "h", "pid": "abc"}', "pid='abc'"),
    "expires-list": (b'{"checkpoint": "%s", "expires_at": [1], "host": "h", "pid": 1}', "expires_at=[1]"),
    "nested": (b"[" * 200_000 + b"]" * 200_000, "nested deeper than"),
    "other-checkpoint": (b'{"checkpoint": "step-9", "expires_at": 1e12, "host": "h", "pid": 1}', "another checkpoint"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_lease_is_logged_counted_and_taken_over_as_stale(tmp_path, caplog, case):
    location = resolve(str(tmp_path))
    body, said = MALFORMED[case]
    drills = tmp_path / "drills"
    drills.mkdir()
    planted = drills / f".lease--{CHECKPOINT}--000000.json"
    planted.write_bytes(body.replace(b"%s", CHECKPOINT.encode()) if b"%s" in body else body)
    leases = DrillLeases(location)
    generations = leases.held()[CHECKPOINT]
    for _ in range(2):  # a follower looks again and again: logged once
        assert not leases.is_live(CHECKPOINT, generations)
    assert leases.malformed == {planted.name}
    assert [r for r in caplog.records if planted.name in r.getMessage() and said in r.getMessage()]
    assert len([r for r in caplog.records if planted.name in r.getMessage()]) == 1
    lease = leases.claim(CHECKPOINT, generations)
    assert lease is not None  # taken over, like an expired lease
    leases.release(lease)
    leases.remove_stale({CHECKPOINT})  # once the checkpoint is drilled (or gone): no lease of it is left
    assert list(drills.glob(".lease--*")) == []
