"""Once every rank saw a save fail, the coordinator removes that attempt's directory (real gloo ranks).

The disk is real and shared by the ranks: a quota:// root (tests/helpers/quota_fs.py) whose budget
counts every file under it, as one small volume would. It has room for two checkpoints. A file that
is not ours fills it for a while; the save in that window fails on the ranks that run out of space,
DCP's collective verdict tells every rank, and rank 0 removes the partial directory. Left behind
(before), that partial directory took the room the next save needed, so it failed as well.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from lightning_shardckpt.engine.config import SaveConfig
from lightning_shardckpt.engine.save.saver import CheckpointSaver
from tests.helpers import quota_fs
from tests.helpers.spawn import run_ranks

WORLD = 2
RANK_BYTES = 256 * 1024  # each rank writes its own 256 KiB tensor: ~525 KB a checkpoint

pytestmark = pytest.mark.timeout(120)


def _state(rank: int, step: int) -> dict:
    return {f"rank{rank}": torch.full((RANK_BYTES // 4,), float(step))}  # a key per rank: each writes its own


def transient_disk_full_worker(rank: int, world_size: int, disk: str) -> dict:
    checkpoint_bytes = 2 * RANK_BYTES + 4096
    options = quota_fs.quota_options(disk, int(2.3 * checkpoint_bytes))
    saver = CheckpointSaver(quota_fs.quota_url(os.path.join(disk, "root")), SaveConfig(storage_options=options))
    first = saver.save(_state(rank, 1), step=1).result(timeout=60)
    ballast = os.path.join(disk, "someone-elses-file")
    if rank == 0:
        with open(ballast, "wb") as handle:
            handle.write(b"\0" * int(0.9 * checkpoint_bytes))
    dist.barrier()
    failed = saver.save(_state(rank, 2), step=2).result(timeout=60)
    dist.barrier()
    if rank == 0:
        os.unlink(ballast)
    dist.barrier()
    later = saver.save(_state(rank, 3), step=3).result(timeout=60)
    saver.close()
    return {
        "first": first.committed,
        "failed": failed.committed,
        "failed_error": str(failed.error),
        "failed_path": failed.path,
        "cleanup": failed.cleanup,
        "later": later.committed,
        "later_error": str(later.error),
        "notes": saver.counters.notes(),
    }


def test_the_coordinator_removes_a_failed_attempt_every_rank_saw_fail_and_the_next_save_commits(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    outcomes = [o.value for o in run_ranks(transient_disk_full_worker, WORLD, str(disk))]
    for rank, outcome in enumerate(outcomes):
        assert outcome["first"] and not outcome["failed"], (rank, outcome)
        assert "No space left on device" in outcome["failed_error"], (rank, outcome)
        assert outcome["later"], (rank, outcome["later_error"])
    attempt = outcomes[0]["failed_path"].rstrip("/").rsplit("/", 1)[-1]
    assert not (disk / "root" / attempt).exists(), f"{attempt} was left behind"
    assert outcomes[0]["cleanup"] == "removed" and outcomes[0]["notes"] == {"failed_dirs_removed": 1}
    assert outcomes[1]["cleanup"] is None and outcomes[1]["notes"] == {}  # only the coordinator removes
