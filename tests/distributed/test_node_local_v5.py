"""Node-local saves with peer copies on format v5 (issue 46 item 3), on real gloo ranks: simulated nodes (2 × 2
ranks, 3 × 1), each node its own fast root, peer copies one node on, every commit replicated to the loopback S3
server behind a proxy that records each request; groups forced small (the tests-only group size).

The writer writes each group table on every node its group spans (engine/save/node_groups.py), and peer copies carry
the tables a node holds to its peer before the parts they list (engine/tiers/peers.py). A lost node is restored from
the peer copies with no object read from the durable tier, resharded onto other world sizes bit-exact, and the
durable tier receives an ordinary v5 checkpoint.
"""

from __future__ import annotations

import json
import shutil

import pytest

from lightning_shardckpt.engine.config import SaveConfig
from lightning_shardckpt.engine.format import groups
from lightning_shardckpt.engine.format.parts_manifest import PARTS_FIELD
from lightning_shardckpt.engine.save.node_groups import table_copiers, table_holders
from lightning_shardckpt.engine.save.persist import _group_size
from tests.helpers.node_local_v5_ranks import load_resharded, manifest_of, save_v5_with_peers
from tests.helpers.peer_ranks import resume_with_peers
from tests.helpers.spawn import run_ranks

OBJECT_READ = r"/step-\d+-[0-9a-f]+/"  # a GET of an object inside a checkpoint directory (listings carry no key)


def _run(tmp_path_factory, s3_server, group_size: int | None) -> dict:
    from tests.conftest import S3_BUCKET
    from tests.helpers.s3_server import FaultProxy

    proxy = FaultProxy(s3_server.host, s3_server.port)
    base = tmp_path_factory.mktemp("node-local-v5")
    durable = f"s3://{S3_BUCKET}/node-local-v5-{base.name}"
    options = s3_server.storage_options(proxy.endpoint)
    out: dict = {"base": base, "durable": durable}
    try:
        out["save"] = [o.value for o in run_ranks(save_v5_with_peers, 4, str(base), durable, options, 2, group_size)]
        newest = sorted(p.name for p in (base / "node0").glob("step-*"))[-1]
        out["name"] = newest
        out["files"] = {node: sorted(p.name for p in (base / node / newest).iterdir()) for node in ("node0", "node1")}
        out["manifest"] = json.loads((base / "node0" / newest / "manifest.json").read_text())
        out["durable_manifest"] = manifest_of(f"{durable}/{newest}", options)

        def resume(world: int, per_node: int, scan: bool) -> dict:
            proxy.clear()
            values = [o.value for o in run_ranks(resume_with_peers, world, str(base), durable, options, per_node, scan)]
            return {"ranks": values, "object_reads": len(proxy.requests("GET", OBJECT_READ))}

        shutil.rmtree(base / "node0")  # node 0 (the coordinator's root, the manifest's original) is lost
        out["node_lost"] = resume(4, 2, False)  # replaced by an empty node: its files come over the group
        out["node_lost"]["node0_files"] = sorted(p.name for p in (base / "node0" / newest).iterdir())
        shutil.rmtree(base / "node1")  # node 1 lost too; the world shrinks to one node of 3 ranks
        out["shrunk"] = resume(3, 3, False)
        out["shrunk"]["manifest"] = json.loads((base / "node0" / newest / "manifest.json").read_text())
        proxy.clear()
        out["durable_load"] = [o.value for o in run_ranks(load_resharded, 3, f"{durable}/{newest}", options)]
    finally:
        proxy.stop()
    return out


