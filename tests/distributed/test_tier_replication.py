"""Replication from the fast tier to S3 on 2 real gloo ranks: commit, outage, a rank killed mid-upload."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format import groups
from lightning_shardckpt.engine.format.manifest import files_of
from lightning_shardckpt.engine.load.loader import load_checkpoint
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.engine.tiers.replicate import REPLICATED_FROM
from tests.helpers.spawn import run_ranks
from tests.helpers.tiers_ranks import KEYS, replicate_on_rank, state

pytestmark = pytest.mark.timeout(240)


def committed(url: str, options: dict | None = None) -> list[catalog.CheckpointEntry]:
    return [e for e in catalog.list_checkpoints(fsio.resolve(url, options)) if e.committed]


def test_replication_commits_every_checkpoint_on_s3_with_same_id_and_step(tmp_path, s3_root):
    outcomes = run_ranks(replicate_on_rank, 2, str(tmp_path / "fast"), s3_root.url, s3_root.storage_options, "ok")
    fast = committed(str(tmp_path / "fast"))
    durable = committed(s3_root.url, s3_root.storage_options)
    # each durable copy is a fast commit (same id, same step); one that fell behind skips to the newest
    assert {(e.checkpoint_id, e.step) for e in durable} <= {(e.checkpoint_id, e.step) for e in fast}
    assert durable[-1].step == 3 and [e.step for e in fast] == [1, 2, 3]
    newest = durable[-1]
    manifest = newest.manifest
    assert manifest[REPLICATED_FROM]["tier"] == "fast"
    # both ranks wrote (and so uploaded) a shard file of their own: no funnel through rank 0
    assert sorted(f["path"] for f in files_of(manifest)) == [  # each with its part (format v4)
        "__0_0.distcp",
        "__0_0.part.json",
        "__1_0.distcp",
        "__1_0.part.json",
    ]
    for outcome in outcomes:
        counters = outcome.value["counters"]
        assert outcome.value["flushed"] and counters["replicated"] == len(durable)
        assert counters["replicated"] + counters.get("replication_skipped", 0) == 3
    target = {key: torch.zeros(4096) for key in KEYS}
    load_checkpoint(target, s3_root.url, "latest", config=_load_config(s3_root.storage_options))
    assert all(torch.equal(target[k], state(3)[k]) for k in KEYS)


def test_a_format_v5_checkpoint_replicates_with_its_group_tables_and_loads_from_s3(tmp_path, s3_root):
    run_ranks(replicate_on_rank, 2, str(tmp_path / "fast"), s3_root.url, s3_root.storage_options, "v5")
    newest = committed(s3_root.url, s3_root.storage_options)[-1]
    assert newest.step == 2 and newest.manifest["format_version"] == 5
    location = fsio.resolve(s3_root.url, s3_root.storage_options)
    copied = files_of(groups.expanded(location.fs, newest.path, newest.manifest))
    assert sorted(f["path"] for f in copied) == [  # rank 0 copied the group tables, each rank its files
        "__0_0.distcp",
        "__0_0.part.json",
        "__1_0.distcp",
        "__1_0.part.json",
        "__g0.parts.json",
        "__g1.parts.json",
    ]
    target = {key: torch.zeros(4096) for key in KEYS}
    load_checkpoint(target, s3_root.url, "latest", config=_load_config(s3_root.storage_options))
    assert all(torch.equal(target[k], state(2)[k]) for k in KEYS)


def test_durable_outage_fast_saves_go_on_and_replication_catches_up(tmp_path, s3_server, s3_fault_proxy, s3_root):
    options = s3_server.storage_options(s3_fault_proxy.endpoint)
    # the durable tier refuses every upload for a while (each request fails until the rule's hits run out)
    s3_fault_proxy.fail("PUT", s3_root.prefix + "/step-", times=25)
    outcomes = run_ranks(replicate_on_rank, 2, str(tmp_path / "fast"), s3_root.url, options, "outage", timeout_s=200)
    assert [e.step for e in committed(str(tmp_path / "fast"))] == [1, 2, 3, 4]  # every fast save committed
    durable = committed(s3_root.url, s3_root.storage_options)
    assert durable and durable[-1].step == 4  # caught up to the newest
    counters = outcomes[0].value["counters"]
    assert counters.get("replication_failed", 0) >= 1
    assert counters["replication_lag_checkpoints"] == 0
    assert counters.get("replicated", 0) + counters.get("replication_skipped", 0) == 4


def test_rank_killed_mid_upload_durable_never_commits_fast_stays_good_next_replication_succeeds(tmp_path, s3_root):
    fast_url = str(tmp_path / "fast")
    outcomes = run_ranks(
        replicate_on_rank, 2, fast_url, s3_root.url, s3_root.storage_options, "kill", allow_failures=True, timeout_s=120
    )
    assert outcomes[1].exitcode == 17
    assert committed(s3_root.url, s3_root.storage_options) == []  # never committed on the durable tier
    fast = committed(fast_url)
    assert [e.step for e in fast] == [1]
    target = {key: torch.zeros(4096) for key in KEYS}
    load_checkpoint(target, fast_url, "latest")  # the fast copy is good
    assert all(torch.equal(target[k], state(1)[k]) for k in KEYS)
    # the next run's replicator copies what the durable tier lacks, in fresh processes
    run_ranks(replicate_on_rank, 2, fast_url, s3_root.url, s3_root.storage_options, "catch_up")
    durable = committed(s3_root.url, s3_root.storage_options)
    assert [(e.checkpoint_id, e.step) for e in durable] == [(fast[0].checkpoint_id, 1)]


def test_corrupt_fast_copy_is_never_replicated(tmp_path, s3_root):
    """A byte flipped in a fast-tier shard after its commit: the verified copy refuses it."""
    from lightning_shardckpt.engine.tiers.verified_copy import copy_verified
    from lightning_shardckpt.errors import CorruptCheckpoint

    run_ranks(replicate_on_rank, 2, str(tmp_path / "fast"), str(tmp_path / "durable"), {}, "ok")
    entry = committed(str(tmp_path / "fast"))[-1]
    shard = tmp_path / "fast" / entry.name / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    durable = fsio.resolve(s3_root.url, s3_root.storage_options)
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        copy_verified(
            fsio.resolve(str(tmp_path / "fast")).fs,
            str(tmp_path / "fast" / entry.name),
            durable.fs,
            f"{durable.path}/{entry.name}",
            "__1_0.distcp",
            json.loads((tmp_path / "fast" / entry.name / "manifest.json").read_text()),
        )
    assert not durable.fs.exists(f"{durable.path}/{entry.name}/__1_0.distcp")  # the upload was aborted


def _load_config(options: dict):
    from lightning_shardckpt.engine.config import LoadConfig

    return LoadConfig(storage_options=options)
