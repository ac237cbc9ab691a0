"""Issue 39 with peer copies (`tiers.fast.peers`): the peer restore, which picks what to assemble before the tier
choice, honours the resume's signature policy too. 2 real gloo ranks as 2 simulated nodes of 1 rank, each with its
own node root, peer copies on and a durable tier on local disk (every commit copied, re-signed there): a signed run
saves steps 1-3; node 1 is then replaced by an empty one, step 3 is forged on node 0 (values replaced, every
checksum and digest recomputed) and left unsigned on the durable tier. The resume with `require_signature` assembles
step 2 in the new node's root from node 0's copy (never the forged step 3), loads it bit-exact, and names step 3 as
passed over."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.collectives import new_checkpoint_group
from lightning_shardckpt.engine.config import LoadConfig, SignConfig
from lightning_shardckpt.engine.format import signing
from lightning_shardckpt.engine.format.names import join
from lightning_shardckpt.engine.load.loader import load_checkpoint
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.policies.tiers.checkpoint_tiers import CheckpointTiers
from tests.helpers.forgery import forge_tensor_values
from tests.helpers.peer_ranks import KEYS, one_rank_per_node, state
from tests.helpers.spawn import run_ranks, values
from tests.unit.test_signing import make_key

pytestmark = pytest.mark.timeout(300)


def save_signed_with_peers(rank: int, world_size: int, base: str, key_path: str) -> None:
    tiers = CheckpointTiers(one_rank_per_node(base), rank, 0)
    sign = SignConfig(key_path=key_path)
    saver = CheckpointSaver(
        tiers.fast_dirpath, SaveConfig(write_events=False, collective_timeout_s=30.0, node_local=True, sign=sign)
    )
    tiers.start(saver, saver.run_id, allow_shared_root=False, is_global_zero=rank == 0)
    for step in (1, 2, 3):
        saver.save(state(step), step=step, identical=lambda key: True)
        saver.wait()
    assert tiers.peer_replicator.flush(60.0)
    tiers.close(60.0)
    saver.close()


def resume_signed_with_peers(rank: int, world_size: int, base: str, public_key: str) -> dict[str, Any]:
    tiers = CheckpointTiers(one_rank_per_node(base), rank, 0)
    group = new_checkpoint_group(30.0)
    try:
        picked = tiers.pick("latest", LoadConfig(require_signature=True, public_keys=[public_key]), group)
    except Exception as err:  # noqa: BLE001 - the error is the answer
        return {"error": f"{type(err).__name__}: {err}"}
    target = {key: torch.zeros(2048) for key in KEYS}
    result = load_checkpoint(target, picked.path, config=picked.config, process_group=group)
    expected = state(result.step)
    return {
        "path": picked.path,
        "loaded": result.path,
        "step": result.step,
        "exact": all(torch.equal(target[key], expected[key]) for key in KEYS),
        "skipped": list(picked.signature_skipped),
        "assembled": tiers.peer_restore.name,
        "peer_refused": sorted(tiers.peer_restore.refused),
    }


def test_peer_restore_passes_over_a_forged_newest_checkpoint_and_assembles_the_newest_validly_signed(tmp_path):
    private, public, _ = make_key(tmp_path, "writer")
    base = tmp_path / "roots"
    (base / "durable").mkdir(parents=True)  # a local durable root exists before the run, as a bucket does
    run_ranks(save_signed_with_peers, 2, str(base), private, timeout_s=180)
    node0 = fsio.resolve(str(base / "node0"))
    names = {e.step: e.name for e in catalog.list_checkpoints(node0) if e.committed}
    assert sorted(names) == [1, 2, 3]
    durable = fsio.resolve(str(base / "durable"))
    assert catalog.read_latest_pointer(durable) == names[3]  # the durable tier's latest: the forged one's name
    shutil.rmtree(base / "node1")  # node 1 replaced by an empty one: whatever resumes is assembled there
    forge_tensor_values(node0, join(node0.path, names[3]), KEYS[0], 7.0)
    os.remove(join(durable.path, names[3], signing.SIGNATURE))

    ranks = values(run_ranks(resume_signed_with_peers, 2, str(base), public, timeout_s=180))
    for rank, result in enumerate(ranks):
        assert "error" not in result, result
        assert result["step"] == 2 and result["exact"], result
        assert result["assembled"] == names[2] and result["peer_refused"] == [names[3]]
        assert f"/node{rank}/" in result["loaded"]  # each rank read its own node's root
        assert result["skipped"] == [names[3]]
    # the forged checkpoint was never copied into the new node's root
    assert not (base / "node1" / names[3]).exists()
