"""A lost node of a node-local fast tier with peer copies, node 0 included, on more than 2 nodes (issue 46 item 3).

Peer copies put each node's files on the next node (one copy: `factor=2`, `jump` = ranks per node), so with 3 or
more nodes no root but node 0's holds the checkpoint whole, and only a whole copy is committed: the manifest's one
committed copy is node 0's. Each peer copy also keeps the manifest's bytes beside its record
(`ROOT/peers/<checkpoint>/`, engine/tiers/peers.py), so when node 0 is lost a survivor holding them reads them once
and sends them to every rank, and the checkpoint is assembled in every node root from the survivors' files
(engine/tiers/peer_restore.py) with no object read from the durable tier. Two adjacent nodes lost take some file
with both copies: the resume falls back to the durable tier and says why. Under a signature policy a kept manifest
is checked as a committed one: one left unsigned is passed over, never assembled.

Real gloo ranks: simulated nodes (node rank = rank // ranks per node), each its own `base/node{n}` fast root, no
scan of the other roots on this disk (as on separate machines); the durable tier is the loopback S3 server behind a
proxy that records every request; groups forced small (the tests-only group size).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from typing import Any

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine.collectives import new_checkpoint_group
from lightning_shardckpt.engine.config import LoadConfig, SignConfig
from lightning_shardckpt.engine.format import groups, signing
from lightning_shardckpt.engine.format.names import MANIFEST
from lightning_shardckpt.engine.load.loader import load_checkpoint
from lightning_shardckpt.engine.tiers.peers import PEERS_DIR
from lightning_shardckpt.policies.tiers.checkpoint_tiers import CheckpointTiers
from tests.helpers.log_capture import MessageLines
from tests.helpers.node_local_v5_ranks import close_flushed, save_v5_with_peers, start_node_local_saver
from tests.helpers.peer_ranks import KEYS, config, one_rank_per_node, resume_with_peers, state
from tests.helpers.row_sharded import global_tensor, shard_rows
from tests.helpers.spawn import run_ranks
from tests.unit.test_signing import make_key

OBJECT_READ = r"/step-\d+-[0-9a-f]+/"  # a GET of an object inside a checkpoint directory (listings carry no key)


def _proxied(s3_server, tmp_path_factory, name: str) -> tuple[Any, Any, str, dict]:
    from tests.conftest import S3_BUCKET
    from tests.helpers.s3_server import FaultProxy

    proxy = FaultProxy(s3_server.host, s3_server.port)
    base = tmp_path_factory.mktemp(name)
    return proxy, base, f"s3://{S3_BUCKET}/{name}-{base.name}", s3_server.storage_options(proxy.endpoint)


def resume_logging(rank: int, world_size: int, base: str, durable: str, options: dict, per_node: int) -> dict:
    """resume_with_peers (no scan of other roots), with rank 0's log lines (INFO and above) of the package."""
    lines = MessageLines()
    logger = logging.getLogger("lightning_shardckpt")
    logger.addHandler(lines)
    logger.setLevel("INFO")
    try:
        out = resume_with_peers(rank, world_size, base, durable, options, per_node, False)
    finally:
        logger.removeHandler(lines)
    return {**out, "lines": lines.lines if rank == 0 else []}


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory, s3_server) -> dict:
    """3 nodes of one rank, groups of one: node 0 lost and resumed on 3 (a new empty node 0); and from the same saved
    roots, nodes 0 and 1 lost (adjacent: node 0's files had their one copy on node 1), resumed on 3."""
    proxy, base, durable, options = _proxied(s3_server, tmp_path_factory, "node0-lost")
    out: dict = {}
    try:
        out["save"] = [o.value for o in run_ranks(save_v5_with_peers, 3, str(base), durable, options, 1, 1)]
        out["newest"] = sorted(p.name for p in (base / "node0").glob("step-*"))[-1]
        out["committed_on"] = [n for n in ("node0", "node1", "node2") if (base / n / out["newest"] / MANIFEST).exists()]
        twin = tmp_path_factory.mktemp("two-lost")  # the same saved roots, for the second loss
        shutil.copytree(base / "node2", twin / "node2")  # nodes 0 and 1 lost there: node 2 alone survives
        shutil.rmtree(base / "node0")  # the coordinator's node: the manifest's committed copy and `latest` go with it
        proxy.clear()
        out["node0_lost"] = [o.value for o in run_ranks(resume_logging, 3, str(base), durable, options, 1)]
        out["node0_lost_reads"] = len(proxy.requests("GET", OBJECT_READ))
        proxy.clear()
        out["two_lost"] = [o.value for o in run_ranks(resume_logging, 3, str(twin), durable, options, 1)]
        out["two_lost_reads"] = len(proxy.requests("GET", OBJECT_READ))
    finally:
        proxy.stop()
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_node_local_peers_node0_lost_of_three_is_restored_from_peers_bit_exact_with_no_durable_read(three_nodes):
    assert all(rank["flushed"] and rank["durable_flushed"] for rank in three_nodes["save"])
    assert three_nodes["committed_on"] == ["node0"]  # one copy each: no other root held it whole
    ranks = three_nodes["node0_lost"]
    assert three_nodes["node0_lost_reads"] == 0, ranks[0]["restore"]  # not one durable-tier object read
    for r, rank in enumerate(ranks):
        assert rank["exact"] and rank["step"] == 2, rank
        assert rank["loaded"].rstrip("/").endswith(f"/node{r}/{three_nodes['newest']}"), rank  # its own node's root
    restore = ranks[0]["restore"]
    assert restore["name"] == three_nodes["newest"] and restore["fetched"] > 0, restore
    lines = ranks[0]["lines"]
    assert any("resuming from the fast tier" in line for line in lines), lines
    assert any("assembled from peer copies" in line and "manifest from" in line for line in lines), lines


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_node_local_peers_two_adjacent_nodes_lost_resume_from_the_durable_tier_saying_why(three_nodes):
    ranks = three_nodes["two_lost"]
    assert all(rank["exact"] and rank["step"] == 2 for rank in ranks), ranks
    assert all(rank["loaded"].startswith("s3://") for rank in ranks), ranks
    assert three_nodes["two_lost_reads"] > 0
    assert ranks[0]["restore"]["name"] is None
    lines = ranks[0]["lines"]
    assert any("no complete peer copy" in line and "lost with their nodes" in line for line in lines), lines
    assert any("resuming from the durable tier" in line for line in lines), lines


