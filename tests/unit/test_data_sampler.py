"""ResumableDistributedSampler, simulated: N samplers built with rank=i stand for N ranks.

Every test checks the one property that matters: over an epoch interrupted and resumed on another
world size, the samples trained on are the dataset exactly once (minus the declared drop_last tail).
"""

from __future__ import annotations

import io
import logging
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_shardckpt.errors import IncompatibleCheckpoint
from lightning_shardckpt.training.data import (
    ResumableDistributedSampler,
    capture_rng_state,
    restore_rng_state,
    rng_state_for_rank,
)

DATASET = range(103)  # prime: no world size or batch size divides it
SEED = 7


@dataclass
class Phase:
    """What one run (one world size) trained on before it stopped."""

    trained: list[int] = field(default_factory=list)
    state: dict | None = None
    dropped: list[int] = field(default_factory=list)
    first_batch: list[list[int]] = field(default_factory=list)


def run_phase(world, state=None, *, batch_size, steps=None, drop_last=False, accumulate=1, dataset=DATASET) -> Phase:
    """`world` ranks take `steps` micro-batches in lockstep (all if None); an optimizer step every
    `accumulate` micro-batches (and at the epoch's last batch) marks them consumed. Micro-batches of an
    unfinished accumulation are not trained on: their gradients die with the run."""
    samplers = [ResumableDistributedSampler(dataset, world, r, seed=SEED, drop_last=drop_last) for r in range(world)]
    if state is not None:
        for sampler in samplers:
            sampler.load_state_dict(state)
    # the loader fetches the whole stream up front: fetching must not move the position
    streams = [list(iter(sampler)) for sampler in samplers]
    assert len({len(s) for s in streams}) == 1, "ranks must yield equally many samples (DDP steps in lockstep)"
    real = [len(stream) - sampler.num_padded for stream, sampler in zip(streams, samplers)]
    num_batches = -(-len(streams[0]) // batch_size)
    steps = num_batches if steps is None else min(steps, num_batches)
    phase = Phase(dropped=samplers[0].dropped, first_batch=[s[:batch_size] for s in streams])
    applied, pending = 0, 0
    for batch in range(steps):
        pending += 1
        if pending == accumulate or batch == num_batches - 1:  # the optimizer steps
            for rank, sampler in enumerate(samplers):
                sampler.mark_consumed(pending, batch_size)
                start, stop = applied * batch_size, (applied + pending) * batch_size
                phase.trained += streams[rank][start : min(stop, real[rank])]  # padding is not a new sample
            applied, pending = applied + pending, 0
    states = [sampler.state_dict() for sampler in samplers]
    assert all(s == states[0] for s in states), "every rank must hold the same sampler state"
    phase.state = states[0]
    return phase


def assert_exactly_once(phases: list[Phase], dataset=DATASET) -> None:
    trained = [i for phase in phases for i in phase.trained]
    repeated = sorted({i for i in trained if trained.count(i) > 1})
    assert not repeated, f"samples trained twice: {repeated}"
    missing = sorted(set(dataset) - set(trained) - set(phases[-1].dropped))
    assert not missing, f"samples never trained on: {missing}"


@pytest.mark.parametrize("saved_on,resumed_on", [(4, 3), (4, 2), (2, 4), (3, 3)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [4, 5])
def test_epoch_resumed_on_another_world_size_trains_every_sample_once(saved_on, resumed_on, drop_last, batch_size):
    first = run_phase(saved_on, batch_size=batch_size, steps=3, drop_last=drop_last)
    assert first.state["global_position"] == 3 * batch_size * saved_on
    second = run_phase(resumed_on, first.state, batch_size=batch_size, drop_last=drop_last)
    assert_exactly_once([first, second])
    assert len(second.dropped) < resumed_on if drop_last else not second.dropped
    assert second.state["epoch_complete"]


def test_resumed_ranks_start_with_the_next_unseen_samples_of_the_same_order():
    first = run_phase(4, batch_size=5, steps=2)
    order = ResumableDistributedSampler(DATASET, 1, 0, seed=SEED).epoch_order()
    second = run_phase(3, first.state, batch_size=5)
    position = first.state["global_position"]
    dealt = sorted(i for batch in second.first_batch for i in batch)
    assert dealt == sorted(order[position : position + 3 * 5])


def test_gradient_accumulation_replays_micro_batches_of_an_unfinished_step():
    # 7 micro-batches with accumulate=3: two optimizer steps applied 6, the 7th died with the run
    first = run_phase(4, batch_size=3, steps=7, accumulate=3)
    assert first.state["global_position"] == 6 * 3 * 4
    second = run_phase(2, first.state, batch_size=3, accumulate=3)
    assert_exactly_once([first, second])


def test_chain_of_resumes_on_changing_world_sizes_trains_every_sample_once():
    phases, state = [], None
    for world, steps in [(4, 2), (3, 1), (5, 2), (2, 1), (1, None)]:
        phase = run_phase(world, state, batch_size=3, steps=steps)
        phases.append(phase)
        state = phase.state
    assert_exactly_once(phases)


def test_position_counts_consumed_batches_not_fetched_ones():
    sampler = ResumableDistributedSampler(DATASET, 4, 1, seed=SEED)
    fetched = list(iter(sampler))  # a prefetching loader may run far ahead of training
    assert len(fetched) == 26
    assert sampler.state_dict()["global_position"] == 0
    sampler.mark_consumed(2, 5)
    assert sampler.state_dict()["global_position"] == 2 * 5 * 4
    sampler.mark_consumed(100, 5)  # past the stream's end: stops at the epoch's end, padding not counted
    assert sampler.state_dict()["global_position"] == 103 and sampler.epoch_complete


def test_at_position_zero_it_yields_exactly_what_torch_distributed_sampler_yields():
    for drop_last in (False, True):
        for rank in range(4):
            ours = ResumableDistributedSampler(DATASET, 4, rank, seed=3, drop_last=drop_last)
            theirs = DistributedSampler(DATASET, 4, rank, seed=3, drop_last=drop_last)
            ours.set_epoch(2), theirs.set_epoch(2)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_padding_is_the_last_sample_of_ranks_past_the_remainder_and_flagged():
    samplers = [ResumableDistributedSampler(DATASET, 4, r, seed=SEED) for r in range(4)]
    streams = [list(s) for s in samplers]
    assert [s.num_padded for s in samplers] == [0, 0, 0, 1]  # 103 = 25 * 4 + 3
    real = [i for stream, s in zip(streams, samplers) for i in stream[: len(stream) - s.num_padded]]
    assert sorted(real) == list(DATASET)


def test_set_epoch_resets_position_only_for_another_epoch():
    sampler = ResumableDistributedSampler(DATASET, 2, 0, seed=SEED)
    list(sampler)
    sampler.mark_consumed(3, 4)
    sampler.set_epoch(0)  # Lightning calls it again for the epoch being resumed
    assert sampler.state_dict()["global_position"] == 24
    sampler.set_epoch(1)
    assert sampler.state_dict()["global_position"] == 0 and len(sampler) == 52


def test_state_of_a_finished_epoch_loads_as_the_start_of_the_next():
    finished = run_phase(4, batch_size=5).state
    assert finished["epoch_complete"] and finished["epoch"] == 0
    sampler = ResumableDistributedSampler(DATASET, 3, 0, seed=SEED)
    sampler.load_state_dict(finished)
    # an iterator made before the trainer's set_epoch(1) already deals epoch 1
    expected = ResumableDistributedSampler(DATASET, 3, 0, seed=SEED)
    expected.set_epoch(1)
    assert list(sampler) == list(expected)
    sampler.set_epoch(1)
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["global_position"] == 0


def test_state_for_another_dataset_is_refused_with_the_reason():
    state = run_phase(2, batch_size=4, steps=1).state
    sampler = ResumableDistributedSampler(range(50), 2, 0)
    with pytest.raises(IncompatibleCheckpoint, match="dataset of 103 samples, this one has 50"):
        sampler.load_state_dict(state)


def test_saved_seed_wins_over_the_constructor_seed_with_a_warning(caplog):
    first = run_phase(2, batch_size=4, steps=2)
    sampler = ResumableDistributedSampler(DATASET, 2, 0, seed=SEED + 1)
    with caplog.at_level(logging.WARNING, logger="lightning_shardckpt.training.data"):
        sampler.load_state_dict(first.state)
    assert "seed=8 differs from the checkpoint's 7" in caplog.text
    assert sampler.seed == SEED


def test_mark_consumed_rejects_nonsense():
    sampler = ResumableDistributedSampler(DATASET, 2, 0)
    with pytest.raises(ValueError, match="batch_size >= 1"):
        sampler.mark_consumed(1, 0)


# --- RNG ---
def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_state_restores_python_numpy_and_torch_draws():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = capture_rng_state()
    expected = _draws()
    _draws()
    restore_rng_state(state)
    assert _draws() == expected


def test_rng_states_survive_weights_only_torch_load():
    states = [capture_rng_state(), capture_rng_state()]
    buffer = io.BytesIO()
    torch.save(states, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    expected = _after_restore(states[1])
    assert _after_restore(loaded[1]) == expected


def _after_restore(state) -> tuple:
    restore_rng_state(state)
    return _draws()


def test_rank_beyond_the_saved_world_gets_a_derived_deterministic_distinct_state():
    saved = []
    for rank in range(2):
        torch.manual_seed(rank), random.seed(rank), np.random.seed(rank)
        saved.append(capture_rng_state())
    assert rng_state_for_rank(saved, 1) is saved[1]
    derived = rng_state_for_rank(saved, 3)
    assert derived["derived_from"] == 0
    assert _after_restore(derived) == _after_restore(rng_state_for_rank(saved, 3))  # deterministic
    assert _after_restore(derived) != _after_restore(rng_state_for_rank(saved, 2))  # distinct per rank
    assert _after_restore(derived) != _after_restore(saved[0])


def test_a_pass_resumed_mid_epoch_keeps_the_epochs_length_and_yields_only_the_rest():
    sampler = ResumableDistributedSampler(DATASET, 2, 0, seed=SEED)
    list(sampler)
    sampler.mark_consumed(3, 4)  # 24 samples of this pass on 2 ranks
    resumed = ResumableDistributedSampler(DATASET, 3, 1, seed=SEED)
    resumed.load_state_dict(sampler.state_dict())
    assert len(resumed) == 35  # ceil(103 / 3): Lightning sizes the epoch by the whole epoch's length
    assert len(list(resumed)) == resumed.num_samples == 27  # ceil((103 - 24) / 3)
