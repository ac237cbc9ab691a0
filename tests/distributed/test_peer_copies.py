"""Peer copies of the fast tier on real gloo ranks: 2 simulated nodes × 2 ranks, each node its own root.

One run saves with peer copies on, then three resumes after losing nodes: node 0 lost, resumed on 1 node ×
3 ranks (the survivor's root is on this machine's disk: copied locally); node 1 replaced by an empty one,
resumed on 2 × 2 (its files fetched over the group); node 0 lost again, resumed on 3 nodes × 1 rank (two empty
roots filled over the group); both nodes of the clique lost, resumed from S3. The
durable tier is the loopback S3 server behind a proxy that records every request: the peer path reads no
object from it.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest

from lightning_shardckpt.cli.main import main
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.format.names import checkpoint_dirname
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.policies.health.observe import observe
from tests.helpers.peer_ranks import (
    a_dead_peer_stops_replication,
    exchange_with_a_damaged_range,
    peer_copies_onto_a_full_node_root,
    resume_with_peers,
    rollback_and_damage_on_two_nodes,
    save_with_peers,
)
from tests.helpers.spawn import run_ranks

pytestmark = pytest.mark.timeout(300)

OBJECT_READ = r"/step-\d+-[0-9a-f]+/"  # a GET of an object inside a checkpoint directory (listings carry no key)


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory, s3_server):
    from tests.conftest import S3_BUCKET
    from tests.helpers.s3_server import FaultProxy

    proxy = FaultProxy(s3_server.host, s3_server.port)
    base = tmp_path_factory.mktemp("peers")
    durable = f"s3://{S3_BUCKET}/peers-{base.name}"
    options = s3_server.storage_options(proxy.endpoint)
    out: dict = {"base": base, "durable": durable, "options": options}
    try:
        out["save"] = [o.value for o in run_ranks(save_with_peers, 4, str(base), durable, options, 2)]
        out["after_save"] = {
            node: sorted(p.name for p in (base / node).rglob("*") if p.is_file()) for node in ("node0", "node1")
        }
        out["dirs"] = {node: {p.name for p in (base / node).glob("step-*")} for node in ("node0", "node1")}
        listing = io.StringIO()
        with contextlib.redirect_stdout(listing):
            out["ls_code"] = main(["ls", str(base / "node{node_rank}"), "--json"])
        out["ls"] = json.loads(listing.getvalue())
        out["records"] = {
            str(p.relative_to(base)): json.loads(p.read_text()) for p in sorted(base.glob("node*/peers/*/*.json"))
        }

        def resume(world: int, per_node: int, scan: bool) -> dict:
            proxy.clear()
            values = [o.value for o in run_ranks(resume_with_peers, world, str(base), durable, options, per_node, scan)]
            return {"ranks": values, "object_reads": len(proxy.requests("GET", OBJECT_READ))}

        shutil.rmtree(base / "node0")  # node 0 (with the manifest's original) is lost with its disk
        for step in (97, 98, 99):  # newer saves the crash cut short on the survivor: they must not hide step 3
            cut_short = base / "node1" / checkpoint_dirname(step, f"{step:08x}")
            cut_short.mkdir()
            (cut_short / "__2_0.distcp").write_bytes(b"half a shard")
        out["one_node"] = resume(3, 3, True)
        shutil.rmtree(base / "node1")  # node 1 replaced by an empty one; its files only on node 0, over the group
        out["replaced"] = resume(4, 2, False)
        node1 = fsio.resolve(str(base / "node1"))
        out["replaced"]["node1_committed"] = [e.step for e in catalog.list_checkpoints(node1) if e.committed]
        shutil.rmtree(base / "node0")  # node 0 lost again; now 3 nodes of 1 rank: nodes 0 and 2 start empty
        out["three_nodes"] = resume(3, 1, False)
        shutil.rmtree(base / "node0")
        shutil.rmtree(base / "node1")  # both nodes of the clique lost (node 2 too): only S3 has it
        shutil.rmtree(base / "node2")
        out["clique_lost"] = resume(4, 2, True)
    finally:
        proxy.stop()
    return out


def test_peer_copies_make_each_node_root_hold_the_checkpoint_whole_verified_and_recorded(peer_run):
    for rank in peer_run["save"]:
        assert rank["flushed"]
        counters = rank["counters"]
        assert counters.get("peer_replicated", 0) + counters.get("peer_replication_skipped", 0) == 3
        assert counters.get("peer_replication_failed", 0) == 0 and counters["peer_replication_lag_checkpoints"] == 0
    for node, files in peer_run["after_save"].items():
        # every rank's shard, .metadata and the commit: each node root is a complete checkpoint now
        assert {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", ".metadata", "manifest.json"} <= set(
            files
        ), node
        assert not [name for name in files if name.endswith(".part")]
    records = peer_run["records"]
    # node 1 holds node 0's ranks' files and the other way round (jump = ranks per node: another failure domain)
    assert any(r.startswith("node1/") and r.endswith("from-rank-0.json") for r in records)
    assert any(r.startswith("node0/") and r.endswith("from-rank-3.json") for r in records)
    assert not any(r.startswith("node0/") and r.endswith("from-rank-1.json") for r in records)
    # node 0's retention kept the last 2: node 1's root follows it, peer records included
    assert (
        {r.split("/")[2] for r in records} == {name for name in peer_run["dirs"]["node0"]} == peer_run["dirs"]["node1"]
    )
    assert peer_run["ls_code"] == 0  # `shardckpt ls 'ROOT/node{node_rank}'`: on which nodes each one is complete
    assert [(row["step"], row["complete_on"]) for row in peer_run["ls"]["checkpoints"]] == [(2, [0, 1]), (3, [0, 1])]
    record = records[max(records)]
    assert record["verified"] and record["files"] and record["from_root"].endswith("node0")


def test_node_lost_resumes_on_one_node_of_three_ranks_bit_exact_from_the_survivors_copy(peer_run):
    """...past three newer saves the crash cut short on the survivor (directories without a manifest)."""
    run = peer_run["one_node"]
    assert run["object_reads"] == 0  # not one object read from the durable tier
    for rank in run["ranks"]:
        assert rank["exact"] and rank["step"] == 3
        assert "/node0/" in rank["path"]  # the new node's own root, assembled from the survivor's (node1) root
    restore = run["ranks"][0]["restore"]
    assert restore["copied_locally"] > 0 and restore["fetched"] == 0


def test_replaced_node_fetches_its_files_over_the_group_bit_exact_without_the_durable_tier(peer_run):
    run = peer_run["replaced"]
    assert run["object_reads"] == 0
    assert all(rank["exact"] and rank["step"] == 3 for rank in run["ranks"])
    # each rank read its own node's root (another node's disk is not there on a real cluster)
    assert [f"/node{r // 2}/" in rank["loaded"] for r, rank in enumerate(run["ranks"])] == [True] * 4, run["ranks"]
    restore = run["ranks"][2]["restore"]
    assert restore["fetched"] > 0 and restore["copied_locally"] == 0  # scan_local_roots off: only the group
    assert run["node1_committed"] == [3]  # the replacement node's root holds the checkpoint committed again


def test_three_nodes_of_one_rank_resume_with_two_empty_roots_filled_over_the_group(peer_run):
    run = peer_run["three_nodes"]
    assert run["object_reads"] == 0
    assert all(rank["exact"] and rank["step"] == 3 for rank in run["ranks"])
    assert [f"/node{r}/" in rank["loaded"] for r, rank in enumerate(run["ranks"])] == [True] * 3, run["ranks"]
    assert run["ranks"][0]["restore"]["fetched"] > 0  # bytes all ranks received over the group


def test_clique_lost_resumes_from_the_durable_tier_with_the_reason(peer_run):
    run = peer_run["clique_lost"]
    assert all(rank["exact"] and rank["step"] == 3 for rank in run["ranks"])
    assert all(rank["path"].startswith(peer_run["durable"]) for rank in run["ranks"])
    assert run["object_reads"] > 0
    assert "no fast-tier checkpoint survives" in run["ranks"][0]["restore"]["reason"]


def test_a_peer_copy_is_checked_as_it_arrives_and_a_damaged_one_never_lands(tmp_path):
    outcomes = [o.value for o in run_ranks(exchange_with_a_damaged_range, 2, str(tmp_path))]
    assert outcomes[1] == {"problems": [], "received": True, "part_left": False}  # whole and good: renamed in
    assert outcomes[0]["received"] is None and not outcomes[0]["part_left"]  # nothing under the name, no .part
    assert "bytes 2000..4000 have checksum" in outcomes[0]["problems"][0]


def test_commits_after_peer_replication_stopped_are_reported_as_failed_copies_with_growing_lag(tmp_path):
    """A dead rank stops the replicator's thread for the rest of the run; the health rule must still see the newest
    checkpoints pile up without a peer copy (it watches `peer_replication_lag_checkpoints`)."""
    outcomes = run_ranks(a_dead_peer_stops_replication, 2, str(tmp_path), allow_failures=True, pg_timeout_s=15.0)
    assert outcomes[0].ok, outcomes[0].error
    result = outcomes[0].value
    assert result["broken"] and result["stopped"]
    events = result["events"]
    assert events[0]["outcome"] == "committed" and events[0]["lag_checkpoints"] == 0
    stopped = [e for e in events[1:] if (e["cause"] or "").startswith("peer replication stopped")]
    assert [(e["outcome"], e["lag_checkpoints"]) for e in stopped] == [("failed", 2), ("failed", 3)], events
    seen = [(o.metric, o.value) for e in stopped for o in observe(e)]
    assert ("peer_replication_lag_checkpoints", 3.0) in seen and ("peer_replication_ok", 0.0) in seen


def test_a_peer_copy_onto_a_full_node_root_fails_cleanly_and_training_saves_on(tmp_path):
    """ENOSPC on the receiving node (a real 1 MiB tmpfs): that copy fails with the cause, nothing half-written stays
    under the peer's name, the owner's checkpoints commit, and the replicator copies the next commit (not stopped)."""
    from tests.helpers.full_disk import mounted_tmpfs

    try:
        with mounted_tmpfs(tmp_path / "node1", "1m"):
            outcomes = run_ranks(peer_copies_onto_a_full_node_root, 2, str(tmp_path))
            leftovers = sorted(p.name for p in (tmp_path / "node1").rglob("*") if p.name.startswith("__0_"))
    except PermissionError as err:
        pytest.skip(str(err))
    owner, peer = (o.value for o in outcomes)
    assert owner["committed"] == [True, True] and peer["committed"] == [True, True]
    assert not owner["broken"] and not peer["broken"]  # a failed copy, not a dead replicator
    assert [e["outcome"] for e in owner["events"]] == ["failed", "failed"], owner["events"]
    assert all("No space left" in (e["cause"] or "") for e in owner["events"]), owner["events"]
    assert owner["counters"]["peer_replication_failed"] == 2
    assert leftovers == []  # neither rank 0's shard nor its .part on the full node


def test_peer_copies_follow_commit_order_repair_a_damaged_file_and_skip_a_corrupt_directory(tmp_path):
    """Issue 37 items 1, 2, 7 (tests/helpers/peer_ranks.py rollback_and_damage_on_two_nodes says how)."""
    ranks = [o.value for o in run_ranks(rollback_and_damage_on_two_nodes, 4, str(tmp_path), timeout_s=280)]
    for rank in ranks:
        # a step only the durable tier still holds resolves there (item 7)
        assert rank["rolled_back_to"] == 4 and rank["rolled_back_from"] == "durable tier"
        # newest means newest commit: the rollback's step 6, not the abandoned branch's step 12 (item 1)
        assert rank["after_rollback"]["step"] == 6 and rank["after_rollback"]["exact"], rank["after_rollback"]
        # a damaged fast file is replaced from an intact peer copy and the fast copy loads; a corrupt
        # directory (seq "x") is skipped, not fatal (item 2)
        assert rank["after_damage"] == {**rank["after_damage"], "step": 6, "exact": True, "source": "fast tier"}


def test_a_node_root_that_is_a_symlink_to_another_is_warned_at_setup_and_never_counted_as_a_copy(tmp_path):
    """Node 1's root is node 0's under another name: peer copies "to node 1" would land where the files already are,
    and peer records would claim a second copy that does not exist."""
    from tests.helpers.peer_ranks import save_onto_an_aliased_node_root

    (tmp_path / "node0").mkdir()
    (tmp_path / "durable").mkdir()
    (tmp_path / "node1").symlink_to(tmp_path / "node0")
    outcomes = [
        o.value for o in run_ranks(save_onto_an_aliased_node_root, 4, str(tmp_path), str(tmp_path / "durable"), {}, 2)
    ]
    warned = outcomes[0]["warned"]
    assert any(f"{tmp_path}/node1 is the same storage as {tmp_path}/node0" in message for message in warned), warned
    assert all(not o["warned"] for o in outcomes[1:])  # said once, by the coordinator
    assert list(tmp_path.glob("node*/peers/*/*.json")) == []  # no record claims a copy
    assert list(tmp_path.glob("node0/peers/.root-probe-*")) == []  # the setup's markers are gone
    events = outcomes[0]["events"]
    assert events and all(event["complete_on"] == [f"{tmp_path}/node0"] for event in events), events
    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):
        assert main(["ls", str(tmp_path / "node{node_rank}"), "--json"]) == 0
    rows = json.loads(listing.getvalue())["checkpoints"]
    assert {row["step"]: row["complete_on"] for row in rows} == {1: [0], 2: [0], 3: [0]}  # not on node 1 too


def test_a_node_root_that_is_node_0s_under_another_name_never_prunes_what_node_0_keeps(tmp_path):
    """Nodes other than 0 prune their node-local roots to their newest few; node 1's root being node 0's under a
    symlink, that pruning deleted node 0's milestones (keep_every_n_steps) that node 0's retention keeps."""
    from tests.helpers.peer_ranks import milestones_on_an_aliased_node_root

    (tmp_path / "node0").mkdir()
    (tmp_path / "durable").mkdir()
    (tmp_path / "node1").symlink_to(tmp_path / "node0")
    outcomes = run_ranks(milestones_on_an_aliased_node_root, 4, str(tmp_path), str(tmp_path / "durable"), {}, 2)
    assert outcomes[0].value == [2, 4, 5]  # every 2nd step and the newest, as node 0's retention keeps them
