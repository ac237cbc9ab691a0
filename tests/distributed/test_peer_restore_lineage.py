"""Issue 47 with peer copies (`tiers.fast.peers`): the peer restore decides whether to read the durable tier beside
the checkpoint it assembles, and that decision goes by the durable tier's newest commit, never by its bare `latest`
pointer. 2 real gloo ranks as 2 simulated nodes of 1 rank, each with its own node root, a durable tier on local disk
(every commit copied): steps 1-3 are saved; then step 4 of the same run commits on the durable tier only (as degraded
mode commits there) and its `latest` update is lost (the pointer still names step 3). The resume loads step 4."""

from __future__ import annotations

import os
from typing import Any

import pytest

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.collectives import new_checkpoint_group
from lightning_shardckpt.engine.config import LoadConfig
from lightning_shardckpt.engine.format.names import LATEST, join
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.policies.tiers.checkpoint_tiers import CheckpointTiers
from tests.helpers.peer_ranks import one_rank_per_node, state
from tests.helpers.spawn import run_ranks, values

pytestmark = pytest.mark.timeout(300)


def save_with_peers(rank: int, world_size: int, base: str) -> None:
    tiers = CheckpointTiers(one_rank_per_node(base), rank, 0)
    saver = CheckpointSaver(
        tiers.fast_dirpath, SaveConfig(write_events=False, collective_timeout_s=30.0, node_local=True)
    )
    tiers.start(saver, saver.run_id, allow_shared_root=False, is_global_zero=rank == 0)
    for step in (1, 2, 3):
        saver.save(state(step), step=step, identical=lambda key: True)
        saver.wait()
    assert tiers.peer_replicator.flush(60.0)
    tiers.close(60.0)
    saver.close()


def resume_latest_with_peers(rank: int, world_size: int, base: str) -> dict[str, Any]:
    tiers = CheckpointTiers(one_rank_per_node(base), rank, 0)
    picked = tiers.pick("latest", LoadConfig(), new_checkpoint_group(30.0))
    return {"path": picked.path, "assembled": tiers.peer_restore.name}


def test_a_newer_durable_commit_behind_a_stale_latest_is_resumed_not_the_assembled_peer_copy(tmp_path):
    base = tmp_path / "roots"
    (base / "durable").mkdir(parents=True)
    run_ranks(save_with_peers, 2, str(base), timeout_s=180)
    durable = fsio.resolve(str(base / "durable"))
    copied = [e for e in catalog.list_checkpoints(durable) if e.committed]
    assert [e.step for e in copied] == [1, 2, 3]
    run_id = copied[-1].run_id
    saver = CheckpointSaver(durable.path, SaveConfig(async_save=False, write_events=False, run_id=run_id))
    newer = saver.save(state(4), step=4).result(timeout=60)
    saver.close()
    assert newer.committed, newer.error
    with open(os.path.join(durable.path, LATEST), "w") as pointer:  # its update lost: `latest` still names step 3
        pointer.write(copied[-1].name + "\n")

    for result in values(run_ranks(resume_latest_with_peers, 2, str(base), timeout_s=180)):
        assert result["assembled"] == copied[-1].name  # the peers hold step 3 whole
        assert result["path"] == join(durable.url, newer.path.rsplit("/", 1)[-1]), result  # yet step 4 is newer
