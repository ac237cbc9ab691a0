"""All three of issue 46's features together on 32 gloo ranks: signed (resumed under require_signature), incremental
and node-local with peer copies, in groups forced small (4 nodes of 8 ranks, groups of 8), a node lost, resumed on 7
ranks bit-exact.

Step 6 is full; step 7 references the tensors that did not change (layers 00-05, the replicated scalar) in step 6's
files, each rank its own, on its own node. Peer copies carry them to the next node (engine/tiers/referenced_files.py);
node 1's root is then removed, and a world of 7 ranks (4 nodes of 2, node 3 of 1) assembles step 7 and the step-6
files it references in every node root from the survivors' copies, checks the signature, and loads it bit-exact.
"""

from __future__ import annotations

import os
import shutil

import pytest

from lightning_shardckpt import CheckpointSaver, LoadConfig, SaveConfig, SignConfig, load_checkpoint
from lightning_shardckpt.engine.collectives import new_checkpoint_group
from lightning_shardckpt.engine.format import groups
from lightning_shardckpt.engine.tiers.config import PeersConfig, TierConfig, TiersConfig
from lightning_shardckpt.policies.tiers.checkpoint_tiers import CheckpointTiers
from tests.helpers.row_sharded import loaded_exactly, row_sharded_state
from tests.helpers.signing_keys import Keys
from tests.helpers.spawn import run_ranks

SAVED_ON, PER_NODE, GROUP = 32, 8, 8
LOADED_ON, LOADED_PER_NODE = 7, 2


def _tiers(base: str, per_node: int) -> TiersConfig:
    return TiersConfig(
        fast=TierConfig(
            dirpath=f"{base}/node{{node_rank}}", peers=PeersConfig(factor=2, jump=per_node, scan_local_roots=False)
        ),
        collective_timeout_s=120.0,
    )


def save_all_three(rank: int, world_size: int, base: str, key_path: str) -> dict | None:
    os.environ[groups.GROUP_SIZE_ENV] = str(GROUP)  # this rank process only (a tests-only variable)
    tiers = CheckpointTiers(_tiers(base, PER_NODE), rank // PER_NODE, rank % PER_NODE)
    config = SaveConfig(
        async_save=False,
        write_events=False,
        collective_timeout_s=120,
        incremental=True,
        node_local=True,
        sign=SignConfig(key_path=key_path),
    )
    saver = CheckpointSaver(tiers.fast_dirpath, config)
    tiers.start(saver, saver.run_id, allow_shared_root=False, is_global_zero=rank == 0)
    state = row_sharded_state(rank, world_size, zeros=False, note="all-three")
    later = {name: value for name, value in state["model"].items() if name[:7] >= "layer06" and name != "step"}
    saved = {name: value.to_local().clone() for name, value in later.items()}
    for value in later.values():
        value.to_local().zero_()
    first = saver.save(state, step=6).result(timeout=120)
    assert tiers.peer_replicator.flush(120.0)
    for name, value in later.items():
        value.to_local().copy_(saved[name])  # in place: the tracker sees these changed, layers 00-05 not
    second = saver.save(state, step=7).result(timeout=120)
    flushed = tiers.peer_replicator.flush(120.0)
    counters = tiers.counters()
    tiers.close(120.0)
    saver.close()
    assert first.committed and second.committed, (first.error, second.error)
    return {"manifest": second.manifest, "flushed": flushed, "counters": counters} if rank == 0 else None


def resume_on_7(rank: int, world_size: int, base: str, public_key: str) -> dict:
    tiers = CheckpointTiers(_tiers(base, LOADED_PER_NODE), rank // LOADED_PER_NODE, rank % LOADED_PER_NODE)
    group = new_checkpoint_group(120.0)
    policy = LoadConfig(require_signature=True, public_keys=[public_key])
    path, load_config, *_ = tiers.pick("latest", policy, group)
    state = row_sharded_state(rank, world_size, zeros=True, note="all-three")
    result = load_checkpoint(state, path, config=load_config, process_group=group)
    exact = loaded_exactly(state)
    return {
        "step": result.step,
        "loaded": result.path,
        "exact": exact,
        "scalar": int(state["model"]["step"]),
        "progress": state["progress"],
        "restored": tiers.peer_restore.name if tiers.peer_restore else None,
        "fetched": tiers.peer_restore.fetched if tiers.peer_restore else 0,
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_signed_incremental_node_local_saved_on_32_ranks_with_a_node_lost_resumes_on_7_bit_exact(tmp_path):
    keys = Keys.make(tmp_path)
    base = tmp_path / "fast"
    saved = run_ranks(save_all_three, SAVED_ON, str(base), keys.private, timeout_s=600, pg_timeout_s=120)[0].value

    manifest = saved["manifest"]
    assert saved["flushed"] and saved["counters"].get("peer_replication_failed", 0) == 0, saved["counters"]
    assert manifest["format_version"] == 5 and manifest["groups"]["size"] == GROUP
    assert len(manifest["groups"][groups.TABLE_DIGESTS]) == 64 * (SAVED_ON // GROUP)  # signed: tables bound
    [references] = manifest["references"]  # step 6's files of all 32 ranks, each read by its own rank's part
    assert references["ranks"] == [[0, SAVED_ON - 1]]
    step6 = references["dir"]
    # node 2 holds node 1's peer copies: step 7's files and the step-6 files they reference
    assert {f"__{r}_0.distcp" for r in range(8, 16)} <= {p.name for p in (base / "node2" / step6).iterdir()}

    shutil.rmtree(base / "node1")  # node 1 is lost: its own files and its copies of node 0's
    loaded = [o.value for o in run_ranks(resume_on_7, LOADED_ON, str(base), keys.public, timeout_s=600)]
    assert all(r["step"] == 7 and r["exact"] and r["scalar"] == 7 for r in loaded), loaded
    assert all(r["progress"] == {"global_step": 7, "note": "all-three"} for r in loaded)
    assert all(r["restored"] == os.path.basename(r["loaded"]) for r in loaded)  # from the peer copies
    assert loaded[0]["fetched"] > 0
    for node in range(4):  # every node root of the new world holds the step-6 files step 7 reads
        assert {f"__{r}_0.distcp" for r in range(SAVED_ON)} <= {
            p.name for p in (base / f"node{node}" / step6).iterdir()
        }
