"""The Fabric front door's pieces that need no ranks: how a Fabric state is sorted and checked before a save, which
step names a save, and the sampler that keeps its epoch when Fabric's loader wrapper restarts its count."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_shardckpt import ConfigError
from lightning_shardckpt.lightning.fabric import fabric_state
from lightning_shardckpt.lightning.fabric.sampler import FabricResumableSampler, use_fabric_sampler

DATA = TensorDataset(torch.arange(10).float())


class Opaque:
    """A class no allow-list names."""


def test_a_state_is_sorted_into_model_optimizers_stateful_objects_and_plain_values():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    sampler = FabricResumableSampler(DATA, num_replicas=2, rank=0)
    loader = DataLoader(DATA, sampler=sampler, batch_size=2)
    parts = fabric_state.split(
        {"net": model, "opt": optimizer, "sched": scheduler, "data": loader, "iter_num": 3, "note": "x"}
    )
    assert parts.module_key == "net" and parts.module is model
    assert list(parts.optimizers) == ["opt"]
    assert parts.stateful == {"sched": scheduler, "data": sampler}  # a loader is saved by its sampler's position
    assert parts.values == {"iter_num": 3, "note": "x"}


@pytest.mark.parametrize(
    "state, named",
    [
        ({"a": torch.nn.Linear(1, 1), "b": torch.nn.Linear(1, 1)}, "two models ('a' and 'b')"),
        ({"opt": torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)}, "optimizer(s) ['opt'] but no model"),
        (
            {"loader": DataLoader(DATA, shuffle=True)},
            "state['loader'] is a DataLoader whose sampler is a RandomSampler",
        ),
    ],
)
def test_a_state_that_cannot_be_saved_is_refused_naming_the_entry(state, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        fabric_state.split(state)


def test_a_plain_value_a_resume_could_not_unpickle_is_named_at_save():
    from lightning_shardckpt.engine.format import safe_pickle
    from lightning_shardckpt.training.loadable import unloadable

    state = fabric_state.to_dcp_state(fabric_state.split({"step": 1, "thing": Opaque()}), rng=None)
    found = unloadable(state, {fabric_state.FABRIC_KEY: safe_pickle.LIGHTNING_STATE_GLOBALS})
    assert [blocked for _, blocked in found] == [f"{Opaque.__module__}.{Opaque.__qualname__}"]
    assert unloadable(fabric_state.to_dcp_state(fabric_state.split({"step": 1}), rng=None), {"fabric": ()}) == []


def test_the_step_comes_from_step_key_or_the_first_known_name():
    parts = fabric_state.split({"iter_num": 40, "step_count": 10})
    assert fabric_state.step_of(parts, None) == 10  # LitGPT: optimizer steps, not micro-batches
    assert fabric_state.step_of(parts, "iter_num") == 40
    assert fabric_state.step_of(fabric_state.split({"loss": 0.5}), None) is None
    with pytest.raises(ConfigError, match=r"step_key='epoch_no'.*None"):
        fabric_state.step_of(parts, "epoch_no")


def test_fabric_s_set_epoch_count_does_not_undo_a_restored_position():
    saved = FabricResumableSampler(DATA, num_replicas=2, rank=0, shuffle=True, seed=4)
    list(saved)
    saved.mark_consumed(2, 2)  # 8 of 10 samples of epoch 0
    resumed = FabricResumableSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=4)
    resumed.load_state_dict(saved.state_dict())
    resumed.set_epoch(0)  # what Fabric's loader wrapper calls on its first iteration after a resume
    assert (resumed.epoch, resumed.global_position) == (0, 8)
    assert list(resumed) == saved.epoch_order()[8:]  # the two samples epoch 0 had left


def test_the_sampler_starts_the_next_epoch_once_the_current_one_is_consumed():
    sampler = FabricResumableSampler(DATA, num_replicas=2, rank=0, shuffle=True, seed=4)
    first = list(sampler)
    sampler.mark_consumed(2, 2)  # a loop that stopped early: the epoch goes on where it stopped
    assert list(sampler) == first[4:] and sampler.epoch == 0
    sampler.mark_consumed(1, 2)
    torch_sampler = DistributedSampler(DATA, num_replicas=2, rank=0, shuffle=True, seed=4)
    torch_sampler.set_epoch(1)
    assert list(sampler) == list(torch_sampler) and sampler.epoch == 1  # epoch 1's order, from its start
    unmarked = FabricResumableSampler(DATA, num_replicas=2, rank=0, shuffle=True, seed=4)
    list(unmarked)
    list(unmarked)  # a loop that never marks consumption still gets a new epoch per full pass
    assert unmarked.epoch == 1


def test_fabric_s_injected_distributed_sampler_becomes_resumable_and_others_stay():
    plain = DataLoader(DATA, sampler=DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True, seed=9))
    swapped = use_fabric_sampler(plain)
    assert isinstance(swapped.sampler, FabricResumableSampler)
    assert list(swapped.sampler) == list(plain.sampler)  # the same order at position 0
    custom = DataLoader(DATA, shuffle=True)
    assert use_fabric_sampler(custom) is custom


def test_the_plugins_state_is_saved_in_the_fabric_section_and_given_back_on_load():
    plugins = {"keep_steps": {"kept": ["step-000000002-abc"]}, "health": None}
    saved = fabric_state.to_dcp_state(fabric_state.split({"step": 4}), rng=None, plugins=plugins)
    rest = fabric_state.saved_rest(saved, fabric_state.FABRIC_KEY, trust=False, where="ROOT/step-4")
    assert rest.plugins == plugins
    older = fabric_state.to_dcp_state(fabric_state.split({"step": 4}), rng=None)  # a save without plug-in state
    assert fabric_state.saved_rest(older, fabric_state.FABRIC_KEY, trust=False, where="ROOT/step-4").plugins == {}
