"""Issue 47 item 1: a signed run's replicator never re-signs a forgery. Two real gloo ranks commit steps 1-2,
signed, on a fast tier while the durable tier was out of reach (nothing replicated); someone with write access
to the fast tier then forges step 2 (values replaced, every checksum and digest recomputed, the signature left as
it was); the next run's catch-up, signing its durable copies with the same key, must refuse it: the durable tier
never holds it, `shardckpt verify --public-key` of the durable root does not pass it, and a load with
`require_signature` never returns the forged weights.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.collectives import new_checkpoint_group
from lightning_shardckpt.engine.config import LoadConfig, SignConfig
from lightning_shardckpt.engine.load.loader import load_checkpoint
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.engine.tiers.replicate import Replicator, missing_on_durable
from lightning_shardckpt.errors import ShardCkptError
from tests.helpers.forgery import forge_tensor_values, replace_file
from tests.helpers.log_capture import MessageLines
from tests.helpers.spawn import run_ranks, values
from tests.helpers.tiers_ranks import KEYS, state, tiers
from tests.unit.test_signing import make_key

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FORGED_VALUE = 7.0


def save_signed_on_the_fast_tier(rank: int, world_size: int, fast: str, key_path: str) -> None:
    """Steps 1-2 committed and signed on the fast tier; no replicator ran (the durable tier was unreachable)."""
    saver = CheckpointSaver(
        fast, SaveConfig(write_events=False, collective_timeout_s=30.0, sign=SignConfig(key_path=key_path))
    )
    for step in (1, 2):
        assert saver.save(state(step), step=step).result(timeout=60).committed
    saver.close()


def catch_up_signed(rank: int, world_size: int, fast: str, durable: str, key_path: str) -> dict:
    """The next run's catch-up: the newest fast commit the durable tier lacks, copied and signed there."""
    lines = MessageLines()
    logging.getLogger("lightning_shardckpt").addHandler(lines)
    config = tiers(fast, durable, {})
    fast_loc, durable_loc = fsio.resolve(fast), fsio.resolve(durable)
    group = new_checkpoint_group(config.collective_timeout_s)
    catch_up = missing_on_durable(fast_loc, durable_loc, None)
    replicator = Replicator(config, fast_loc, durable_loc, group=group, sign=SignConfig(key_path=key_path))
    replicator.submit(catch_up)
    flushed = replicator.flush(60.0)
    replicator.close(10.0)
    return {"caught_up": catch_up, "flushed": flushed, "counters": replicator.snapshot(), "lines": lines.lines}


def flip_shard_byte(directory: str) -> None:
    """A byte of a shard file changed after commit, the signed manifest untouched: only the digests condemn it."""
    path = os.path.join(directory, "__0_0.distcp")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    replace_file(path, bytes(data))


@pytest.mark.parametrize(
    ("tampering", "why"),
    [
        ("values forged, every checksum recomputed", "does not verify"),  # the signature condemns the manifest
        ("a shard byte changed", "digest differs"),  # the signed digests condemn the file, before any upload
    ],
)
def test_catch_up_of_a_signed_run_never_replicates_or_re_signs_a_forged_fast_copy(tmp_path, run_cli, tampering, why):
    private, public, _ = make_key(tmp_path, "writer")
    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    run_ranks(save_signed_on_the_fast_tier, 2, fast, private)
    fast_loc = fsio.resolve(fast)
    newest = [e for e in catalog.list_checkpoints(fast_loc) if e.committed][-1]
    assert newest.step == 2
    if tampering.startswith("values forged"):
        forge_tensor_values(fast_loc, newest.path, KEYS[0], FORGED_VALUE)
    else:
        flip_shard_byte(newest.path)

    ranks = values(run_ranks(catch_up_signed, 2, fast, durable, private))
    # the durable tier never holds it: nothing of it was uploaded, nothing signed there
    durable_loc = fsio.resolve(durable)
    assert [e.name for e in catalog.list_checkpoints(durable_loc) if e.committed] == []
    assert not durable_loc.fs.exists(f"{durable_loc.path}/{newest.name}")
    code, out, err = run_cli("verify", durable, "--public-key", public)
    assert code != 0, out + err
    config = LoadConfig(require_signature=True, public_keys=(public,))
    target = {key: torch.zeros(4096) for key in KEYS}
    with pytest.raises(ShardCkptError):
        load_checkpoint(target, durable, "latest", config=config)
    assert not torch.equal(target[KEYS[0]], torch.full((4096,), FORGED_VALUE))
    # refused on every rank (counted, never retried), logged with its fast path and why
    for rank in ranks:
        assert rank["caught_up"] == newest.name
        assert rank["counters"].get("replication_refused") == 1, rank["counters"]
        assert rank["counters"].get("replicated", 0) == 0 and rank["counters"].get("replication_failed", 0) == 0
    assert any(f"not replicating {fast}/{newest.name}" in line and why in line for line in ranks[0]["lines"]), ranks[0][
        "lines"
    ]
