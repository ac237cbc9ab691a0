"""Incremental saves on node-local roots with peer copies and on tiers (issue 46), on real gloo ranks: simulated nodes
of 2 ranks, each its own fast root, peer copies one node on, every commit copied to a durable tier.

Step 1 is full; step 2 references the tensors that did not change since step 1, step 3 those unchanged since step 2
(some held by step 1's files, one by step 2's). Each copy carries the earlier files a checkpoint's parts reference
(engine/tiers/referenced_files.py), so the checkpoint is readable wherever it is: on its nodes, restored from peer
copies after a node is lost (no durable-tier read), and on the durable tier alone. Retention on either tier keeps
what a kept checkpoint references.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lightning_shardckpt.engine.format.references import referenced_files
from tests.helpers.incremental_tiers_ranks import load_directory, resume_from_peers, save_incrementally, tiers_config
from tests.helpers.spawn import run_ranks

OBJECT_READ = r"/step-\d+-[0-9a-f]+/"  # a GET of an object inside a checkpoint directory (listings carry no key)


def _newest(root: Path) -> str:
    return sorted(p.name for p in root.glob("step-000000003-*"))[-1]


def _holds_references(root: Path, name: str) -> list[str]:
    """The references of checkpoint `name` that `root` lacks."""
    manifest = json.loads((root / name / "manifest.json").read_text())
    assert manifest.get("references"), "step 3 is an incremental checkpoint"
    return [
        f"{d}/{f}" for d, files in referenced_files(manifest).items() for f in files if not (root / d / f).is_file()
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_incremental_node_local_checkpoint_with_a_node_lost_is_restored_from_peers_bit_exact_with_no_durable_read(
    tmp_path, s3_server
):
    from tests.conftest import S3_BUCKET
    from tests.helpers.s3_server import FaultProxy

    proxy = FaultProxy(s3_server.host, s3_server.port)
    options = s3_server.storage_options(proxy.endpoint)
    base = tmp_path / "fast"
    config = tiers_config(str(base), f"s3://{S3_BUCKET}/incremental-peers-{tmp_path.name}", options, 2, every_n=1)
    try:
        saved = [o.value for o in run_ranks(save_incrementally, 4, config, 2, timeout_s=300)]
        counters = saved[0]["counters"]
        assert counters.get("peer_replicated") == 3 and not counters.get("peer_replication_failed"), counters
        name = _newest(base / "node0")
        for node in ("node0", "node1"):  # each node root: the checkpoint and every earlier file it reads
            assert _holds_references(base / node, name) == [], node

        shutil.rmtree(base / "node1")  # node 1 is lost; a replacement node starts empty
        proxy.clear()
        resumed = [o.value for o in run_ranks(resume_from_peers, 4, config, 2, timeout_s=300)]
        reads = len(proxy.requests("GET", OBJECT_READ))
    finally:
        proxy.stop()
    assert reads == 0  # not one object read from the durable tier
    for r, rank in enumerate(resumed):
        assert rank["exact"] and rank["step"] == 3, rank
        assert f"/node{r // 2}/" in rank["loaded"]  # each rank read its own node's root
        assert rank["restore"]["name"] == name
    assert resumed[0]["restore"]["fetched"] > 0
    assert _holds_references(base / "node1", name) == []  # the replaced node got the step-1 and step-2 files too


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_durable_tier_alone_restores_the_latest_incremental_checkpoint_and_retention_keeps_what_it_references(
    tmp_path,
):
    """keep_last=1 on both tiers: steps 1 and 2 are retired as step 3 commits, but step 3 reads tensors from their
    files, which stay (without their manifests) on the fast tier's nodes and on the durable tier; the fast tier then
    gone, the durable copy alone loads bit-exact on another world size."""
    base, durable = tmp_path / "fast", tmp_path / "durable"
    durable.mkdir()
    config = tiers_config(str(base), str(durable), {}, 2, keep_last=1, every_n=1)
    run_ranks(save_incrementally, 4, config, 2, 1, timeout_s=300)

    name = _newest(durable)
    committed = sorted(p.parent.name for p in durable.glob("step-*/manifest.json"))
    assert committed == [name]  # retention kept the newest only
    manifest = json.loads((durable / name / "manifest.json").read_text())
    siblings = set(referenced_files(manifest))
    assert len(siblings) == 2 and not siblings & set(committed)  # it reads steps 1 and 2, both retired
    assert _holds_references(durable, name) == []  # and every earlier file it reads stayed
    for node in ("node0", "node1"):  # node 1's peer copies of steps 1 and 2 are retired with node 0's originals
        assert sorted(p.parent.name for p in (base / node).glob("step-*/manifest.json")) == [name], node
        assert _holds_references(base / node, name) == [], node

    shutil.rmtree(base)  # the fast tier is gone
    loaded = [o.value for o in run_ranks(load_directory, 3, str(durable / name), {}, timeout_s=300)]
    assert all(rank["exact"] and rank["step"] == 3 for rank in loaded), loaded
