"""Lightning's own conventions, compared with plain Lightning (DDPStrategy + its checkpoint file) on the
same world size, or with an uninterrupted run."""

from __future__ import annotations

import torch

from tests.helpers.lightning_conventions import rank_sources_on_rank
from tests.helpers.spawn import run_ranks


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_state_that_differs_per_rank_is_restored_from_rank_0_like_plain_lightning(tmp_path):
    outcomes = [o.value for o in run_ranks(rank_sources_on_rank, 2, str(tmp_path), timeout_s=240)]
    running = "net.1.running_mean", "net.1.running_var"
    for name in running:  # the premise: each rank's BatchNorm statistics are its own
        assert not torch.equal(outcomes[0]["saved_sharded"][name], outcomes[1]["saved_sharded"][name])
    rank0 = outcomes[0]["saved_sharded"]
    assert _equal(rank0, outcomes[0]["saved_plain"])  # the two runs trained alike
    for rank, outcome in enumerate(outcomes):
        assert _equal(outcome["plain"]["model"], rank0), f"plain Lightning restores rank 0's state (rank {rank})"
        assert _equal(outcome["sharded"]["model"], rank0), f"rank {rank} restored buffers no rank had at the save"
        assert outcome["plain"]["extra"] == outcome["sharded"]["extra"] == 0  # on_save_checkpoint extras: rank 0's
        assert outcome["plain"]["callback"] == outcome["sharded"]["callback"] == {"rank": 0}
