"""Issue 28: one checkpoint, three front doors, on 2 real gloo ranks. The Trainer's FSDP2 checkpoint opens in a
resuming Trainer, in Fabric and in a plain loop's Checkpointer with the same weights and optimizer state; Fabric's
and the Checkpointer's own checkpoints open in each other. One spawn (tests/helpers/three_doors.py does the work)."""

from __future__ import annotations

import pytest

from tests.helpers.spawn import run_ranks, values
from tests.helpers.three_doors import one_checkpoint_three_doors

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("doors")
    return values(run_ranks(one_checkpoint_three_doors, 2, str(workdir), timeout_s=240))


def test_the_trainer_resumes_its_checkpoint_with_identical_weights_and_optimizer_state(ranks):
    for rank in ranks:
        assert rank["trainer"] == {"unequal": [], "step": 3}


def test_fabric_opens_the_trainers_checkpoint_with_identical_weights_and_optimizer_state(ranks):
    for rank in ranks:
        assert rank["fabric"]["unequal"] == []


def test_the_checkpointer_opens_the_trainers_checkpoint_mapping_model_and_its_one_optimizer(ranks):
    for rank in ranks:
        loaded = rank["checkpointer"]
        assert loaded["step"] == 3 and loaded["unequal"] == []  # weights and AdamW moments, resharded
        assert loaded["lr"] != 1.0  # the Trainer's param groups, not the fresh optimizer's


def test_the_checkpointer_names_what_the_trainers_checkpoint_does_not_give_back(ranks):
    for rank in ranks:
        loaded = rank["checkpointer"]
        assert loaded["not_restored"] == ["the sampler's position", "the RNG states"]
        assert loaded["position"] == 0


def test_fabric_and_checkpointer_checkpoints_open_in_each_other(ranks):
    for rank in ranks:
        assert rank["from_fabric"]["step"] == 3 and rank["from_fabric"]["unequal"] == []
        assert rank["from_fabric"]["not_restored"] == ["the sampler's position", "the RNG states"]  # in "fabric"
        assert rank["from_checkpointer"]["unequal"] == []
