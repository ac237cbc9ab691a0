"""Drill leases: of two followers claiming one checkpoint exactly one holds it; a dead holder's lease is
taken over once, by one claimant; leases never count as drill records."""

from __future__ import annotations

import json
import subprocess
import sys

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
