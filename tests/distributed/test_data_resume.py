"""Real gloo ranks: 4 ranks train on part of an epoch through a DataLoader over our sampler, stop, and
the epoch is finished on 3 ranks and on 2: the samples trained on are the dataset exactly once, and
every rank's RNG stream continues where it stopped."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_shardckpt.training.data import (
    ResumableDistributedSampler,
    gather_rng_states,
    restore_rng_state,
    rng_state_for_rank,
)
from tests.helpers.spawn import run_ranks

SAMPLES = 101  # prime: uneven per-rank streams on every world size
BATCH = 4
STEPS_BEFORE_STOP = 5


class Ids(Dataset):
    """Item i is i: what a rank trained on is what its batches hold."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> int:
        return index


def _loader(sampler):
    return DataLoader(Ids(), batch_size=BATCH, sampler=sampler)


def _trained(batches: list[list[int]], sampler, stream_length: int) -> list[int]:
    """Sample ids of the batches trained on, without the rank's padding sample (a repeat).

    `stream_length` is this pass's (`num_samples`): `len(sampler)` is the whole epoch's, which Lightning sizes by.
    """
    ids = [i for batch in batches for i in batch]
    real = stream_length - sampler.num_padded
    return ids[:real]


def first_run(rank, world_size):
    sampler = ResumableDistributedSampler(Ids(), shuffle=True, seed=11)  # rank and world from the process group
    sampler.set_epoch(0)
    batches = []
    for step, batch in enumerate(_loader(sampler)):
        if step == STEPS_BEFORE_STOP:
            break  # the loader may have fetched ahead; only trained batches are marked
        batches.append(batch.tolist())
        sampler.mark_consumed(1, BATCH)
    torch.manual_seed(100 + rank)
    rng_states = gather_rng_states()
    next_draw = torch.rand(2).tolist()
    return {
        "trained": _trained(batches, sampler, sampler.num_samples),
        "state": sampler.state_dict(),
        "rng": rng_states,
        "next_draw": next_draw,
    }


def resumed_run(rank, world_size, state, rng_states):
    sampler = ResumableDistributedSampler(Ids(), shuffle=True, seed=11)
    sampler.load_state_dict(state)
    sampler.set_epoch(state["epoch"])  # what Lightning does at the start of the resumed epoch: keeps the position
    restore_rng_state(rng_state_for_rank(rng_states, rank))
    draw = torch.rand(2).tolist()
    batches = []
    for batch in _loader(sampler):
        batches.append(batch.tolist())
        sampler.mark_consumed(1, BATCH)
    return {"trained": _trained(batches, sampler, sampler.num_samples), "state": sampler.state_dict(), "draw": draw}


@pytest.fixture(scope="module")
def stopped_mid_epoch():
    outcomes = [o.value for o in run_ranks(first_run, 4)]
    states = [o["state"] for o in outcomes]
    assert all(s == states[0] for s in states), "ranks disagree on the sampler state"
    assert states[0]["global_position"] == STEPS_BEFORE_STOP * BATCH * 4
    return outcomes


@pytest.mark.parametrize("resumed_on", [3, 2])
def test_epoch_stopped_on_4_ranks_and_finished_on_fewer_trains_every_sample_once(stopped_mid_epoch, resumed_on):
    state, rng_states = stopped_mid_epoch[0]["state"], stopped_mid_epoch[0]["rng"]
    resumed = [o.value for o in run_ranks(resumed_run, resumed_on, state, rng_states)]
    trained = [i for run in (stopped_mid_epoch, resumed) for outcome in run for i in outcome["trained"]]
    assert len(trained) == len(set(trained)), "a sample was trained on twice"
    assert sorted(trained) == list(range(SAMPLES)), f"missing: {sorted(set(range(SAMPLES)) - set(trained))}"
    assert all(o["state"]["epoch_complete"] for o in resumed)
    for rank, outcome in enumerate(resumed):
        assert outcome["draw"] == stopped_mid_epoch[rank]["next_draw"], f"rank {rank} RNG did not continue"