# --- 32 ranks in small groups, node 0 lost, resumed on 7 ---


def _sharded(world_size: int, rank: int, *, zeros: bool) -> dict:
    """8 [rows, 8] tensors row-sharded over the world as FSDP2 shards (the last ranks may hold no row), and a
    non-tensor progress record (rank 0's)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    sharded: dict[str, Any] = {"model": {}, "progress": {"note": "" if zeros else "saved-on-32"}}
    for index in range(8):
        local = shard_rows(global_tensor(index), mesh, world_size, rank)
        sharded["model"][f"w{index}"] = torch.zeros_like(local) if zeros else local
    return sharded


def save_sharded_with_peers(
    rank: int, world_size: int, base: str, durable: str, options: dict, per_node: int, group_size: int
) -> dict:
    """One save on node-local roots in groups of `group_size`, copied to peers and to the durable tier."""
    tiers, saver = start_node_local_saver(rank, base, durable, options, per_node, group_size, 120.0)
    result = saver.save(_sharded(world_size, rank, zeros=False), step=5).result(timeout=120)
    closed = close_flushed(tiers, saver, 120.0)
    return {"committed": result.committed, "manifest": result.manifest if rank == 0 else None, **closed}


def resume_sharded_on_7(rank: int, world_size: int, base: str, durable: str, options: dict, per_node: int) -> dict:
    """`latest` across the tiers on a new world, loaded resharded; bit-exact against the saved tensors."""
    tiers = CheckpointTiers(config(base, durable, options, per_node, False), rank // per_node, rank % per_node)
    group = new_checkpoint_group(120.0)
    path, load_config, *_ = tiers.pick("latest", LoadConfig(), group)
    sharded = _sharded(world_size, rank, zeros=True)
    result = load_checkpoint(sharded, path, config=load_config, process_group=group)
    # full_tensor() is a collective: every rank gathers every tensor, in the same order, before any is judged
    exact = all([torch.equal(sharded["model"][f"w{i}"].full_tensor(), global_tensor(i)) for i in range(8)])
    return {
        "step": result.step,
        "exact": exact and sharded["progress"] == {"note": "saved-on-32"},
        "loaded": result.path,
        "restore": dataclasses.asdict(tiers.peer_restore) if tiers.peer_restore else None,
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_node_local_peers_saved_on_32_ranks_in_small_groups_resume_on_7_after_node0_is_lost_with_no_durable_read(
    tmp_path_factory, s3_server
):
    """4 nodes of 8 ranks, groups of 6 (groups 1, 2 and 4 span two nodes), one peer copy a node; node 0 lost; 7
    ranks on 4 nodes (2 a node, a new empty node 0) resume from the survivors' roots and copies alone."""
    proxy, base, durable, options = _proxied(s3_server, tmp_path_factory, "node0-lost-32")
    try:
        saved = [
            o.value
            for o in run_ranks(
                save_sharded_with_peers, 32, str(base), durable, options, 8, 6, timeout_s=400, pg_timeout_s=120
            )
        ]
        newest = sorted(p.name for p in (base / "node0").glob("step-*"))[-1]
        shutil.rmtree(base / "node0")
        proxy.clear()
        loaded = [
            o.value
            for o in run_ranks(resume_sharded_on_7, 7, str(base), durable, options, 2, timeout_s=240, pg_timeout_s=120)
        ]
        object_reads = len(proxy.requests("GET", OBJECT_READ))
    finally:
        proxy.stop()
    assert all(r["committed"] and r["flushed"] and r["durable_flushed"] for r in saved), saved
    assert all(r["counters"].get("peer_replication_failed", 0) == 0 for r in saved), saved[0]["counters"]
    manifest = saved[0]["manifest"]
    assert manifest["format_version"] == 5 and manifest[groups.GROUPS_FIELD]["size"] == 6
    assert object_reads == 0, loaded[0]["restore"]
    assert loaded[0]["restore"]["name"] == newest, loaded[0]["restore"]
    for r, rank in enumerate(loaded):
        assert rank["exact"] and rank["step"] == 5, rank
        assert rank["loaded"].rstrip("/").endswith(f"/node{r // 2}/{newest}"), rank