@pytest.fixture(scope="module")
def node_groups_run(tmp_path_factory, s3_server):
    """Groups of 2 ranks: one group a node, led by its node's highest rank."""
    return _run(tmp_path_factory, s3_server, 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_node_local_save_with_peers_writes_v5_group_tables_on_the_nodes_of_their_ranks(node_groups_run):
    run = node_groups_run
    for rank in run["save"]:
        assert rank["flushed"] and rank["durable_flushed"]
        assert rank["counters"].get("peer_replication_failed", 0) == 0, rank["counters"]
        assert rank["counters"].get("peer_replicated") == 2, rank["counters"]
    manifest = run["manifest"]
    # flat: group tables, no O(world) v4 parts table in the manifest
    assert manifest["format_version"] == 5 and PARTS_FIELD not in manifest
    assert manifest[groups.GROUPS_FIELD]["size"] == 2 and manifest[groups.GROUPS_FIELD]["count"] == 4
    for node, files in run["files"].items():  # each node root: its own group's table and its peer's, every rank's files
        assert {"__g0.parts.json", "__g1.parts.json", "manifest.json"} <= set(files), (node, files)
        assert {f"__{r}_0.distcp" for r in range(4)} <= set(files), (node, files)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_node_local_v5_node_lost_is_restored_from_peers_bit_exact_with_no_durable_read(node_groups_run):
    run = node_groups_run["node_lost"]
    assert run["object_reads"] == 0  # not one object read from the durable tier
    for r, rank in enumerate(run["ranks"]):
        assert rank["exact"] and rank["step"] == 2, rank
        assert f"/node{r // 2}/" in rank["loaded"]  # each rank read its own node's root
    assert run["ranks"][0]["restore"]["fetched"] > 0  # node 0's files came over the group from node 1's copies
    assert {"__g0.parts.json", "__g1.parts.json", "manifest.json"} <= set(run["node0_files"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_node_local_v5_resumes_on_another_world_size_bit_exact_from_the_fast_tier(node_groups_run):
    run = node_groups_run["shrunk"]
    assert run["object_reads"] == 0
    assert run["manifest"]["format_version"] == 5  # the v5 checkpoint, resharded from 4 ranks onto 3
    assert all(rank["exact"] and rank["step"] == 2 and "/node0/" in rank["loaded"] for rank in run["ranks"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_node_local_v5_is_replicated_to_the_durable_tier_as_an_ordinary_v5_checkpoint(node_groups_run):
    durable = node_groups_run["durable_manifest"]
    assert durable["format_version"] == 5 and PARTS_FIELD not in durable
    assert durable[groups.GROUPS_FIELD] == node_groups_run["manifest"][groups.GROUPS_FIELD]
    assert all(rank["exact"] and rank["step"] == 2 for rank in node_groups_run["durable_load"])  # 3 ranks, resharded


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_node_local_v5_groups_smaller_than_a_node_restore_a_lost_node_from_peers(tmp_path_factory, s3_server):
    """Groups of one rank inside nodes of two (the tests-only group size): every rank leads its own group."""
    run = _run(tmp_path_factory, s3_server, 1)
    assert run["manifest"]["format_version"] == 5 and run["manifest"][groups.GROUPS_FIELD]["size"] == 1
    assert {f"__g{g}.parts.json" for g in range(4)} <= set(run["files"]["node1"])
    for key in ("node_lost", "shrunk"):
        assert run[key]["object_reads"] == 0, key
        assert all(rank["exact"] and rank["step"] == 2 for rank in run[key]["ranks"]), key
    assert all(rank["exact"] for rank in run["durable_load"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_node_local_v5_lost_node_is_restored_from_peers_when_no_root_holds_every_group_table(
    tmp_path_factory, s3_server
):
    """3 nodes of one rank, one peer copy each (node n's files also on node n+1): no node root holds every group
    table, node 0's manifest lists the tables only. Node 1 lost: its table survives on node 2 alone, beside node 0's
    manifest, and the checkpoint is still assembled from the survivors with no object read from the durable tier."""
    from tests.conftest import S3_BUCKET
    from tests.helpers.s3_server import FaultProxy

    proxy = FaultProxy(s3_server.host, s3_server.port)
    base = tmp_path_factory.mktemp("node-local-v5-three")
    durable = f"s3://{S3_BUCKET}/node-local-v5-{base.name}"
    options = s3_server.storage_options(proxy.endpoint)
    try:
        saved = [o.value for o in run_ranks(save_v5_with_peers, 3, str(base), durable, options, 1, 1)]
        newest = sorted(p.name for p in (base / "node0").glob("step-*"))[-1]
        manifest = json.loads((base / "node0" / newest / "manifest.json").read_text())
        node0_tables = sorted(p.name for p in (base / "node0" / newest).glob("__g*"))
        shutil.rmtree(base / "node1")
        proxy.clear()
        ranks = [o.value for o in run_ranks(resume_with_peers, 3, str(base), durable, options, 1, False)]
        object_reads = len(proxy.requests("GET", OBJECT_READ))
    finally:
        proxy.stop()
    assert all(rank["flushed"] for rank in saved)
    assert manifest["format_version"] == 5 and manifest[groups.GROUPS_FIELD]["size"] == 1
    assert node0_tables == ["__g0.parts.json", "__g2.parts.json"]  # its own and its peer's: group 1's is elsewhere
    assert object_reads == 0, ranks[0]["restore"]
    assert all(rank["exact"] and rank["step"] == 2 for rank in ranks), ranks
    assert all(f"/node{r}/" in rank["loaded"] for r, rank in enumerate(ranks))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_node_local_v5_group_spanning_two_nodes_writes_its_table_on_both_and_restores_a_lost_one(
    tmp_path_factory, s3_server
):
    """3 nodes of one rank, groups of 2: group 0 (ranks 0 and 1) spans nodes 0 and 1, led by rank 1, so its table is
    written on node 1 by its leader and on node 0 by rank 0 (the leader's copy). Node 1 lost: restored from peers
    with no object read from the durable tier."""
    from tests.conftest import S3_BUCKET
    from tests.helpers.s3_server import FaultProxy

    proxy = FaultProxy(s3_server.host, s3_server.port)
    base = tmp_path_factory.mktemp("node-local-v5-span")
    durable = f"s3://{S3_BUCKET}/node-local-v5-{base.name}"
    options = s3_server.storage_options(proxy.endpoint)
    try:
        saved = [o.value for o in run_ranks(save_v5_with_peers, 3, str(base), durable, options, 1, 2)]
        newest = sorted(p.name for p in (base / "node0").glob("step-*"))[-1]
        manifest = json.loads((base / "node0" / newest / "manifest.json").read_text())
        tables = {node: sorted(p.name for p in (base / node / newest).glob("__g*")) for node in ("node0", "node1")}
        shutil.rmtree(base / "node1")
        proxy.clear()
        ranks = [o.value for o in run_ranks(resume_with_peers, 3, str(base), durable, options, 1, False)]
        object_reads = len(proxy.requests("GET", OBJECT_READ))
        proxy.clear()
        durable_load = [o.value for o in run_ranks(load_resharded, 2, f"{durable}/{newest}", options)]
    finally:
        proxy.stop()
    assert all(rank["flushed"] and rank["durable_flushed"] for rank in saved)
    assert all(rank["counters"].get("peer_replication_failed", 0) == 0 for rank in saved), saved
    assert manifest["format_version"] == 5 and manifest[groups.GROUPS_FIELD]["size"] == 2
    # node 0: group 0's table (the leader's copy: rank 2 on node 2, its only peer source, is not in group 0) and
    # group 1's (rank 2's, a peer copy); node 1: group 0's, its leader's own
    assert tables == {"node0": ["__g0.parts.json", "__g1.parts.json"], "node1": ["__g0.parts.json"]}
    assert object_reads == 0, ranks[0]["restore"]
    assert all(rank["exact"] and rank["step"] == 2 for rank in ranks), ranks
    assert all(rank["exact"] and rank["step"] == 2 for rank in durable_load)  # the durable copy, on 2 ranks


def test_node_local_group_tables_are_copied_to_one_rank_on_each_other_node_their_group_spans():
    """node_groups.py: which rank writes a group's table on each root (the leader's own, else the lowest rank there),
    and which writes the leader's copies."""
    roots = ["a", "a", "b", "b", "c", "c", "a"]  # 3 nodes, the last rank interleaved back onto node a
    assert table_copiers(roots, range(0, 7), leader=6) == [2, 4]  # node a is the leader's own
    assert table_copiers(roots, range(2, 4), leader=3) == []  # a group inside one node: no copy
    assert table_holders(roots, range(1, 5)) == {"a": 1, "b": 2, "c": 4}
    node_local = SaveConfig(node_local=True)
    assert _group_size(node_local, 512) == 128  # v5, the writer's usual groups (main wrote v4 here)
    assert _group_size(node_local, 128) is None  # one group, unsigned: v4, as on a shared root
    assert _group_size(SaveConfig(node_local=True, format_version=4), 512) is None  # format_version 4 gives v4
