"""Issues 28 and 38: one checkpoint, three front doors, every direction, on 2 real gloo ranks. The Trainer's FSDP2
checkpoint opens in a resuming Trainer, in Fabric and in a plain loop's Checkpointer with the same weights and
optimizer state; Fabric's and the Checkpointer's own checkpoints open in each other and in the Trainer; every resume
shows the same console line. One spawn (tests/helpers/three_doors.py does the work)."""

from __future__ import annotations

import re

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


def test_the_trainer_opens_fabrics_and_the_checkpointers_checkpoints_at_their_step(ranks):
    for rank in ranks:  # issue 48: their step carries over (it was a warm start at step 0)
        assert rank["trainer_from_fabric"] == {"unequal": [], "step": 3}
        assert rank["trainer_from_checkpointer"] == {"unequal": [], "step": 3}


def test_every_door_shows_the_same_resume_line_on_rank_0_only(ranks):
    line = re.compile(r"^lightning_shardckpt: resumed from (\S+) \(step 3\) on 2 -> 2 ranks, in \d+\.\d\ds$")
    resumed_from = [match[1].rsplit("/", 2)[-2] for text in ranks[0]["lines"] if (match := line.match(text))]
    # Trainer, Fabric, Checkpointer x2, Fabric, Trainer x2: each resume of the scenario, in order
    assert resumed_from == ["trainer", "trainer", "trainer", "fabric", "plain", "fabric", "plain"], ranks[0]["lines"]
    assert ranks[1]["lines"] == []
