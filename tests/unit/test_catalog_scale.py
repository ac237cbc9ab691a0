"""Listing many checkpoints reads small commit records, never tensor tables (issue 9, item 10; functional, not timed).

The timings live in benchmarks/listing.py and docs/BENCHMARKS.md; these tests prove the mechanism: what a
listing reads and holds, and that ordering and retention stay right over hundreds of checkpoints.
"""

from __future__ import annotations

import json
import os
import tracemalloc
import uuid
from collections import Counter

import pytest
import torch

from benchmarks.listing import RUN_ID, make_root
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format import manifest as manifest_format
from lightning_shardckpt.engine.format.names import COMMIT_RECORD, MANIFEST
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.errors import CorruptCheckpoint
from lightning_shardckpt.ops import timeline
from lightning_shardckpt.policies import retention
from tests.helpers import counting_fs
from tests.helpers.counting_fs import counting_url

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


def test_timeline_reads_each_manifest_once_and_holds_no_tensor_table(big_root):
    """`timeline` streams: one read per manifest, none kept, memory far below the manifests' size (issue 25, item 15)."""
    root, names = big_root
    log_id = f"timeline-{uuid.uuid4().hex}"
    location = resolve(counting_url(root), {"log_id": log_id})
    tracemalloc.start()
    try:
        result = timeline.timeline(location)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    rows = result["checkpoints"]
    assert [row["name"] for row in rows] == names and all(row["state"] == "committed" for row in rows)
    assert [row["compared_with"] for row in rows] == [None, *names[:-1]]  # each compared with the one before
    manifest_reads = Counter(
        path
        for path, start, stop in counting_fs.LOGS[log_id].reads
        if path.endswith("/" + MANIFEST) and stop - start > 1
    )  # a 1-byte read is listing's "is it committed?" probe, not a read of the manifest
    assert sorted(path.rsplit("/", 2)[-2] for path in manifest_reads) == names, "every manifest read"
    assert set(manifest_reads.values()) == {1}, "no manifest read twice"
    manifest_bytes = sum(os.path.getsize(os.path.join(root, name, MANIFEST)) for name in names)
    assert peak < manifest_bytes / 20, f"timeline peaked at {peak} bytes; the manifests hold {manifest_bytes}"


def test_timeline_of_a_manifest_not_in_the_writers_layout_parses_it_in_full_and_checks_it(tmp_path):
    """Compact JSON (not the writer's layout) is read the slow, full way; a tampered one is still corrupt."""
    root = str(tmp_path / "root")
    names = make_root(root, 4, 10)
    for name in names[:2]:  # re-encoded compactly, record checksum updated: the same manifest, another layout
        directory = os.path.join(root, name)
        with open(os.path.join(directory, MANIFEST), "rb") as handle:
            manifest = json.load(handle)
        data = json.dumps(manifest).encode()
        record = manifest_format.build_commit_record(manifest, data)
        with open(os.path.join(directory, COMMIT_RECORD), "wb") as handle:
            handle.write(manifest_format.to_bytes(record))
        with open(os.path.join(directory, MANIFEST), "wb") as handle:
            handle.write(data)
    with open(os.path.join(root, names[3], MANIFEST), "ab") as handle:
        handle.write(b" ")  # one byte more than committed
    rows = {row["name"]: row for row in timeline.timeline(resolve(root))["checkpoints"]}
    assert [rows[name]["state"] for name in names] == ["committed", "committed", "committed", "corrupt"]
    assert rows[names[0]]["verification"] == rows[names[2]]["verification"]
    assert "does not match its commit record" in rows[names[3]]["cause"]


def test_a_manifest_summary_is_the_full_parse_without_the_tables(tmp_path, committed_checkpoint):
    # the summary finds its keys backwards from the end to the last table and forwards up to it, never
    # scanning the tables: on the writer's own bytes it must equal the full parse, field for field
    from lightning_shardckpt.ops import manifest_summary

    written = committed_checkpoint(state={"w": torch.zeros(4), "note": 'a\n "b": 1'})
    synthetic_root = str(tmp_path / "synthetic")
    make_root(synthetic_root, 3, 50)
    paths = [os.path.join(written.directory, MANIFEST)]
    paths += [os.path.join(synthetic_root, name, MANIFEST) for name in sorted(os.listdir(synthetic_root))]
    for path in paths:
        with open(path, "rb") as handle:
            data = handle.read()
        full = {key: value for key, value in json.loads(data).items() if key not in manifest_summary.TABLES}
        split = manifest_summary._split_top_level(data)
        assert split is not None, f"{path} is the writer's layout and must split"
        assert split[0] == full, path
    assert manifest_summary._split_top_level(b'{"compact": true}') is None  # another layout: parsed in full


def test_ls_reads_one_manifest_of_hundreds_the_latest_one_it_stars(big_root, run_cli):
    """`ls` stars what `latest` loads, so it validates that one manifest, and only that one (issue 37, item 11)."""
    root, names = big_root
    log_id = f"ls-{uuid.uuid4().hex}"
    code, out, err = run_cli("ls", counting_url(root), "--json", "--storage-option", f"log_id={log_id}")
    assert code == 0, err
    assert json.loads(out)["latest"] == names[-1]
    manifest_reads = {
        path.rsplit("/", 2)[-2]
        for path, start, stop in counting_fs.LOGS[log_id].reads
        if path.endswith(MANIFEST) and stop - start > 1  # not listing's 1-byte "is it committed?" probe
    }
    assert manifest_reads == {names[-1]}, "the star's manifest, validated; no other (nothing drilled: no last-good)"
