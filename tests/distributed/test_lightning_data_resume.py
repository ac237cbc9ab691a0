"""Through Lightning's own sampler injection: stop mid-epoch on 4 ranks, finish on 3 or 2, every sample once."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.lightning_run import ids_on_rank
from tests.helpers.spawn import run_ranks


@pytest.mark.parametrize("resume_on", [3, 2])
def test_resumed_epoch_on_another_world_size_sees_every_sample_exactly_once(tmp_path, resume_on):
    root, size = str(tmp_path / "ckpt"), 92  # 4 ranks x 2 steps x 4 = 32 consumed; 60 left divide by 3 and 2
    first = run_ranks(ids_on_rank, 4, root, size, 2, None)
    assert catalog.find(fsio.resolve(root), "latest").step == 2
    second = run_ranks(ids_on_rank, resume_on, root, size, -1, "latest")
    counts = collections.Counter(i for o in first + second for i in o.value["seen"])
    missing = sorted(set(range(size)) - set(counts))
    repeated = sorted(i for i, c in counts.items() if c > 1)
    assert not missing and not repeated, f"missing {missing}, repeated {repeated}"
    assert second[0].value["global_step"] == 2 + math.ceil((size - 32) / resume_on / 4)  # the rest of the epoch
    for rank in range(resume_on):  # rank r continues saved rank r's generator (the rule in data.py)
        saved = first[rank].value["rng_at_step"][2]
        assert torch.equal(second[rank].value["rng_at_first_batch"], saved), f"rank {rank} RNG not restored"


def test_with_gradient_accumulation_only_applied_batches_count_as_consumed(tmp_path):
    # 2 batches per optimizer step: stop after 1 step (2 batches per rank = 32 samples), finish on 3 ranks
    root, size = str(tmp_path / "ckpt"), 92
    first = run_ranks(ids_on_rank, 4, root, size, 1, None, 2)
    assert catalog.find(fsio.resolve(root), "latest").step == 1
    second = run_ranks(ids_on_rank, 3, root, size, -1, "latest", 2)
    counts = collections.Counter(i for o in first + second for i in o.value["seen"])
    assert sorted(counts) == list(range(size)) and set(counts.values()) == {1}
