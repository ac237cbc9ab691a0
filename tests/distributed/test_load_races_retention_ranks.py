"""On two real ranks: a load whose checkpoint another job's retention deletes mid-read (issue 9, item 7).

Rank 0 plans its share, then, before it opens the first shard file, the other job (a separate process) commits
step 4 and applies keep_last=1, deleting the checkpoint being loaded. (Rank 0 opens the first shard file: it reads
the objects and small replicated tensors for every rank, engine/load/shared_reads.py.) Every rank must agree: deleted, not corrupt, and
`latest` loads step 4 on both; an explicit step raises CheckpointDeleted on both.
"""

from __future__ import annotations

import os
import subprocess
import sys

from lightning_shardckpt import load_checkpoint
from lightning_shardckpt.engine.storage.chunk_reads import ShardFile
from lightning_shardckpt.errors import CheckpointDeleted
from tests.helpers.spawn import run_ranks
from tests.unit.test_retention_lineage import save, state

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _other_job(root: str) -> None:
    code = (
        "from tests.unit.test_load_races_retention import other_job_commits_and_retains; "
        f"other_job_commits_and_retains({root!r}, 4)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def _load_racing_retention_on_rank(rank: int, world_size: int, root: str, which) -> dict:
    real = ShardFile.__init__
    fired: list[bool] = []

    def race_then_open(self, *args, **kwargs):
        if rank == 0 and not fired:
            fired.append(True)
            _other_job(root)
        real(self, *args, **kwargs)

    ShardFile.__init__ = race_then_open
    target = state(0)
    try:
        result = load_checkpoint(target, root, which)
    except CheckpointDeleted as err:
        return {"deleted": str(err)}
    return {"step": result.step, "weights": float(target["weights"][0])}


def test_latest_deleted_mid_load_re_resolves_on_every_rank(tmp_path):
    root = str(tmp_path / "run")
    for step in (1, 2, 3):
        save(root, step)
    outcomes = run_ranks(_load_racing_retention_on_rank, 2, root, "latest", timeout_s=240)
    assert [o.value for o in outcomes] == [{"step": 4, "weights": 4.0}] * 2


def test_an_explicit_step_deleted_mid_load_is_reported_deleted_on_every_rank(tmp_path):
    root = str(tmp_path / "run")
    for step in (1, 2, 3):
        save(root, step)
    outcomes = run_ranks(_load_racing_retention_on_rank, 2, root, 2, timeout_s=240)
    for outcome in outcomes:
        assert "was deleted while it was being loaded" in outcome.value["deleted"], outcome.value
