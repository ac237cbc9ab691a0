"""A signed run on format v5 (FORMAT.md §12.2) through the tiers: two real gloo ranks in groups of one commit signed
v5 checkpoints on a fast tier; the next run's catch-up checks each rank's files against the signed chain (group
table, part, chunk digests) before it copies and signs them on the durable tier, where they verify and resume
under require_signature; a shard byte changed on the fast tier is refused there and never reaches the durable tier.
"""

from __future__ import annotations

import os

import pytest
import torch

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.config import LoadConfig
from lightning_shardckpt.engine.format import groups
from lightning_shardckpt.engine.load.loader import load_checkpoint
from lightning_shardckpt.engine.storage import fsio
from tests.distributed.test_signed_tier_catch_up import catch_up_signed, flip_shard_byte, save_signed_on_the_fast_tier
from tests.helpers.spawn import run_ranks, values
from tests.helpers.tiers_ranks import KEYS, state
from tests.unit.test_signing import make_key

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def save_signed_v5(rank: int, world_size: int, fast: str, key_path: str) -> None:
    os.environ[groups.GROUP_SIZE_ENV] = "1"  # 2 ranks, 2 groups: the writer goes v5 (this rank process only)
    save_signed_on_the_fast_tier(rank, world_size, fast, key_path)


@pytest.mark.parametrize("tampered", [False, True])
def test_a_signed_v5_run_catches_up_to_the_durable_tier_checked_by_its_chunk_digests(tmp_path, run_cli, tampered):
    private, public, _ = make_key(tmp_path, "writer")
    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    run_ranks(save_signed_v5, 2, fast, private)
    newest = [e for e in catalog.list_checkpoints(fsio.resolve(fast)) if e.committed][-1]
    assert newest.manifest["format_version"] == 5 and groups.is_signed(newest.manifest)
    if tampered:
        flip_shard_byte(newest.path)

    ranks = values(run_ranks(catch_up_signed, 2, fast, durable, private))
    durable_loc = fsio.resolve(durable)
    copied = [e.name for e in catalog.list_checkpoints(durable_loc) if e.committed]
    code, out, err = run_cli("verify", durable, "--public-key", public)
    if tampered:
        assert copied == [] and code != 0, (copied, out + err)
        assert all(rank["counters"].get("replication_refused") == 1 for rank in ranks), ranks
        return
    assert copied == [newest.name] and code == 0, (copied, out + err)
    target = {key: torch.zeros(4096) for key in KEYS}
    config = LoadConfig(require_signature=True, public_keys=(public,))
    assert load_checkpoint(target, durable, "latest", config=config).step == 2
    expected = state(2)
    assert all(torch.equal(target[key], expected[key]) for key in KEYS)