# --- under a signature policy, the manifest a partial peer copy keeps is checked as a committed one ---


def save_signed_on_three_nodes(rank: int, world_size: int, base: str, key_path: str) -> None:
    """Steps 1 and 2, signed, on 3 nodes of one rank (peers one node on, every commit copied to `base`/durable)."""
    tiers = CheckpointTiers(one_rank_per_node(base), rank, 0)
    saver = CheckpointSaver(
        tiers.fast_dirpath,
        SaveConfig(write_events=False, collective_timeout_s=30.0, node_local=True, sign=SignConfig(key_path=key_path)),
    )
    tiers.start(saver, saver.run_id, allow_shared_root=False, is_global_zero=rank == 0)
    for step in (1, 2):
        saver.save(state(step), step=step, identical=lambda key: True)
        saver.wait()
    assert tiers.peer_replicator.flush(60.0) and tiers.replicator.flush(60.0)
    tiers.close(60.0)
    saver.close()


def resume_signed_on_three_nodes(rank: int, world_size: int, base: str, public_key: str) -> dict:
    tiers = CheckpointTiers(one_rank_per_node(base), rank, 0)
    group = new_checkpoint_group(30.0)
    picked = tiers.pick("latest", LoadConfig(require_signature=True, public_keys=[public_key]), group)
    target = {key: torch.zeros(2048) for key in KEYS}
    result = load_checkpoint(target, picked.path, config=picked.config, process_group=group)
    return {
        "step": result.step,
        "exact": all(torch.equal(target[key], state(result.step)[key]) for key in KEYS),
        "loaded": result.path,
        "skipped": list(picked.signature_skipped),
        "assembled": tiers.peer_restore.name,
        "peer_refused": sorted(tiers.peer_restore.refused),
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_node0_lost_under_a_signature_policy_peer_kept_manifests_left_unsigned_are_passed_over(tmp_path):
    """Signed steps 1 and 2 on 3 nodes; node 0 lost; the survivors' kept manifests of step 2 lose their signature
    (and so does the durable copy). `latest` under require_signature assembles step 1 from the peers (its kept
    manifest validly signed), names step 2 as passed over, and never assembles the unsigned one."""
    private, public, _ = make_key(tmp_path, "writer")
    base = tmp_path / "roots"
    (base / "durable").mkdir(parents=True)
    run_ranks(save_signed_on_three_nodes, 3, str(base), private, timeout_s=180)
    names = sorted(p.name for p in (base / "node0").glob("step-*"))
    newest = names[-1]
    kept = [base / node / PEERS_DIR / newest / signing.SIGNATURE for node in ("node1", "node2")]
    assert all(path.exists() for path in kept)  # the signature travels with the kept manifest
    shutil.rmtree(base / "node0")
    for path in [*kept, base / "durable" / newest / signing.SIGNATURE]:
        path.unlink()

    ranks = [o.value for o in run_ranks(resume_signed_on_three_nodes, 3, str(base), public, timeout_s=180)]
    for r, rank in enumerate(ranks):
        assert rank["step"] == 1 and rank["exact"], rank
        assert rank["assembled"] == names[0] and rank["peer_refused"] == [newest], rank
        assert rank["skipped"] == [newest], rank
        assert f"/node{r}/" in rank["loaded"], rank
    assert not (base / "node0" / newest).exists()  # the unsigned one was never assembled in the new node's root
