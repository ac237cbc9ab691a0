"""Listing many checkpoints reads small commit records, never tensor tables (issue 9, item 10; functional, not timed).

The timings live in benchmarks/listing.py and docs/BENCHMARKS.md; these tests prove the mechanism: what a
listing reads and holds, and that ordering and retention stay right over hundreds of checkpoints.
"""

from __future__ import annotations

import os
import tracemalloc

import pytest

from benchmarks.listing import RUN_ID, make_root
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format.layout import MANIFEST
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.errors import CorruptCheckpoint
from lightning_shardckpt.policies import retention

CHECKPOINTS, TENSORS = 300, 600


@pytest.fixture(scope="module")
def big_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("scale") / "root")
    names = make_root(root, CHECKPOINTS, TENSORS)
    return root, names


def test_listing_holds_no_manifest_and_stays_small(big_root):
    root, names = big_root
    tracemalloc.start()
    try:
        entries = catalog.list_checkpoints(resolve(root))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [e.name for e in entries] == names and all(e.committed for e in entries)
    assert all(e._manifest is None for e in entries), "a listing must not parse tensor tables"
    manifest_bytes = sum(os.path.getsize(os.path.join(root, name, MANIFEST)) for name in names)
    assert peak < manifest_bytes / 20, f"listing peaked at {peak} bytes; the manifests hold {manifest_bytes}"
    assert catalog.resolve_latest(resolve(root), entries).name == names[-1]
    assert [e.seq for e in entries] == list(range(1, CHECKPOINTS + 1))


def test_only_the_opened_checkpoint_reads_its_manifest(big_root, tmp_path):
    root, names = big_root
    entries = catalog.list_checkpoints(resolve(root))
    chosen = catalog.find(resolve(root), "latest")
    assert chosen.name == names[-1] and len(chosen.manifest["tensors"]) == TENSORS
    assert sum(e._manifest is not None for e in entries) == 0  # the listing's own entries stay light


def test_listing_does_not_read_manifests_but_opening_checks_them(tmp_path):
    root = str(tmp_path / "root")
    names = make_root(root, 20, 50)
    damaged = os.path.join(root, names[3], MANIFEST)
    with open(damaged, "wb") as handle:
        handle.write(b"{ not json")  # listing never reads it; opening the checkpoint does
    location = resolve(root)
    assert all(e.committed for e in catalog.list_checkpoints(location))
    with pytest.raises(CorruptCheckpoint, match="does not match its commit record"):
        catalog.find(location, names[3])


def test_one_retention_pass_over_hundreds_keeps_the_newest_commits(tmp_path):
    root = str(tmp_path / "root")
    names = make_root(root, 200, 20)
    deleted = retention.apply(resolve(root), 10, None, run_id=RUN_ID)
    assert deleted == names[:190]
    assert [e.name for e in catalog.list_checkpoints(resolve(root))] == names[190:]


def test_v1_roots_list_from_their_manifests_in_created_at_order(tmp_path):
    root = str(tmp_path / "root")
    names = make_root(root, 30, 20, version=1)
    entries = catalog.list_checkpoints(resolve(root))
    assert [e.name for e in entries] == names and all(e.committed and e.seq is None for e in entries)
    assert all(e._manifest is None for e in entries), "v1 manifests are parsed to list, then dropped"
    assert catalog.find(resolve(root), "latest").name == names[-1]
    assert retention.apply(resolve(root), 5, None) == names[:25]
